"""Agreement with full prefill on an index and a file of questions; choosing and saving the default (kvrag tune)."""

import json

import pytest
from tiny import FACTS, HashEmbedder, save_tiny

from kvrag.cli import main
from kvrag.engine.rag import KVRAG
from kvrag.errors import IndexLoadError, InvalidRequestError
from kvrag.lab.study.agreement import candidates, choose, read_questions
from kvrag.lab.study.metrics import normalize
from kvrag.plan.defaults import TUNED, load_default

QUESTIONS = [
    "Who built the lighthouse of Karsa?",
    "How many ships does Velloria's harbour hold?",
    "When does the river Tam flood?",
    "What does the old mill of Brenn grind?",
]


@pytest.fixture
def index(tmp_path, monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", HashEmbedder)
    model = save_tiny(tmp_path / "model")
    rag = KVRAG.from_defaults(tmp_path / "index", model=str(model), cache_dir=tmp_path / "cache")
    rag.ingest(FACTS, progress=False)
    questions = tmp_path / "questions.txt"
    questions.write_text(
        "# a query log\n" + "\n".join(QUESTIONS) + "\n\n" + json.dumps({"question": "Where is Sarnac?"})
    )
    return tmp_path / "index", questions


def test_tune_measures_agreement_chooses_the_fastest_above_the_floor_and_saves_it(index, tmp_path, capsys):
    folder, questions = index
    out = tmp_path / "tune"
    args = ["--index", folder, "--questions", questions, "--out", out, "--top-k", "3", "--quiet"]
    args += ["--candidates", "reuse,target_recompute,full_prefill_top1", "--budgets", "0.05", "--floor", "0.5"]
    assert main(["agree", *map(str, args)]) == 0
    assert not (folder / TUNED).exists()  # agree measures only
    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results["rows"]] == ["reuse", "target_recompute (retriever)", "full_prefill_top1"]
    assert len(results["questions"]) == 5
    for q in results["questions"]:
        assert len(q["sources"]) == 3
        for answer in q["answers"].values():
            assert answer["agrees"] == (normalize(answer["text"]) == normalize(q["full_prefill_text"]))
    for row in results["rows"]:
        agreed = sum(q["answers"][row["label"]]["agrees"] for q in results["questions"])
        assert row["agreed"] == agreed and row["agreement"] == agreed / 5
        assert row["agreement_ci"][0] <= row["agreement"] <= row["agreement_ci"][1]
    assert (out / "agreement.png").stat().st_size > 0 and "| reuse |" in (out / "table.md").read_text()
    choice = choose(results["rows"], 0.5)
    assert results["choice"]["strategy"] == choice["strategy"]

    assert main(["tune", *map(str, args)]) == 0
    said = capsys.readouterr().out
    assert "saved as the default" in said
    saved, tuned = load_default(folder), json.loads((out / "results.json").read_text())
    assert saved == {k: tuned["choice"][k] for k in ("strategy", "picker", "budget")}
    rag = KVRAG.load(folder)
    assert rag.defaults == saved
    answer = rag.query(QUESTIONS[0], max_new_tokens=2, top_k=3)
    assert answer.stats.strategy == saved["strategy"]  # used by default from then on
    assert rag.query(QUESTIONS[0], strategy="reuse", max_new_tokens=1).stats.strategy == "reuse"


