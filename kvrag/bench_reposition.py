"""What `reuse` spends outside the model's forward, with keys re-positioned by the C kernel and by torch's passes,
interleaved in one process (so a slow spell of the machine touches both alike), on the embedded default model.

    python -m kvrag.bench_reposition [--context 8000] [--runs 9] [--threads 2]

Prints, for each, the median time to first token of `reuse` through the engine over chunks of the bundled
Python docs held in a memory store, its phases, and the share of everything but the forward. Run it alone.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from kvrag import ckernel
from kvrag.bench import _Context, context_texts
from kvrag.demo import sample_docs
from kvrag.embed import Embedder
from kvrag.engine import KVRAG
from kvrag.kvmodel import KVModel
from kvrag.store import MemoryStore

ARMS = ("C rotation", "torch passes")


def reposition_benchmark(
    kv: KVModel, *, context: int = 8000, runs: int = 9, log: Callable[[str], None] = print
) -> dict[str, dict[str, float]]:
    """Per arm, the median ttft, forward, re-positioning, cache assembly and store load (s) and the share outside
    the forward."""
    rag = KVRAG(kv, embedder=Embedder(), store=MemoryStore(8 << 30))
    _, questions = sample_docs()
    ctx = _Context(kv, rag, context_texts(kv, context, 200), questions[0]["question"])
    kernel = ckernel.rotate_keys
    timed: dict[str, list[tuple[float, dict[str, float]]]] = {arm: [] for arm in ARMS}
    try:
        for _ in range(runs + 1):  # the first round warms up and is dropped
            for arm in ARMS:
                ckernel.rotate_keys = kernel if arm == ARMS[0] else (lambda *args: False)  # type: ignore[assignment]
                timed[arm].append(ctx.strategy("reuse"))
    finally:
        ckernel.rotate_keys = kernel  # type: ignore[assignment]
    log(f"reuse over {ctx.context_tokens} context tokens, {torch.get_num_threads()} threads, median of {runs} runs")
    result = {}
    for arm, rounds in timed.items():

        def median(of: Callable[[float, dict[str, float]], float], rounds: Any = rounds[1:]) -> float:
            return statistics.median(of(ttft, phases) for ttft, phases in rounds)

        row = {
            "ttft_s": median(lambda t, p: t),
            "forward_s": median(lambda t, p: p.get("forward", 0.0)),
            "re_positioning_s": median(lambda t, p: p.get("re-positioning", 0.0)),
            "assembly_s": median(lambda t, p: p.get("cache assembly and mask", 0.0)),
            "store_load_s": median(lambda t, p: p.get("store load", 0.0)),
            "outside_forward_s": median(lambda t, p: t - p.get("forward", 0.0)),
        }
        row["outside_share"] = row["outside_forward_s"] / row["ttft_s"]
        result[arm] = row
        log(
            f"{arm:>13}: ttft {row['ttft_s'] * 1e3:.1f} ms, forward {row['forward_s'] * 1e3:.1f}, re-positioning "
            f"{row['re_positioning_s'] * 1e3:.1f}, assembly and mask {row['assembly_s'] * 1e3:.1f}, store load "
            f"{row['store_load_s'] * 1e3:.1f}; outside the forward {row['outside_forward_s'] * 1e3:.1f} ms "
            f"({row['outside_share']:.1%})"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag.bench_reposition", description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8000, help="context tokens (default 8000)")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not ckernel.available():
        parser.exit(2, "python -m kvrag.bench_reposition: the C kernel did not build here (no C compiler?)\n")
    reposition_benchmark(KVModel.from_pretrained(), context=args.context, runs=args.runs)


if __name__ == "__main__":
    main()
