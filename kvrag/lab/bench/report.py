"""Benchmark outputs: `run_bench` runs every section in one process and writes bench.json, bench.md and ttft.png.

The markdown holds the tables docs/performance.md quotes; the plot is time to first token against context
size, one line a strategy and a reference, and beside it the whole time of an answer of `answer_tokens`
tokens, one line a strategy and the default, log scale. bench.json holds, beside each row's figures
(`kvrag.lab.bench.ttft`), `answer_tokens` and `default`, the shipped default (strategy, picker, budget) that the
answers named DEFAULT ran. Nothing here is asserted in tests but the files' structure.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.cache.store import MemoryStore
from kvrag.cpu.decode import decoder_of, decodes_compiled
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.lab.bench.storage import QUANTIZED, bytes_per_token, quantized_error, read_bandwidth
from kvrag.lab.bench.ttft import (
    ANSWER_TOKENS,
    DEFAULT,
    DEFAULT_CONTEXTS,
    FULL_PREFILL,
    LOWER_BOUND,
    LOWER_BOUND_SUFFIX,
    PHASES,
    ROOFLINE,
    ROOFLINE_FULL,
    ROOFLINE_SUFFIX,
    TRANSFORMERS,
    context_texts,
    ingest_benchmark,
    ingest_ratio,
    peak_memory,
    ttft_benchmark,
)
from kvrag.kvmodel import KVModel
from kvrag.plan.defaults import shipped_default
from kvrag.plan.strategies import BUILTIN_STRATEGIES

FILES = ("bench.json", "bench.md", "ttft.png")
# What a run measures: time to first token and whole answers a context size (ttft), ingest throughput, storage
# (store reads, bytes a token, quantized entries' error); `--sections ttft` times the answers alone, in minutes.
SECTIONS = ("ttft", "ingest", "storage")
BREAKDOWN = ("reuse", "target_recompute")


def run_bench(
    kv: KVModel,
    out: str | Path,
    *,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    chunk_tokens: int = 200,
    strategies: Sequence[str] = BUILTIN_STRATEGIES,
    runs: int = 5,
    answer_tokens: int = ANSWER_TOKENS,
    quick: bool = False,
    sections: Sequence[str] = SECTIONS,
    command: str = "",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The benchmark's `sections` in one process; writes FILES into `out` (ttft.png where a size was timed) and
    returns what bench.json holds."""
    if not sections or set(sections) - set(SECTIONS):
        raise ValueError(f"sections must be some of {', '.join(SECTIONS)}, got {list(sections)}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    embedder = Embedder(device=str(kv.prefix.keys.device))
    rag = KVRAG(kv, embedder=embedder, store=MemoryStore(8 << 30))
    result: dict[str, Any] = {
        "command": command,
        "machine": _machine(kv),
        "budget": 0.05,
        "runs": runs,
        "chunk_tokens": chunk_tokens,
        "strategies": list(strategies),
        "answer_tokens": answer_tokens,
        "default": shipped_default(kv.fingerprint.weights),  # what the answers named DEFAULT ran
    }
    result["sections"] = [name for name in SECTIONS if name in sections]
    result["skipped"] = []  # context sizes that do not fit the model or the machine: {"context_tokens", "reason"}
    result["ttft"] = []
    if "ttft" in sections:
        log(f"time to first token, median of {runs} runs, {torch.get_num_threads()} threads, {kv.prefix.keys.device}")
        partial = folder / "bench.json"
        result["ttft"] = ttft_benchmark(
            kv,
            rag,
            contexts=contexts,
            chunk_tokens=chunk_tokens,
            strategies=strategies,
            runs=runs,
            answer_tokens=answer_tokens,
            log=log,
            on_row=lambda rows: partial.write_text(json.dumps({**result, "ttft": rows, "partial": True}, indent=1)),
            on_skip=result["skipped"].append,
        )
    if "ingest" in sections:
        log("ingest throughput")
        result["ingest"] = ingest_benchmark(
            kv,
            texts=context_texts(kv, min(contexts) if quick else 2000, chunk_tokens),
            runs=1 if quick else min(runs, 3),
            embedder=embedder,
            print_fn=log,
        )
    if "storage" in sections:
        log("storage")
        chunks = kv.encode(context_texts(kv, min(max(contexts), 4000), chunk_tokens))
        result["bytes_per_token"] = bytes_per_token(kv, chunks)
        result["store_read"] = read_bandwidth(kv, chunks, runs=1 if quick else 3, log=log)
        for dtype in QUANTIZED:
            log(f"{dtype} storage against float16 storage")
            result[dtype] = quantized_error(kv, dtype, limit=1 if quick else 4, small=quick)
    result["seconds"] = time.perf_counter() - started
    result["peak_memory"] = peak_memory(kv.prefix.keys.device)  # the whole run's high-water mark
    (folder / "bench.json").write_text(json.dumps(result, indent=1))
    (folder / "bench.md").write_text(markdown(result))
    if result["ttft"]:
        plot(result, folder / "ttft.png")
    return result


def _machine(kv: KVModel) -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(kv.prefix.keys.device),
        "torch": torch.__version__,
        "model": kv.fingerprint.architecture,
        "weights": kv.fingerprint.weights,
        "dtype": str(kv.prefix.keys.dtype).removeprefix("torch."),
        "decoding": _decoding(kv),
    }


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX512-BF16 (what kvrag's bfloat16 kernels need) and AMX-BF16 (where
    a bfloat16 prefill is left to torch), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    extras = [label for flag, label in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    return ", ".join([name or platform.machine(), *extras])


def _decoding(kv: KVModel) -> str:
    """How answers are decoded: kvrag's step in C, its compiled or eager torch step, or the transformers forward
    (what the decoder chooses for this model's cache dtype: the C step takes the weights' dtype)."""
    decoder = decoder_of(kv.model)
    if decoder is None:
        return "transformers forward"
    if decoder.native is not None and decoder.use_native and kv.prefix.keys.dtype == decoder.native.dtype:
        return "C step"
    if decoder.graphs is not None and decoder.use_native:
        return "CUDA graph step"
    return "compiled step" if decodes_compiled(kv.model) else "eager step"


def _references(row: dict[str, Any]) -> list[str]:
    return [n for n in (TRANSFORMERS, LOWER_BOUND, LOWER_BOUND_SUFFIX) if n in row["ttft_s"]]


def markdown(result: dict[str, Any]) -> str:
    """The tables of one run."""
    m = result["machine"]
    lines = [
        (
            f"{m['model']} ({m['dtype']}) on {m['device']}, {m['threads']} threads, decoding with the "
            f"{m.get('decoding', 'eager step')}; budget {result['budget']}, "
            f"chunks of ~{result['chunk_tokens']} tokens, the first chunk as the target; median of {result['runs']} runs."
        ),
        "",
    ]
    if result["ttft"]:
        lines += _ttft_tables(result)
        if "answer_s" in result["ttft"][0]:
            lines += _answer_table(result)
        lines += _phase_table(result)
    for skip in result.get("skipped", []):
        lines += ["", f"Not measured at {skip['context_tokens']:,} context tokens: {skip['reason']}."]
    if "ingest" in result:
        lines += _ingest_table(result)
    if "bytes_per_token" in result:
        lines += _storage_tables(result)
    lines += _peak_table(result)
    return "\n".join(lines) + "\n"


def _ttft_tables(result: dict[str, Any]) -> list[str]:
    """Time to first token of every strategy and reference, and the ratios to the floors and references."""
    rows = result["ttft"]
    lines = [
        "### Time to first token (s)",
        "",
        "| | " + " | ".join(f"{r['context_tokens']:,} tokens" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for name in [*result["strategies"], *_references(rows[0])]:
        lines.append(f"| {name} | " + " | ".join(f"{r['ttft_s'][name]:.3f}" for r in rows) + " |")
    if "floor_s" in rows[0]:
        lines += ["", "### Floors (s): FLOPs and bytes over this machine's calibrated rates (kvrag.lab.roofline)", ""]
        lines += [
            "| | " + " | ".join(f"{r['context_tokens']:,} tokens" for r in rows) + " |",
            "|---|" + "---|" * len(rows),
        ]
        for floor in rows[0]["floor_s"]:
            lines.append(f"| {floor} | " + " | ".join(f"{r['floor_s'][floor]:.3f}" for r in rows) + " |")
    lines += ["", "### Ratios", "", "| | " + " | ".join(f"{r['context_tokens']:,}" for r in rows) + " |"]
    lines.append("|---|" + "---|" * len(rows))
    for name in ("target_recompute", "reuse", "full_prefill"):
        if name not in result["strategies"]:
            continue
        floor = {"target_recompute": ROOFLINE, "reuse": ROOFLINE_SUFFIX}.get(name, ROOFLINE_FULL)
        if "floor_s" in rows[0]:
            lines.append(
                f"| {name} / {floor} | "
                + " | ".join(f"{r['ttft_s'][name] / r['floor_s'][floor]:.2f}" for r in rows)
                + " |"
            )
        if name == "full_prefill":
            continue
        bound = LOWER_BOUND if name == "target_recompute" else LOWER_BOUND_SUFFIX
        lines.append(
            f"| {name} / {bound} | " + " | ".join(f"{r['ttft_s'][name] / r['ttft_s'][bound]:.2f}" for r in rows) + " |"
        )
        for full in ("full_prefill", TRANSFORMERS):
            if full in rows[0]["ttft_s"]:
                lines.append(
                    f"| {full} / {name} | "
                    + " | ".join(f"{r['ttft_s'][full] / r['ttft_s'][name]:.1f}" for r in rows)
                    + " |"
                )
    return lines


def _answered(result: dict[str, Any]) -> list[str]:
    """The names that answered in full: the strategies, full prefill, then the default."""
    return list(result["ttft"][0]["answer_s"])


def _label(result: dict[str, Any], name: str) -> str:
    """A row's name; the default's with what it ran (STRATEGY or STRATEGY:PICKER, as --strategies names it)."""
    if name != DEFAULT:
        return name
    default = result["default"]
    picker = default.get("picker")
    return f"{DEFAULT} ({default['strategy']}{f':{picker}' if picker else ''})"


def _answer_table(result: dict[str, Any]) -> list[str]:
    """Time to first token, decode ms a token and the whole time of one fixed-length answer, side by side."""
    n = result["answer_tokens"]
    lines = [
        "",
        f"### Whole answer: {n} tokens",
        "",
        (
            f"Each answer decodes {n} tokens through the engine (greedy, EOS ignored): the first from the prefill, "
            f"then {n - 1} decode steps; median of {result['runs']} runs. Speed-ups are full prefill's time over "
            "the row's, at the same context."
        ),
        "",
        (
            "| answer | context | time to first token (s) | decode (ms/token) | whole answer (s) "
            f"| {FULL_PREFILL} / this, first token | {FULL_PREFILL} / this, whole answer |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name in _answered(result):
        for r in result["ttft"]:
            first = r["answer_ttft_s"]
            lines.append(
                f"| {_label(result, name)} | {r['context_tokens']:,} | {first[name]:.3f} | {r['decode_ms'][name]:.1f} "
                f"| {r['answer_s'][name]:.3f} | {first[FULL_PREFILL] / first[name]:.1f} "
                f"| {r['answer_speedup'][name]:.1f} |"
            )
    return lines


def _phase_table(result: dict[str, Any]) -> list[str]:
    """Where the time to first token goes, phase by phase (of the strategies in BREAKDOWN the run timed)."""
    if not any(name in result["strategies"] for name in BREAKDOWN):
        return []
    lines = ["", "### Where the time to first token goes (s, median of each phase)", ""]
    lines.append("| strategy | context | " + " | ".join(PHASES) + " | other | ttft | not forward |")
    lines.append("|---|---|" + "---|" * (len(PHASES) + 3))
    for name in BREAKDOWN:
        if name not in result["strategies"]:
            continue
        for r in result["ttft"]:
            p, ttft = r["phases_s"][name], r["ttft_s"][name]
            rest = max(0.0, ttft - p["forward"])
            lines.append(
                f"| {name} | {r['context_tokens']:,} | "
                + " | ".join(f"{p[k]:.3f}" for k in (*PHASES, "other"))
                + f" | {ttft:.3f} | {100 * rest / ttft:.0f}% |"
            )
    return lines


def _ingest_table(result: dict[str, Any]) -> list[str]:
    """Ingest throughput beside the raw batched forward."""
    ing = result["ingest"]
    lines = [
        "",
        f"### Ingest ({ing['chunks']} chunks, {ing['tokens']} tokens, median of {ing['runs']} interleaved rounds)",
        "",
        "x raw: the median over rounds of the raw batched forward's time in that round over the row's.",
        "",
        "| | seconds | tokens/s | x raw |",
        "|---|---|---|---|",
    ]
    for name, s in ing["seconds"].items():
        lines.append(f"| {name} | {s:.3f} | {ing['tokens_per_s'][name]:.0f} | {ing['x_raw'][name]:.2f} |")
    return lines + ["", ingest_ratio(ing["x_raw"]) + "."]


def _storage_tables(result: dict[str, Any]) -> list[str]:
    """Store reads, bytes a token, quantized entries' error."""
    lines = ["", "### Store reads (every chunk of a context, `store.get`)", "", "| store | seconds | MB | MB/s |"]
    lines.append("|---|---|---|---|")
    for name, s in result["store_read"].items():
        lines.append(f"| {name} | {s['seconds']:.4f} | {s['stored_mb']:.1f} | {s['mb_per_s']:.0f} |")
    lines += ["", "### KV bytes a token", "", "| storage | bytes/token |", "|---|---|"]
    for name, b in result["bytes_per_token"].items():
        lines.append(f"| {name} | {b:,.0f} |")
    for dtype in QUANTIZED:
        if dtype not in result:  # a bench.json from before int4 or k4v3 entries
            continue
        q = result[dtype]
        lines += [
            "",
            f"### {dtype} against float16 storage: first-token KL over {q['items']} items ({q['source']})",
            "",
            "| strategy | mean | median | max |",
            "|---|---|---|---|",
        ]
        for name, k in q["first_token_kl"].items():
            lines.append(f"| {name} | {k['mean']:.5f} | {k['median']:.5f} | {k['max']:.5f} |")
    return lines


def _peak_table(result: dict[str, Any]) -> list[str]:
    """Peak memory of each context size timed (its own where the system lets the mark be reset) and of the run."""
    rows = result["ttft"]
    keys = list(rows[0]["peak_memory"] if rows else result.get("peak_memory", {}))
    lines = ["", "### Peak memory (MiB: each size's high-water mark, then the whole run's)", ""]
    lines.append("| context | " + " | ".join(keys) + " |")
    lines.append("|---|" + "---|" * len(keys))
    for r in rows:
        scope = "" if r.get("peak_scope", "size") == "size" else " (the run's so far)"
        lines.append(
            f"| {r['context_tokens']:,}{scope} | " + " | ".join(f"{r['peak_memory'][k]:.0f}" for k in keys) + " |"
        )
    if "peak_memory" in result:  # a bench.json from before it was kept
        lines.append("| whole run | " + " | ".join(f"{result['peak_memory'].get(k, 0):.0f}" for k in keys) + " |")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Time to first token against context size, one line a strategy or reference, log scale; beside it, where
    measured, the whole time of a fixed-length answer, one line a strategy and the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["ttft"]
    x = [r["context_tokens"] for r in rows]
    whole = "answer_s" in rows[0]
    fig, axes = plt.subplots(1, 2 if whole else 1, figsize=(15, 5.5) if whole else (8, 5.5), squeeze=False)
    ax = axes[0][0]
    for name in [*result["strategies"], *_references(rows[0])]:
        style = "--" if name in (TRANSFORMERS, LOWER_BOUND, LOWER_BOUND_SUFFIX) else "-"
        ax.plot(x, [r["ttft_s"][name] for r in rows], style, marker="o", label=name)
    ax.set_ylabel("time to first token (s)")
    if whole:
        ax = axes[0][1]
        for name in _answered(result):
            style = ":" if name == DEFAULT else "-"
            ax.plot(x, [r["answer_s"][name] for r in rows], style, marker="o", label=_label(result, name))
        ax.set_ylabel(f"whole answer of {result['answer_tokens']} tokens (s)")
    for ax in axes[0]:
        ax.set_xlabel("context tokens")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    m = result["machine"]
    fig.suptitle(f"{m['model']} {m['dtype']}, {m['device']}, {m['threads']} threads, budget {result['budget']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
