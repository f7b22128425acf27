"""The study harness: generators, metrics on hand-made cases, the JSONL loader, and quick runs that write
every output file (a tiny model over a user file; the default model over the built-in sets)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny import HashEmbedder, byte_tokenizer, save_tiny, tiny_model

from kvrag.cli import main
from kvrag.errors import DocumentError, InvalidRequestError, KVRAGError
from kvrag.lab.study import BUILTIN, StudyConfig, StudyRunner, builtin, load_items, load_jsonl, run_study
from kvrag.lab.study.data import MULTI, SINGLE, parse_item
from kvrag.lab.study.metrics import (
    bootstrap_diff,
    contains_answer,
    correct,
    kl_topk,
    mcnemar,
    normalize,
    token_f1,
    topk_logprobs,
    wilson,
)
from kvrag.model.kvmodel import KVModel

# -- generators ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SINGLE)
def test_builtin_sets_are_deterministic_and_answerable_from_the_target_only(name: str) -> None:
    items = builtin(name, seed=3, limit=60)
    assert len(items) == 60
    assert [i.to_dict() for i in items] == [i.to_dict() for i in builtin(name, seed=3, limit=60)]
    assert [i.question for i in items] != [i.question for i in builtin(name, seed=4, limit=60)]
    assert len({i.id for i in items}) == len(items)
    for item in items:
        assert 8 <= len(item.chunks) <= 10
        assert len({c.id for c in item.chunks}) == len(item.chunks)
        target = item.chunks[item.target_index]
        assert correct(target.text, item.answers), (item.id, item.answers)
        for chunk in item.chunks:
            if chunk.id != item.target:
                assert not correct(chunk.text, item.answers), (item.id, chunk.id, item.answers)
        assert not correct(item.question, item.answers)
    assert len({i.target_index for i in items}) >= 6  # the target's place varies


def _holders(item, text: str) -> list[str]:
    return [c.id for c in item.chunks if contains_answer(c.text, text)]


@pytest.mark.parametrize("name", MULTI)
def test_multi_chunk_sets_need_every_target_and_hold_each_fact_in_one_chunk(name: str) -> None:
    items = builtin(name, seed=3, limit=40)
    assert len(items) == 40 and set(BUILTIN) >= set(MULTI)
    assert [i.to_dict() for i in items] == [i.to_dict() for i in builtin(name, seed=3, limit=40)]
    assert [i.question for i in items] != [i.question for i in builtin(name, seed=4, limit=40)]
    assert len({i.id for i in items}) == len(items)
    for item in items:
        targets = item.target_ids
        assert len(targets) == (3 if name == "lists" else 2) and 8 <= len(item.chunks) <= 10, item.id
        assert item.target == targets[0] and parse_item(json.loads(json.dumps(item.to_dict()))) == item
        gold = item.gold_text()
        assert item.is_correct(gold) and not item.is_correct("I do not know.")
        assert not item.is_correct(item.question)
        if name == "compare":  # the winner's name in its own article only, the loser's in the other's only
            (winner,), (loser,) = item.parts[0], item.excludes
            won, lost = _holders(item, winner), _holders(item, loser)
            assert len(won) == len(lost) == 1 and sorted(won + lost) == sorted(targets)
            assert not item.is_correct(f"{winner} or {loser}")  # naming both is not an answer
        elif name == "bridge":  # the answer in the second hop's chunk only; the link in both and nowhere else
            (answer,) = item.parts[0]
            assert _holders(item, answer) == targets[1:]
            first, second = (next(c for c in item.chunks if c.id == t) for t in targets)
            link = second.text.split(" ")  # the person's article names them; the first chunk names them too
            assert any(contains_answer(first.text, " ".join(link[k : k + 2])) for k in range(len(link) - 1))
        else:  # every part in exactly one chunk, each target holding one part
            holders = [_holders(item, part[0]) for part in item.parts]
            assert [h for h in holders] == [[t] for t in targets], (item.id, holders)
            assert not item.is_correct(item.parts[0][0])  # one part alone is not the answer


def test_a_multi_chunk_line_is_read_and_a_malformed_one_refused(tmp_path) -> None:
    chunks = [{"id": k, "text": f"Fact {k}: the value of {k} is {v}."} for k, v in (("a", 11), ("b", 22), ("c", 33))]
    good = {**_item(1, chunks=chunks), "targets": ["a", "c"], "answers_all": [["11"], ["33", "thirty-three"]]}
    del good["target"], good["answers"]
    lines = [
        good,
        {**good, "id": "q2", "targets": ["a", "zzz"]},
        {**good, "id": "q3", "answers_all": [["11"], []]},
        {**good, "id": "q4", "targets": ["a", "a"]},
        {**good, "id": "q5", "target": "b"},
        {**good, "id": "q6", "answers_all": "11"},
        {**good, "id": "q7", "excludes": [3]},
    ]
    path = tmp_path / "multi.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    items, problems = load_jsonl(path)
    (item,) = items
    assert item.target == "a" and item.target_ids == ["a", "c"] and item.target_indices == [0, 2]
    assert item.is_correct("11 and thirty-three") and not item.is_correct("only 11")
    assert item.gold_text() == "11 and 33" and item.f1("11 and 33") == 1.0
    expected = ["target 'zzz' is not the id", "part 1 holds no answer", "'targets' repeats", "'b' is not one of",
                "'answers_all' must be a non-empty list", "'excludes' must be a list of strings"]
    assert len(problems) == len(expected)
    for problem, phrase in zip(problems, expected):
        assert phrase in problem, problem


def test_variants_pair_one_question_with_same_kind_and_mixed_distractors() -> None:
    items = builtin("api_docs", limit=40)
    for same, mixed in zip(items[::2], items[1::2]):
        assert (same.variant, mixed.variant) == ("same", "mixed")
        assert same.question == mixed.question and same.target == mixed.target
        assert same.target_index == mixed.target_index
        # same kind: other API entries; mixed: at least one text of another kind (article or chat session)
        assert all("(" in c.text.split("\n", 1)[0] for c in same.chunks)
        assert any("(" not in c.text.split("\n", 1)[0] for c in mixed.chunks)


def test_chunk_range_scales_contexts_up() -> None:
    items = builtin("open_qa", limit=10, chunks=(16, 20))
    assert all(16 <= len(i.chunks) <= 20 for i in items)
    with pytest.raises(InvalidRequestError, match="MIN-MAX"):
        builtin("open_qa", chunks=(5, 3))
    with pytest.raises(InvalidRequestError, match="unknown built-in"):
        builtin("trivia")


def test_load_items_interleaves_sets_so_a_stopped_run_covers_each() -> None:
    items, problems = load_items("builtin:all", limit=4)
    assert problems == []
    assert [i.family for i in items[: len(BUILTIN)]] == list(BUILTIN)
    assert sum(i.family == "dialogue" for i in items) == 4


# -- metrics -------------------------------------------------------------------------------------------


def test_answer_match_is_whole_tokens_after_normalization() -> None:
    assert contains_answer("The founder of Velloria is Marten Dorek.", "marten dorek")
    assert not contains_answer("The founder is Marten Dorekson.", "Marten Dorek")
    assert not contains_answer("It is 170.", "70")
    assert contains_answer("About 12,000 people live there.", "12000")
    assert contains_answer("width=70 by default", "70")
    assert contains_answer("css='calendar.css'", "calendar.css")
    assert not contains_answer("anything", "...")
    assert normalize("Ça, c'est 1,234!") == ["ça", "c", "est", "1234"]


def test_token_f1_on_hand_made_cases() -> None:
    assert token_f1("Marten Dorek", ["Marten Dorek"]) == 1.0
    assert token_f1("The founder is Marten Dorek", ["Marten Dorek"]) == pytest.approx(2 * 0.4 * 1 / 1.4)
    assert token_f1("nobody", ["Marten Dorek", "nobody"]) == 1.0
    assert token_f1("", ["x"]) == 0.0


def test_intervals_and_paired_tests() -> None:
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-3)
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    # 6 discordant pairs all one way: p = 2 * 0.5**6
    assert mcnemar([True] * 6 + [False] * 4, [False] * 6 + [False] * 4) == (6, 0, pytest.approx(0.03125))
    assert mcnemar([True, False], [True, False]) == (0, 0, 1.0)
    mean, lo, hi = bootstrap_diff([1.0] * 20, [0.0] * 10 + [1.0] * 10)
    assert mean == 0.5 and lo < 0.5 < hi


def test_topk_kl_matches_full_kl_when_k_covers_the_vocabulary() -> None:
    torch.manual_seed(0)
    ref, other = torch.randn(4, 30), torch.randn(4, 30)
    full = torch.nn.functional.kl_div(
        torch.log_softmax(other, -1), torch.log_softmax(ref, -1), log_target=True, reduction="none"
    ).sum(-1)
    ids, logp = topk_logprobs(ref, k=30)
    assert kl_topk(ids, logp, other) == pytest.approx(float(full.mean()), rel=1e-4)
    ids, logp = topk_logprobs(ref, k=5)  # coarse-grained: never above the full KL
    assert 0 < kl_topk(ids, logp, other) <= float(full.mean()) + 1e-6
    assert kl_topk(*topk_logprobs(ref, k=5), ref) == pytest.approx(0.0, abs=1e-5)


# -- the JSONL format ----------------------------------------------------------------------------------


def _item(n: int, **changes: object) -> dict:
    row = {
        "id": f"q{n}",
        "family": "facts",
        "question": "What is the best-known product of Velloria?",
        "answers": ["blue glass"],
        "chunks": [
            {"id": "a", "text": "Dorwick makes copper bells and smoked eel."},
            {"id": "b", "text": "Velloria is known for blue glass."},
        ],
        "target": "b",
    }
    row.update(changes)
    return row


def test_loader_skips_bad_lines_and_says_which(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps(_item(1)),
        "{not json",
        json.dumps(_item(2, target="zzz")),
        json.dumps(_item(3, answers=[])),
        json.dumps(_item(4, answers=["  ", "!"])),
        json.dumps(["a list"]),
        json.dumps(_item(5, chunks=[{"id": "b", "text": "   "}])),
        json.dumps(_item(1)),
        "",
        json.dumps(_item(6, variant="mixed")),
    ]
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    items, problems = load_jsonl(path)
    assert [i.id for i in items] == ["q1", "q6"]
    assert items[1].variant == "mixed" and items[0].target_index == 1
    expected = {
        2: "not valid JSON",
        3: "target 'zzz' is not the id",
        4: "'answers' holds no answer",
        5: "'answers' holds no answer",
        6: "must be a JSON object",
        7: "has no text",
        8: "repeats an earlier line",
        11: "not UTF-8",
    }
    assert len(problems) == len(expected)
    for problem, (line, phrase) in zip(problems, expected.items()):
        assert problem.startswith(f"{path}:{line}: ") and phrase in problem, problem


def test_loader_refuses_a_file_with_nothing_usable(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("{}\n[]\n")
    with pytest.raises(DocumentError, match=r"no usable study item in .*bad.jsonl: .*:1: 'id' must be"):
        load_jsonl(path)
    with pytest.raises(DocumentError, match="cannot read the study data"):
        load_jsonl(tmp_path / "missing.jsonl")


# -- quick runs ----------------------------------------------------------------------------------------

OUTPUTS = (
    "results.json",
    "table.md",
    "retention_by_strategy.png",
    "agreement_by_strategy.png",
    "retention_vs_budget.png",
)
ROW_KEYS = ("accuracy", "retention", "n", "n_context_dependent", "recomputed_fraction", "ttft_s", "picker_accuracy")


def _study(capsys, *args: object) -> tuple[int, str]:
    code = main(["study", *map(str, args)])
    return code, capsys.readouterr().err


def _user_file(tmp_path) -> Path:
    """Six items of two families, then a broken line (line 7)."""
    data = tmp_path / "data.jsonl"
    rows = [
        _item(
            n,
            family="facts" if n % 2 else "notes",
            chunks=[{"id": f"c{k}", "text": f"Fact {k}: town {k} sells item {k * n}."} for k in range(4)],
            target=f"c{n % 4}",
            answers=[f"item {(n % 4) * n}"],
        )
        for n in range(1, 7)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    return data


def _records(out: Path) -> dict[tuple, dict]:
    rows = [json.loads(line) for path in (out / "cache").glob("records*.jsonl") for line in path.open()]
    return {(r["item"], r["strategy"], r["picker"], r["budget"]): r for r in rows}


def test_cli_study_on_a_user_file_writes_every_output_and_reruns_from_cache(tmp_path, capsys) -> None:
    model = save_tiny(tmp_path / "model")
    data = _user_file(tmp_path)
    out = tmp_path / "run"
    args = ("--data", data, "--out", out, "--model", model, "--budgets", "0.05,0.5", "--pickers", "oracle")
    code, err = _study(capsys, *args, "--quiet")
    assert code == 0, err
    assert f"skipped {data}:7: not valid JSON" in err
    for name in OUTPUTS:
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "kvrag-study/1" and results["data"]["items"] == 6
    assert results["data"]["skipped"] == [
        f"{data}:7: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    ]
    assert {(g["family"], g["variant"]) for g in results["groups"]} == {
        ("facts", "all"),
        ("notes", "all"),
        ("all", "all"),
    }
    labels = set(results["strategies"])
    assert "target_recompute (oracle) @ 0.05" in labels and "token_select @ 0.5" in labels
    for row in results["strategies"].values():
        assert all(k in row for k in ROW_KEYS)
        assert row["n"] == 6 and 0 <= row["accuracy"] <= 1 and 0 <= row["recomputed_fraction"] <= 1
    overall = results["strategies"]
    assert overall["reuse @ 0.05"]["recomputed_fraction"] == 0
    assert overall["target_recompute (oracle) @ 0.05"]["picker_accuracy"] == 1.0
    assert overall["insert_full_kv (oracle) @ 0.05"]["target_kv_distance"] < 1e-3  # the full-prefill slice itself
    assert (
        overall["reuse @ 0.05"]["target_kv_distance"] > overall["insert_full_kv (oracle) @ 0.05"]["target_kv_distance"]
    )
    # a budget-free strategy ran once and serves both budgets; token_select ran at each
    records = (out / "cache" / "records.jsonl").read_text().split("\n")[:-1]  # JSON lines end at "\n" only
    assert len(records) == 6 * (len(results["config"]["rows"]))
    assert "## facts / all" in (out / "table.md").read_text()

    code, err = _study(capsys, *args, "--quiet")  # the rerun finds every record in the cache
    assert code == 0, err
    assert (out / "cache" / "records.jsonl").read_text().split("\n")[:-1] == records
    assert json.loads((out / "results.json").read_text())["data"]["cached_items"] == 6


def test_a_default_row_runs_the_models_shipped_default_beside_the_same_strategy_named(tmp_path, capsys) -> None:
    from kvrag.plan.defaults import RECIPE

    model = save_tiny(tmp_path / "model")
    out = tmp_path / "run"
    args = ("--data", _user_file(tmp_path), "--out", out, "--model", model, "--pickers", "retriever", "--quiet")
    code, err = _study(capsys, *args, "--strategies", "default,target_recompute,reuse")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert RECIPE["strategy"] == "target_recompute"  # the tiny model's shipped default: the study's recipe
    assert results["config"]["default"] == RECIPE
    default, named = results["strategies"]["default = target_recompute @ 0.05"], None
    named = results["strategies"]["target_recompute (retriever) @ 0.05"]
    assert default["n"] == named["n"] == 6
    records = [json.loads(line) for line in (out / "cache" / "records.jsonl").open()]
    assert sum(r["default"] for r in records) == 6 and len(records) == 18  # its own records, not the named row's


def test_parts_rows_answer_multi_chunk_items_a_part_at_a_time(tmp_path, capsys) -> None:
    model = save_tiny(tmp_path / "model")
    data = tmp_path / "multi.jsonl"
    rows = []
    for n in range(1, 4):
        chunks = [{"id": f"c{k}", "text": f"Fact {k}: town {k} sells item {k * n}."} for k in range(4)]
        rows.append(
            {
                "id": f"m{n}",
                "family": "pairs",
                "question": f"What does town {n % 4} sell, and what does town {(n + 1) % 4} sell?",
                "chunks": chunks,
                "targets": [f"c{n % 4}", f"c{(n + 1) % 4}"],
                "answers_all": [[f"item {(n % 4) * n}"], [f"item {((n + 1) % 4) * n}"]],
            }
        )
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "run"
    args = ("--data", data, "--out", out, "--model", model, "--quiet", "--strategies", "target_recompute+parts,reuse")
    code, err = _study(capsys, *args)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "cache" / "records.jsonl").open()]
    parts = [r for r in records if "parts" in r and r["strategy"] == "target_recompute"]
    assert len(parts) == 3 and all(r["parts"] == 2 and len(r["picked_set"]) == 2 for r in parts)
    assert all(r["kl"] is None and r["answer_s"] >= r["ttft_s"] > 0 for r in parts)
    assert all(0 <= r["targets_read"] <= 1 and r["targets"] for r in records)
    results = json.loads((out / "results.json").read_text())
    row = results["strategies"]["target_recompute (retriever) +parts @ 0.05"]
    assert row["n"] == 3 and row["parts"] == 2 and row["answer_s"] > 0 and row["kl_median"] is None
    assert "| target_recompute (retriever) +parts |" in (out / "table.md").read_text()


def test_study_compare_puts_runs_side_by_side(tmp_path, capsys) -> None:
    model = save_tiny(tmp_path / "model")
    data = _user_file(tmp_path)
    for name, strategies in (("a", "default,reuse"), ("b", "reuse,full_prefill_top1")):
        args = ("--data", data, "--out", tmp_path / name, "--model", model, "--strategies", strategies, "--quiet")
        code, err = _study(capsys, *args)
        assert code == 0, err
    code = main(["study-compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")])
    assert code == 0
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert (tmp_path / "cmp" / "compare_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    section = text.split("## facts / all")[1].split("##")[0]
    lines = {line.split("|")[1].strip(): line.split("|")[2:4] for line in section.splitlines() if line.startswith("| ")}
    facts = next(g for g in a["groups"] if (g["family"], g["variant"]) == ("facts", "all"))
    reuse = next(r for r in facts["rows"] if r["label"] == "reuse")
    lo, hi = reuse["accuracy_ci"]
    assert lines["reuse"][0].strip().startswith(f"{100 * reuse['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}], ")
    assert lines["default = target_recompute"][1].strip() == "-"  # run b has no default row
    assert lines["full_prefill_top1"][0].strip() == "-" and "(n 3)" in lines["full_prefill_top1"][1]
    assert "closed book" in lines and "full prefill" in lines
    assert main(["study-compare", str(tmp_path / "missing"), "--out", str(tmp_path / "cmp")]) == 2
    assert "not a study's results" in capsys.readouterr().err


def test_cli_study_with_two_worker_processes_gives_the_records_of_one(tmp_path, capsys) -> None:
    model = save_tiny(tmp_path / "model")
    data = _user_file(tmp_path)
    args = ("--data", data, "--model", model, "--strategies", "reuse,target_recompute:oracle,token_select", "--quiet")
    code, err = _study(capsys, *args, "--out", tmp_path / "one")
    assert code == 0, err
    code, err = _study(capsys, *args, "--out", tmp_path / "two", "--jobs", "2", "--threads", "2")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "two" / "cache").iterdir()) == [
        "records.job0of2.jsonl",
        "records.job1of2.jsonl",
        "references.job0of2.jsonl",
        "references.job1of2.jsonl",
    ]
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) == 6 * 3
    for key in one:
        assert (one[key]["text"], one[key]["correct"]) == (two[key]["text"], two[key]["correct"])
        assert one[key]["kl"] == pytest.approx(two[key]["kl"], abs=1e-4)
    results = json.loads((tmp_path / "two" / "results.json").read_text())
    assert results["jobs"] == 2 and results["data"]["items"] == 6
    single = json.loads((tmp_path / "one" / "results.json").read_text())["strategies"]
    assert {k: v["accuracy"] for k, v in results["strategies"].items()} == {k: v["accuracy"] for k, v in single.items()}


def test_a_failing_or_mismatched_worker_stops_the_run_with_a_message(tmp_path) -> None:
    model = save_tiny(tmp_path / "model")
    kv = KVModel.from_pretrained(model)
    items, _ = load_items(str(_user_file(tmp_path)))
    out = tmp_path / "run"
    with pytest.raises(KVRAGError, match=r"worker \d of 2 failed: .*run the same command again"):
        run_study(kv, items, out, jobs=2, worker_model={"name_or_path": tmp_path / "missing"}, progress=False)
    assert not (out / "results.json").exists()
    other = tmp_path / "other"  # the same architecture, other weights: records under another settings key
    tiny_model("llama", seed=1).save_pretrained(other)
    byte_tokenizer().save_pretrained(other)
    config = StudyConfig(strategies=("reuse",))
    with pytest.raises(KVRAGError, match="loaded a different model or settings"):
        run_study(kv, items[:2], out, config=config, jobs=2, worker_model={"name_or_path": other}, progress=False)
    with pytest.raises(InvalidRequestError, match="needs worker_model"):
        run_study(kv, items, out, jobs=2, progress=False)


def test_a_record_after_a_line_cut_short_is_read_back(tmp_path) -> None:
    """A killed writer leaves half a line; the next run's records still start on lines of their own."""
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    items, _ = load_items(str(_user_file(tmp_path)))
    config = StudyConfig(strategies=("reuse",))
    StudyRunner(kv, HashEmbedder(), config, tmp_path / "cache").run(items[:1])
    records = tmp_path / "cache" / "records.jsonl"
    records.write_text(records.read_text() + '{"key": "half a rec')
    StudyRunner(kv, HashEmbedder(), config, tmp_path / "cache").run(items[1:2])
    runner = StudyRunner(kv, HashEmbedder(), config, tmp_path / "cache")
    assert runner.done(items[0]) and runner.done(items[1])


