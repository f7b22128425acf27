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