def test_choice_is_the_fastest_that_reaches_the_floor_else_full_prefill():
    rows = [
        {
            "strategy": "reuse",
            "picker": None,
            "budget": 0.05,
            "agreement": 0.6,
            "agreement_ci": [0.4, 0.8],
            "ttft_s": 0.1,
            "full_prefill_ttft_s": 2.0,
        },
        {
            "strategy": "target_recompute",
            "picker": "retriever",
            "budget": 0.05,
            "agreement": 0.92,
            "agreement_ci": [0.8, 0.97],
            "ttft_s": 0.5,
            "full_prefill_ttft_s": 2.0,
        },
        {
            "strategy": "token_select",
            "picker": None,
            "budget": 0.2,
            "agreement": 0.95,
            "agreement_ci": [0.8, 0.99],
            "ttft_s": 0.9,
            "full_prefill_ttft_s": 2.0,
        },
    ]
    assert choose(rows, 0.9)["strategy"] == "target_recompute"
    assert choose(rows, 0.5)["strategy"] == "reuse"
    none = choose(rows, 0.99)
    assert none["strategy"] == "full_prefill" and not none["reached_floor"] and none["ttft_s"] == 2.0


def test_a_forged_or_broken_default_is_refused_with_what_to_do(index):
    folder, _ = index
    (folder / TUNED).write_text(json.dumps({"strategy": "rm -rf", "budget": 0.05}))
    with pytest.raises(IndexLoadError, match="not a default written by `kvrag tune`.*unknown strategy"):
        KVRAG.load(folder)
    (folder / TUNED).write_text(json.dumps({"strategy": "reuse", "budget": 7}))
    with pytest.raises(IndexLoadError, match="delete it or run kvrag tune again"):
        load_default(folder)
    (folder / TUNED).write_text("{not json")
    with pytest.raises(IndexLoadError):
        load_default(folder)


def test_candidates_and_questions_are_checked(tmp_path):
    got = candidates(["reuse", "token_select", "target_recompute:likelihood"], [0.05, 0.2])
    assert [c.label for c in got] == [
        "reuse",
        "token_select @ 0.05",
        "token_select @ 0.2",
        "target_recompute (likelihood)",
    ]
    with pytest.raises(InvalidRequestError, match="unknown strategy"):
        candidates(["magic"], [0.05])
    with pytest.raises(InvalidRequestError, match="only a strategy that takes any picker"):
        candidates(["reuse:oracle"], [0.05])
    empty = tmp_path / "q.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(Exception, match="holds no question"):
        read_questions(empty)


def test_the_shipped_default_is_the_recipe_except_on_the_embedded_model():
    from kvrag.model.loading import EMBEDDED_WEIGHTS
    from kvrag.plan.defaults import EMBEDDED, RECIPE, shipped_default

    assert shipped_default(EMBEDDED_WEIGHTS) == EMBEDDED and EMBEDDED["strategy"] == "target_only"
    assert EMBEDDED["picker"] == "gap"
    assert shipped_default("sha256:other") == RECIPE and RECIPE["strategy"] == "target_recompute"


def test_a_named_models_default_may_split_questions(tmp_path):
    from kvrag.model import catalog
    from kvrag.plan.defaults import QWEN_05B, default_parts, load_default, save_default, shipped_default

    assert shipped_default(catalog.QWEN_05B.weights) == QWEN_05B and default_parts(QWEN_05B) == "auto"
    assert default_parts(shipped_default("sha256:other")) is None
    choice = {"strategy": "target_only", "picker": "likelihood", "budget": 0.05}
    save_default(tmp_path, {**choice, "parts": "auto"})
    assert load_default(tmp_path) == {**choice, "parts": "auto"}
    save_default(tmp_path, choice)
    assert load_default(tmp_path) == choice
    save_default(tmp_path, {**choice, "parts": "every"})
    with pytest.raises(IndexLoadError, match="is not a default written by `kvrag tune`"):
        load_default(tmp_path)


def test_an_index_without_a_tuned_default_runs_the_models_shipped_default(index):
    folder, _ = index
    rag = KVRAG.load(folder)
    assert rag.defaults is None  # a tiny model: the recipe
    answer = rag.query(QUESTIONS[0], max_new_tokens=1, top_k=3)
    assert answer.stats.strategy == "target_recompute" and answer.stats.budget == 0.05
    assert (
        rag.kvmodel.answer(QUESTIONS[0], ["a text", "another"], max_new_tokens=1).stats.strategy == "target_recompute"
    )