def test_a_rerun_with_every_row_cached_runs_no_forward_even_without_references(tmp_path) -> None:
    """Resuming reads records; an item whose rows are all there is never prefilled again, references included."""
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    items, _ = load_items(str(_user_file(tmp_path)))
    config = StudyConfig(strategies=("full_prefill", "reuse", "target_recompute"), budgets=(0.1,))
    cache = tmp_path / "cache"
    first = StudyRunner(kv, HashEmbedder(), config, cache).run(items)
    lines = (cache / "records.jsonl").read_text().split("\n")[:-1]
    (cache / "records.jsonl").write_text("\n".join(lines[:-2]) + "\n")  # the last item lost two rows
    for path in cache.glob("references*.jsonl"):
        path.unlink()
    calls = []
    hook = kv.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        runner = StudyRunner(kv, HashEmbedder(), config, cache)
        assert [runner.done(i) for i in items] == [True] * 5 + [False]
        again = runner.run(items[:5])
        assert calls == [] and again == first[: len(again)]
        runner.run(items[5:])
        assert calls  # the item with missing rows is computed
    finally:
        hook.remove()
    assert StudyRunner(kv, HashEmbedder(), config, cache).done(items[5])
    more = StudyConfig(strategies=(*config.strategies, "target_only"), budgets=(0.1,))
    hook = kv.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        calls.clear()
        results = run_study(kv, items, tmp_path, config=config, embedder=HashEmbedder(), report_only=True)
        assert calls == [] and results["data"]["items"] == 6 and results["data"]["skipped"] == []
        partial = run_study(kv, items, tmp_path, config=more, embedder=HashEmbedder(), report_only=True)
        assert calls == [] and partial["data"]["items"] == 0  # no item has the new row yet
        assert partial["data"]["skipped"][0] == f"item {items[0].id}: not every row is in the cache"
    finally:
        hook.remove()


