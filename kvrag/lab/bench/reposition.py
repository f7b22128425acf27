"""What `reuse` spends outside the model's forward, and what its whole answer takes, with the reused KV stitched by
the C kernel in one call and by torch's passes, interleaved in one process (so a slow spell of the machine touches
both alike), on the embedded default model.

    python -m kvrag.lab.bench.reposition [--context 8000] [--runs 9] [--threads 2] [--tokens 32]

Prints, for each, the median time to first token of `reuse` through the engine over chunks of the bundled
Python docs held in a memory store, its phases, the share of everything but the forward, and the median time of
a `--tokens` answer. Run it alone. Where the forward runs in one C call (a bfloat16 model on a CPU with
AVX512-BF16), the C arm's stitch is written inside that call, a layer at a time, and its writing is timed as
forward: compare the arms' first tokens, not only their shares.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Any, Callable, Iterator

import torch

from kvrag.cache.store import MemoryStore
from kvrag.cpu import ckernel
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.lab.bench.ttft import Context, context_texts
from kvrag.lab.demo import sample_docs
from kvrag.kvmodel import KVModel

ARMS = ("one C stitch", "torch passes")


@contextlib.contextmanager
def _arm(name: str) -> Iterator[None]:
    """The engine as this arm runs it, put back afterwards."""
    plan, rotate = ckernel.stitch_plan, ckernel.rotate_keys
    try:
        if name == ARMS[1]:  # neither the one-call stitch nor the C rotation it falls back to
            ckernel.stitch_plan = lambda *args: None  # type: ignore[assignment]
            ckernel.rotate_keys = lambda *args: False  # type: ignore[assignment]
        yield
    finally:
        ckernel.stitch_plan, ckernel.rotate_keys = plan, rotate  # type: ignore[assignment]


def reposition_benchmark(
    kv: KVModel, *, context: int = 8000, runs: int = 9, tokens: int = 32, log: Callable[[str], None] = print
) -> dict[str, dict[str, float]]:
    """Per arm, the median ttft, forward, re-positioning, cache assembly and store load (s), the share outside
    the forward, and the median whole time of a `tokens`-token answer (s)."""
    rag = KVRAG(kv, embedder=Embedder(), store=MemoryStore(8 << 30))
    _, questions = sample_docs()
    ctx = Context(kv, rag, context_texts(kv, context, 200), questions[0]["question"])
    timed: dict[str, list[tuple[float, dict[str, float]]]] = {arm: [] for arm in ARMS}
    whole: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(runs + 1):  # the first round warms up and is dropped
        for arm in ARMS:
            with _arm(arm):
                timed[arm].append(ctx.strategy("reuse"))
                whole[arm].append(ctx.answer("reuse", tokens)[1])
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
            "answer_s": statistics.median(whole[arm][1:]),
        }
        row["outside_share"] = row["outside_forward_s"] / row["ttft_s"]
        result[arm] = row
        log(
            f"{arm:>13}: ttft {row['ttft_s'] * 1e3:.1f} ms, forward {row['forward_s'] * 1e3:.1f}, re-positioning "
            f"{row['re_positioning_s'] * 1e3:.1f}, assembly and mask {row['assembly_s'] * 1e3:.1f}, store load "
            f"{row['store_load_s'] * 1e3:.1f}; outside the forward {row['outside_forward_s'] * 1e3:.1f} ms "
            f"({row['outside_share']:.1%}); a {tokens}-token answer {row['answer_s'] * 1e3:.1f} ms"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag.lab.bench.reposition", description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8000, help="context tokens (default 8000)")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="the model's dtype (default float32)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of the timed whole answer (default 32)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not ckernel.available():
        parser.exit(2, "python -m kvrag.lab.bench.reposition: the C kernel did not build here (no C compiler?)\n")
    kv = KVModel.from_pretrained(dtype=args.dtype)
    reposition_benchmark(kv, context=args.context, runs=args.runs, tokens=args.tokens)


if __name__ == "__main__":
    main()
