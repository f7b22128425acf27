"""`kvrag bench --quick` on a tiny model folder: every output file is written, with the documented structure.

Structure only: speed figures live in docs/performance.md, never in assertions.
"""

import json
import re

import pytest
from tiny import save_tiny

from kvrag.cli import main
from kvrag.lab.bench.report import FILES
from kvrag.lab.bench.ttft import (
    DEFAULT,
    FULL_PREFILL,
    LOWER_BOUND,
    LOWER_BOUND_SUFFIX,
    PHASES,
    ROOFLINE,
    ROOFLINE_FULL,
    ROOFLINE_SUFFIX,
    TRANSFORMERS,
)


def test_quick_bench_writes_every_output(tmp_path, capsys):
    model = save_tiny(tmp_path / "model")
    out = tmp_path / "bench"
    strategies = ["full_prefill", "reuse", "target_recompute", "target_only:likelihood", DEFAULT]
    code = main(["bench", "--quick", "--model", str(model), "--out", str(out), "--strategies", ",".join(strategies)])
    printed = capsys.readouterr().out
    assert code == 0 and "### Time to first token" in printed
    assert all((out / name).stat().st_size > 0 for name in FILES)
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "bench.json").read_text())
    assert result["strategies"] == strategies and result["runs"] == 1
    assert result["answer_tokens"] == 4 and result["default"]["strategy"]
    assert [row["context_tokens"] >= size for row, size in zip(result["ttft"], (150, 300))] == [True, True]
    for row in result["ttft"]:
        assert set(row["ttft_s"]) == {*strategies, TRANSFORMERS, LOWER_BOUND, LOWER_BOUND_SUFFIX}
        assert all(t > 0 for t in row["ttft_s"].values())
        assert set(row["phases_s"]["reuse"]) == {*PHASES, "other"}
        assert row["phases_s"]["target_recompute"]["forward"] > 0
        assert row["peak_memory"]["rss_high_water_mb"] > 0
        floors = row["floor_s"]
        assert set(floors) == {ROOFLINE, ROOFLINE_SUFFIX, ROOFLINE_FULL} and all(f > 0 for f in floors.values())
        assert floors[ROOFLINE_SUFFIX] < floors[ROOFLINE] < floors[ROOFLINE_FULL]
        answered = {*strategies, DEFAULT}
        assert row["answer_tokens"] == 4 and set(row["answer_s"]) == answered
        for name in answered:
            assert row["answer_s"][name] >= row["answer_ttft_s"][name] > 0 and row["decode_ms"][name] > 0
            assert row["answer_speedup"][name] > 0 and len(row["answer_runs_s"][name]) == 1
        assert row["answer_speedup"][FULL_PREFILL] == 1
    assert set(result["ingest"]["x_raw"]) >= {"raw batched forward", "kvrag encode_chunks"}
    assert {"memory", "disk (float16)", "disk (int8)", "disk (int4)", "disk (k4v3)"} <= set(result["store_read"])
    per_token = result["bytes_per_token"]
    assert per_token["k4v3"] < per_token["int4"] < per_token["int8"] < per_token["float16"] < per_token["float32"]
    for dtype in ("int8", "int4", "k4v3"):
        assert result[dtype]["items"] >= 1 and result[dtype]["finite"]
        assert set(result[dtype]["first_token_kl"]) == {"reuse", "target_recompute"}
    markdown = (out / "bench.md").read_text()
    from kvrag.cpu import ckernel

    step = "C step" if ckernel.available() else "eager step"  # the tiny llama in float32: the C step takes it
    assert result["machine"]["decoding"] == step and f"decoding with the {step}" in markdown
    for section in (
        "Whole answer: 4 tokens",
        f"| {DEFAULT} ({result['default']['strategy']}) |",  # the tiny model's default: the recipe, no picker
        "Floors",
        "Ratios",
        "Where the time to first token goes",
        "Ingest",
        "Store reads",
        "KV bytes a token",
        "int4 against float16 storage",
        "k4v3 against float16 storage",
    ):
        assert section in markdown