def test_agreement_with_full_prefill_is_measured_without_gold_and_full_prefill_agrees_with_itself(tmp_path) -> None:
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    items, _ = load_items(str(_user_file(tmp_path)))
    config = StudyConfig(
        strategies=("full_prefill", "reuse", "full_prefill_top1", "target_recompute:oracle@lead"), budgets=(0.1,)
    )
    results = run_study(kv, items, tmp_path / "run", config=config, embedder=HashEmbedder(), progress=False)
    rows = results["strategies"]
    full = rows["full_prefill @ 0.1"]
    assert full["agreement"] == 1.0 and full["agreement_ci"][1] == 1.0 and full["agreed"] == full["n"] == 6
    assert "target_recompute (oracle) +lead @ 0.1" in rows
    for row in rows.values():
        assert 0 <= row["agreement"] <= 1 and row["n_agreement"] == 6
    records = _records(tmp_path / "run")
    for r in records.values():
        assert r["agrees"] == (normalize(r["text"]) == normalize(r["full_prefill_text"]))
    top1 = [r for r in records.values() if r["strategy"] == "full_prefill_top1"]
    assert all(len(r["own_order"]) == 1 for r in top1)
    assert (tmp_path / "run" / "agreement_by_strategy.png").stat().st_size > 0
    assert "agrees with FP" in (tmp_path / "run" / "table.md").read_text()
    assert wilson(6, 6)[1] == 1.0 and wilson(0, 6)[0] == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budgets", "0.05,abc"], "--budgets must be a comma-separated list"),
        (["--jobs", "0"], "--jobs must be in 1..64"),
        (["--budget", "0"], "budget must be a fraction"),
        (["--budget", "0.1", "--budgets", "0.2"], "not both"),
        (["--strategies", "reuse,magic"], "unknown strategy 'magic'"),
        (["--pickers", "psychic"], "unknown picker 'psychic'"),
        (["--chunks", "8"], "--chunks must be MIN-MAX"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--shard", "2/2"], "--shard must be I/N"),
        (["--strategies", "reuse:oracle"], "only a strategy that takes any picker"),
        (["--strategies", "reuse@zip"], "the only encoding a row may name is @lead"),
    ],
)
def test_cli_study_refuses_bad_arguments_before_loading_a_model(tmp_path, capsys, args, message) -> None:
    code, err = _study(capsys, "--data", "builtin:open_qa", "--out", tmp_path / "o", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_cli_study_names_a_missing_data_file(tmp_path, capsys) -> None:
    code, err = _study(capsys, "--data", tmp_path / "nope.jsonl", "--out", tmp_path / "o")
    assert code == 2 and "cannot read the study data" in err


@pytest.mark.slow
def test_quick_builtin_run_on_the_default_model(tmp_path, capsys) -> None:
    """`kvrag study --data builtin:all --limit 1` on the embedded model: every file, every family."""
    out = tmp_path / "run"
    code, err = _study(
        capsys,
        "--data",
        "builtin:all",
        "--limit",
        "1",
        "--strategies",
        "reuse,target_recompute",
        "--out",
        out,
        "--quiet",
    )
    assert code == 0, err
    for name in OUTPUTS:
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    families = {g["family"] for g in results["groups"]}
    assert families == {*BUILTIN, "all"}
    tr = results["strategies"]["target_recompute (retriever) @ 0.05"]
    assert tr["n"] == len(BUILTIN) and 0 < tr["recomputed_fraction"] < 0.5 and math.isfinite(tr["kl"])
