"""`kvrag bench-answers`: every strategy's whole answer through the engine on built-in items, timed and scored."""


import pytest

from kvrag.cli import main
from kvrag.lab.bench.answers import markdown, summary, whole_answers

pytestmark = pytest.mark.slow


def test_whole_answers_time_and_score_each_strategy_on_each_item(capsys):
    from kvrag import KVModel

    kv = KVModel.from_pretrained()
    result = whole_answers(kv, data="builtin:open_qa,compare", limit=1, max_new_tokens=4, log=lambda m: None)
    rows = result["rows"]
    assert [(r["family"], r["strategy"]) for r in rows] == [
        (f, s) for f in ("open_qa", "compare") for s in ("full_prefill_top1", "full_prefill_top3", "default")
    ]
    for r in rows:
        assert 0 < r["ttft_s"] <= r["answer_s"] and isinstance(r["correct"], bool)
    compared = next(r for r in rows if r["family"] == "compare" and r["strategy"] == "default")
    assert compared["parts"] >= 2 and compared["composed"] in ("code", "model")  # a comparison, asked in parts
    assert all(r["parts"] == 0 for r in rows if r["strategy"] != "default")
    whole = result["summary"]["all"]["default"]
    assert whole["items"] == 2 and whole["right"] == sum(r["correct"] for r in rows if r["strategy"] == "default")
    assert summary(rows, ["default"])["all"]["default"] == whole
    table = markdown(result)
    assert "| compare | " in table and "| all | " in table


def test_the_declining_header_is_the_prompts_and_the_run_says_so(tmp_path, monkeypatch, capsys):
    import json

    from kvrag import KVModel
    from kvrag.model.layout import CONTEXT_HEADER, DECLINING_HEADER

    headers = []
    loaded = KVModel.from_pretrained.__func__

    def loading(cls, *args, **kwargs):
        kv = loaded(cls, *args, **kwargs)
        headers.append(kv.layout.header)
        return kv

    monkeypatch.setattr(KVModel, "from_pretrained", classmethod(loading))
    out = tmp_path / "run.json"
    argv = ["bench-answers", "--data", "builtin:open_qa", "--limit", "1", "--strategies", "full_prefill_top1",
            "--max-new-tokens", "2", "--header", "declining", "--out", str(out)]
    assert main(argv) == 0
    run = json.loads(out.read_text())
    assert headers == [DECLINING_HEADER] and run["header"] == DECLINING_HEADER
    assert "--header declining" in run["command"]
    assert main(argv[:-4] + ["--out", str(out)]) == 0  # the model's shipped header: the 135M's is kvrag's own
    assert headers[-1] == json.loads(out.read_text())["header"] == CONTEXT_HEADER
    with pytest.raises(SystemExit) as refused:  # not a header it knows: argparse's usage error
        main(["bench-answers", "--header", "polite"])
    assert refused.value.code == 2 and "invalid choice: 'polite'" in capsys.readouterr().err


def test_the_command_refuses_an_unknown_strategy_before_loading(capsys):
    assert main(["bench-answers", "--strategies", "full_prefill_top1,bogus"]) == 2
    assert "unknown strategy 'bogus'" in capsys.readouterr().err


def test_a_strategy_decoded_over_quantized_weights_counts_the_answers_it_shares_with_the_model_s_own():
    from kvrag.lab.bench.answers import quantized

    assert quantized("default_int4") == ("default", "int4") and quantized("reuse") == ("reuse", "model")
    rows = [
        {"item": i, "family": "f", "strategy": s, "correct": True, "ttft_s": 0.1, "answer_s": 0.2, "new_tokens": 3,
         "text": text}
        for i, (own, int8) in enumerate([("a", "a"), ("b", "c"), ("d", "d")])
        for s, text in (("default", own), ("default_int8", int8))
    ]
    table = summary(rows, ["default", "default_int8"])
    assert table["all"]["default_int8"]["same"] == 2 and "same" not in table["all"]["default"]
    assert main(["bench-answers", "--strategies", "bogus_int4"]) == 2  # the strategy under the suffix is checked