def test_bench_rejects_a_context_shorter_than_a_chunk(tmp_path, capsys):
    code = main(["bench", "--out", str(tmp_path), "--contexts", "100", "--chunk-tokens", "200"])
    err = capsys.readouterr().err
    assert code == 2 and "every context at least one chunk long" in err and err.count("\n") == 1
    code = main(["bench", "--out", str(tmp_path), "--answer-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--answer-tokens >= 2" in err and err.count("\n") == 1
    code = main(["bench", "--out", str(tmp_path), "--strategies", "reuse,target_only:best"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown picker 'best'" in err and err.count("\n") == 1


def test_bench_decode_prints_every_step_and_the_floor(tmp_path, capsys):
    from kvrag.cpu import ckernel
    from kvrag.cpu.decode import decodes_compiled, decodes_native
    from kvrag.lab.bench.decode import decode_benchmark
    from kvrag.lab.roofline import forward_cost
    from kvrag.model.kvmodel import KVModel

    kv = KVModel.from_pretrained(str(save_tiny(tmp_path / "model")))
    rows = decode_benchmark(kv, contexts=(150,), tokens=6, runs=1, log=print)
    (row,) = rows
    steps = {"kvrag_torch", "kvrag_compiled", "transformers_step"}
    if ckernel.available():  # the C step, with prompt-lookup drafts, on the question and a quote, on small pages
        steps |= {"kvrag", "kvrag_lookup", "kvrag_quote", "kvrag_lookup_quote", "kvrag_small_pages", "memory_read"}
    if ckernel.available() and ckernel._library().int8_available():  # over int8 and int4 weights, each its own read
        steps |= {"kvrag_int8", "memory_read_int8"}
    assert row["context_tokens"] >= 150 and set(row["ms_per_token"]) == steps
    assert all(ms > 0 for ms in row["ms_per_token"].values()) and row["floor_ms"] > 0
    if ckernel.available():  # the read of a step's bytes, timed in the same rounds, and each path against it
        assert row["over_read"]["memory_read"] == 1.0 and row["over_read"]["kvrag"] > 0
        if "kvrag_int8" in steps:  # against the read of its own, fewer bytes
            assert row["over_read"]["memory_read_int8"] == 1.0 and row["over_read"]["kvrag_int8"] > 0
    assert forward_cost(kv, 1, 100).bytes > forward_cost(kv, 1, 0).bytes > 0  # the cached KV counts beside the weights
    assert forward_cost(kv, 10, 100).flops > forward_cost(kv, 10, 0).flops > forward_cost(kv, 1, 0).flops
    assert row["compile_s"] > 0 and not decodes_compiled(kv.model) and decodes_native(kv.model)  # as it found it
    out = capsys.readouterr().out
    assert "fast step: yes" in out
    if "kvrag_int8" in steps:  # the copies' making is timed where they were made
        assert re.search(r"int8 copies of the weights: made in \d+\.\d\d s", out)


def test_the_reposition_benchmark_times_every_arm_and_puts_the_engine_back(monkeypatch):
    from tiny import byte_tokenizer, tiny_model

    from kvrag import KVModel
    from kvrag.cpu import ckernel
    from kvrag.lab.bench.reposition import ARMS, reposition_benchmark

    calls = []
    plan = ckernel.stitch_plan
    monkeypatch.setattr(ckernel, "stitch_plan", lambda *args: calls.append(1) or plan(*args))
    kernels, lines = (ckernel.rotate_keys, ckernel.stitch_plan), []
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    result = reposition_benchmark(kv, context=300, runs=1, tokens=3, log=lines.append)
    assert (ckernel.rotate_keys, ckernel.stitch_plan) == kernels
    assert len(calls) == 4  # the C arm's two rounds of a first token and an answer; the torch arm's none
    assert list(result) == list(ARMS) and len(lines) == 3
    for row in result.values():
        assert row["ttft_s"] >= row["forward_s"] > 0 and row["re_positioning_s"] > 0
        assert row["outside_forward_s"] == pytest.approx(row["outside_share"] * row["ttft_s"])
        # an answer's time is measured in other rounds than the first token's: only its sign is certain on a
        # shared machine (one round each here; a loaded core made a 3-token answer quicker than a forward)
        assert row["answer_s"] > 0


def test_the_forward_benchmark_splits_the_forward_and_puts_the_functions_back():
    import torch
    from tiny import byte_tokenizer, tiny_model
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvrag import KVModel
    from kvrag.cpu.attention import GQA_SDPA
    from kvrag.lab.bench.forward import forward_benchmark

    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    attention, linear, lines = ALL_ATTENTION_FUNCTIONS[GQA_SDPA], torch.nn.Linear.forward, []
    result = forward_benchmark(kv, context=300, strategies=("target_recompute", "full_prefill"), runs=1, log=lines.append)
    assert ALL_ATTENTION_FUNCTIONS[GQA_SDPA] is attention and torch.nn.Linear.forward is linear and len(lines) == 3
    for row in result.values():
        assert row["forward_s"] >= row["attention_s"] + row["linear_s"] and row["rest_s"] >= 0
        assert row["attention_s"] > 0 and row["linear_s"] > 0 and row["attention_gflop_s"] > 0
    recompute, full = result["target_recompute"], result["full_prefill"]
    # full prefill computes every token's layers; target_recompute only the target's and the suffix's
    assert full["linear_flops"] > recompute["linear_flops"] > 0 and full["attention_flops"] > recompute["attention_flops"]


def test_the_forward_benchmark_runs_the_linear_layers_or_the_norms_both_ways_and_leaves_the_kernels_in_place():
    import copy

    import torch
    from tiny import byte_tokenizer, tiny_model

    from kvrag import KVModel
    from kvrag.cpu import cbf16
    from kvrag.cpu.linear import PrefillLinear, use_prefill_linears
    from kvrag.cpu.norm import is_prefill_norm, use_prefill_norms
    from kvrag.lab.bench.forward import forward_benchmark

    if not cbf16.prefill_linear_available():
        pytest.skip("no AVX512-BF16 CPU or no compiler")
    kv = KVModel(copy.deepcopy(tiny_model("llama")).to(torch.bfloat16), byte_tokenizer())
    use_prefill_linears(kv.model)  # what the engine installs where the kernels beat torch (not on an AMX CPU)
    use_prefill_norms(kv.model)
    swapped = [m for m in kv.model.modules() if type(m) is PrefillLinear]
    assert swapped
    lines: list[str] = []
    result = forward_benchmark(
        kv, context=300, strategies=("target_recompute",), runs=2, linears=("kernel", "torch"), log=lines.append
    )
    kernel, plain = result["target_recompute (kernel linears)"], result["target_recompute (torch linears)"]
    assert kernel["linear_flops"] == plain["linear_flops"] > 0 and kernel["linear_s"] > 0 and plain["linear_s"] > 0
    assert all(type(m) is PrefillLinear for m in swapped)
    assert sum("paired median" in line for line in lines) == 2
    with pytest.raises(ValueError, match="linears"):
        forward_benchmark(kv, context=300, linears=("fast",), log=lines.append)
    norms = [m for m in kv.model.modules() if is_prefill_norm(m)]
    assert norms
    lines.clear()
    result = forward_benchmark(
        kv, context=300, strategies=("reuse",), runs=1, norms=("kernel", "torch"), log=lines.append
    )
    assert set(result) == {"reuse (kernel norms)", "reuse (torch norms)"}
    assert all(is_prefill_norm(m) for m in norms) and sum("paired median" in line for line in lines) == 2
    with pytest.raises(ValueError, match="not both"):
        forward_benchmark(kv, context=300, linears=("kernel", "torch"), norms=("kernel", "torch"), log=lines.append)


def test_floors_use_the_best_calibration_of_the_run(tmp_path, monkeypatch, capsys):
    """A calibration that falls in a slow spell would set the floor too high and flatter every ratio to it."""
    from kvrag.lab.bench import decode as bench_decode
    from kvrag.lab.roofline import Machine
    from kvrag.model.kvmodel import KVModel

    slow, fast = Machine(1e11, 2e10), Machine(4e11, 5e10)
    assert slow.best(fast) == fast.best(slow) == fast and Machine(4e11, 2e10).best(Machine(1e11, 5e10)) == fast
    calibrations = iter([slow, fast])
    monkeypatch.setattr(Machine, "calibrate", classmethod(lambda cls, *a, **k: next(calibrations)))
    kv = KVModel.from_pretrained(str(save_tiny(tmp_path / "model")))
    (row,) = bench_decode.decode_benchmark(kv, contexts=(150,), tokens=4, runs=1, log=print)
    assert row["bandwidth_gb_s"] == 50.0  # the second, faster calibration, taken after the rounds
    assert "(50.0 GB/s)" in capsys.readouterr().out


def test_a_bench_of_one_section_names_the_sizes_that_do_not_fit_and_gives_each_size_its_own_peak(
    tmp_path, capsys, monkeypatch
):
    import os

    from kvrag.lab.bench import ttft

    model = save_tiny(tmp_path / "model")
    out = tmp_path / "bench"
    too_long = 1 << 20  # past every position the tiny model takes
    code = main(["bench", "--quick", "--model", str(model), "--out", str(out), "--strategies", "default",
                 "--sections", "ttft", "--contexts", f"150,{too_long},300"])
    printed = capsys.readouterr().out
    result = json.loads((out / "bench.json").read_text())
    assert code == 0 and result["sections"] == ["ttft"]
    assert [r["context_tokens"] >= size for r, size in zip(result["ttft"], (150, 300))] == [True, True]
    (skip,) = result["skipped"]
    assert skip["context_tokens"] == too_long and "the model takes" in skip["reason"]
    assert f"Not measured at {too_long:,} context tokens" in printed and "Peak memory" in printed
    assert "ingest" not in result and "bytes_per_token" not in result and "Ingest" not in printed
    assert "Where the time to first token goes" not in printed  # no strategy of its breakdown was timed
    if os.access("/proc/self/clear_refs", os.W_OK):  # Linux lets a process reset its own high-water mark
        assert [r["peak_scope"] for r in result["ttft"]] == ["size", "size"]
        assert max(r["peak_memory"]["rss_high_water_mb"] for r in result["ttft"]) <= (
            result["peak_memory"]["rss_high_water_mb"])

    monkeypatch.setattr(ttft, "_free_bytes", lambda device: 1 << 20)  # a machine with 1 MiB free
    none = tmp_path / "none"
    code = main(["bench", "--quick", "--model", str(model), "--out", str(none), "--sections", "ttft"])
    result = json.loads((none / "bench.json").read_text())
    assert code == 0 and result["ttft"] == [] and len(result["skipped"]) == 2
    assert all("GiB beside the model, 0.0 GiB are free" in s["reason"] for s in result["skipped"])
    assert not (none / "ttft.png").exists()  # a plot only of sizes timed
    capsys.readouterr()
    assert main(["bench", "--out", str(out), "--sections", "ttft,decode"]) == 2
    assert "unknown sections ['decode']" in capsys.readouterr().err
