"""`kvrag bench-dtype`: bfloat16 against float32 on the same weights, end to end, with its figures per strategy."""

import math

from tiny import save_tiny

from kvrag.cli import main
from kvrag.lab.bench.dtype import STRATEGIES, dtype_quality, markdown
from kvrag.model.kvmodel import KVModel


def test_bfloat16_against_float32_reports_kl_and_agreement_per_strategy(tmp_path):
    folder = str(save_tiny(tmp_path / "model"))
    reference = KVModel.from_pretrained(folder, dtype="float32")
    low = KVModel.from_pretrained(folder, dtype="bfloat16")
    assert low.prefix.keys.dtype.itemsize == 2  # it computes in bfloat16, KV included
    result = dtype_quality(reference, low, limit=2, max_new_tokens=4, small=True, log=lambda m: None)
    assert result["dtypes"] == {"reference": "float32", "low": "bfloat16"} and result["items"] >= 2
    for strategy in STRATEGIES:
        summary = result["summary"][strategy]
        kl = summary["first_token_kl"]
        assert summary["finite"] and 0 <= kl["median"] <= kl["max"] and kl["mean"] > 0  # bf16 is not float32
        assert 0 <= summary["same_answer"] <= 1
        lo, hi = summary["same_answer_ci"]
        assert lo <= summary["same_answer"] <= hi
        agree = summary["agreement_with_float32_full_prefill"]
        assert 0 <= agree["mcnemar_p"] <= 1 and agree["only_reference"] + agree["only_low"] <= result["items"]
    # float32 full prefill agrees with itself on every item
    assert result["summary"]["full_prefill"]["agreement_with_float32_full_prefill"]["reference"] == 1.0
    table = markdown(result)
    assert table.count("\n| ") == 1 + len(STRATEGIES) and "bfloat16 against float32" in table
    assert all(math.isfinite(r["strategies"]["reuse"]["first_token_kl"]) for r in result["rows"])


def test_the_same_dtype_twice_is_refused(capsys):
    code = main(["bench-dtype", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 2 and "float32 here: give bfloat16 or float16" in err and err.count("\n") == 1


def test_the_command_runs_end_to_end_and_writes_its_run(tmp_path, capsys):
    import json

    out = tmp_path / "dtype.json"
    assert main(["bench-dtype", "--items", "1", "--max-new-tokens", "2", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["items"] >= 1 and "--items 1" in run["command"] and "bfloat16 against float32" in capsys.readouterr().out