def test_a_bench_name_may_fix_the_picker_and_split_the_question():
    from kvrag.lab.bench.answers import _strategy

    assert _strategy("default") == {} and _strategy("default+parts") == {"parts": "auto"}
    assert _strategy("target_only:gap+parts") == {"strategy": "target_only", "picker": "gap", "parts": "auto"}
    assert _strategy("best_few") == {"strategy": "best_few"}


def test_marks_after_the_at_say_how_the_chunks_kv_is_kept_and_a_storage_row_pairs_with_the_models_dtype():
    from kvrag.lab.bench.answers import keeping

    assert keeping("default") == (False, None) and keeping("default@doc") == (True, None)
    assert keeping("default_int4@doc+int4") == (True, "int4") and keeping("target_only:gap@int8") == (False, "int8")
    for bad in ("default@docs", "default@int4+int8", "default@int3"):
        with pytest.raises(ValueError, match="after '@'"):
            keeping(bad)
    rows = [
        {"item": i, "family": "f", "strategy": s, "correct": True, "ttft_s": 0.1, "answer_s": 0.2, "new_tokens": 3,
         "text": text}
        for i, (own, int4) in enumerate([("a", "a"), ("b", "c")])
        for s, text in (("default@doc", own), ("default@doc+int4", int4))
    ]
    assert summary(rows, ["default@doc", "default@doc+int4"])["all"]["default@doc+int4"]["same"] == 1


def test_a_storage_mark_answers_over_entries_written_in_that_dtype_and_read_back(capsys):
    from kvrag import KVModel

    kv = KVModel.from_pretrained()
    result = whole_answers(kv, data="builtin:open_qa", limit=1, max_new_tokens=4, log=lambda m: None,
                           strategies=["default@doc", "default@doc+float32", "default@doc+int4"])
    by = {r["strategy"]: r for r in result["rows"]}
    # float32 entries hold the model's bfloat16 KV exactly: the same answer; int4 entries are read back de-quantized
    assert by["default@doc+float32"]["text"] == by["default@doc"]["text"]
    assert result["summary"]["all"]["default@doc+float32"]["same"] == 1
    assert "same" in result["summary"]["all"]["default@doc+int4"]
    assert main(["bench-answers", "--strategies", "default@doc+int3"]) == 2
    assert "after '@'" in capsys.readouterr().err


def test_a_rows_same_is_counted_against_the_row_that_differs_from_it_in_one_thing_only():
    from kvrag.lab.bench.answers import same_as

    assert same_as("default_int4@doc+int4") == "default_int4@doc" and same_as("default@int8") == "default"
    assert same_as("default_int4@doc") == "default@doc" and same_as("best_few_int8") == "best_few"


def test_whole_decodes_each_answer_past_its_first_line_break_and_the_run_says_so(tmp_path, monkeypatch):
    import json

    from kvrag.engine.rag import KVRAG

    stops = []
    answer = KVRAG.answer

    def answering(self, *args, **kwargs):
        stops.append(kwargs.get("stop"))
        return answer(self, *args, **kwargs)

    monkeypatch.setattr(KVRAG, "answer", answering)
    out = tmp_path / "run.json"
    argv = ["bench-answers", "--data", "builtin:open_qa", "--limit", "1", "--strategies", "full_prefill_top1",
            "--max-new-tokens", "2", "--out", str(out)]
    assert main(argv) == 0 and set(map(tuple, stops)) == {("\n",)} and json.loads(out.read_text())["to_line_break"]
    stops.clear()
    assert main(argv + ["--whole"]) == 0 and set(map(tuple, stops)) == {()}
    run = json.loads(out.read_text())
    assert run["to_line_break"] is False and "to its end" in markdown(run)
