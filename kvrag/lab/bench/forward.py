"""Where a strategy's time to first token goes inside the model's forward: attention, the linear layers and the
rest (norms, rotary embedding, activations, residual sums, the cache's bookkeeping and the Python between
them), each part's FLOPs over its time beside the matmul rate calibrated in the same run (`kvrag.lab.roofline`).

    python -m kvrag.lab.bench.forward [--context 4000] [--strategies target_recompute,reuse] [--dtype bfloat16]
                                  [--runs 7] [--threads 2] [--linears kernel,torch | --norms kernel,torch]

Every call of the model's attention function and of every `nn.Linear` (`PrefillLinear` too) is timed (a clock
read before and after each, about 0.1 us) while the strategy answers through the engine over chunks of the
bundled Python docs held in a memory store; a run's parts are summed, and the median of the runs is printed.
The FLOPs are counted from each call's shapes as `kvrag.lab.roofline` counts them: 2 a weight a token for a linear
layer, and for attention QK and PV over every key a new token sees (the cache, and the new tokens before it).
`--linears kernel,torch` runs each strategy with kvrag's bfloat16 linear kernel and with torch's `nn.Linear`
in turn and prints the paired differences; `--norms kernel,torch` the same for the RMSNorm kernel. Run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from kvrag.cache.store import MemoryStore
from kvrag.cpu.attention import GQA_SDPA
from kvrag.cpu.linear import PrefillLinear
from kvrag.cpu.norm import is_prefill_norm
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.lab.bench.ttft import Context, context_texts
from kvrag.lab.demo import sample_docs
from kvrag.lab.roofline import Machine
from kvrag.kvmodel import KVModel

PARTS = ("attention", "linear")


class _Timed:
    """Seconds and FLOPs of the attention and linear calls made while it is installed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.flops: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def attention(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = function(module, query, key, *args, **kwargs)
            self.seconds["attention"] += time.perf_counter() - t0
            batch, heads, new, dim = query.shape
            cached = key.shape[2] - new
            self.flops["attention"] += 4 * batch * heads * dim * (new * cached + new * (new + 1) // 2)
            return out

        return timed

    def linear(self, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def timed(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = forward(module, x)
            self.seconds["linear"] += time.perf_counter() - t0
            self.flops["linear"] += 2 * module.in_features * module.out_features * (x.numel() // x.shape[-1])
            return out

        return timed


def forward_benchmark(
    kv: KVModel,
    *,
    context: int = 4000,
    strategies: tuple[str, ...] = ("target_recompute",),
    runs: int = 7,
    linears: tuple[str, ...] = ("kernel",),
    norms: tuple[str, ...] = ("kernel",),
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, float]]:
    """Per strategy, the median ttft, forward, attention, linear layers and rest of the forward (s), and the
    attention's and linear layers' GFLOP/s; the strategies run interleaved, the first round dropped.

    `linears`: "kernel" (the model as kvrag loads it: bfloat16 linear layers on CPU through `kvrag.cpu.linear`),
    "torch" (every `PrefillLinear` made a plain `nn.Linear` again), or both, each strategy then run both ways in
    turn, keyed "<strategy> (<way> linears)", with the paired difference of the two logged. `norms` the same for
    the RMSNorms of `kvrag.cpu.norm` (keyed "<strategy> (<way> norms)"); one of the two at most runs both ways.
    Long by design: every path is timed inside one interleaved loop (a slow spell of the machine
    touches all alike), which splitting would scatter."""
    for part, ways in (("linears", linears), ("norms", norms)):
        unknown = set(ways) - {"kernel", "torch"}
        if unknown or not ways:
            raise ValueError(f"{part}: 'kernel', 'torch' or both, not {sorted(unknown) or 'none'}")
    if len(linears) == 2 and len(norms) == 2:
        raise ValueError("compare the linear layers or the norms, not both at once")
    compared, ways = ("norms", norms) if len(norms) == 2 else ("linears", linears)
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kv.model.config._attn_implementation != GQA_SDPA:
        raise ValueError(f"the model attends through {kv.model.config._attn_implementation!r}, not {GQA_SDPA!r}")
    machine = Machine.calibrate(kv.prefix.keys.dtype, kv.prefix.keys.device)
    rag = KVRAG(kv, embedder=Embedder(), store=MemoryStore(8 << 30))
    _, questions = sample_docs()
    ctx = Context(kv, rag, context_texts(kv, context, 200), questions[0]["question"])
    timed = _Timed()
    attention = ALL_ATTENTION_FUNCTIONS[GQA_SDPA]
    forward, prefill_forward = torch.nn.Linear.forward, PrefillLinear.forward
    # the modules each way puts back as torch's own: (module, kvrag's class, torch's class)
    swapped = [(m, PrefillLinear, torch.nn.Linear) for m in kv.model.modules() if type(m) is PrefillLinear]
    if compared == "norms":
        swapped = [(m, type(m), type(m).__mro__[1]) for m in kv.model.modules() if is_prefill_norm(m)]
    runs_of = {
        (name, way): name if len(ways) == 1 else f"{name} ({way} {compared})" for name in strategies for way in ways
    }
    rounds: dict[str, list[dict[str, float]]] = {key: [] for key in runs_of.values()}
    AttentionInterface.register(GQA_SDPA, timed.attention(attention))
    torch.nn.Linear.forward = timed.linear(forward)  # type: ignore[method-assign]
    PrefillLinear.forward = timed.linear(prefill_forward)  # type: ignore[method-assign]
    try:
        for _ in range(runs + 1):  # the first round warms up and is dropped
            for (name, way), key in runs_of.items():
                for m, kernel_class, torch_class in swapped:
                    m.__class__ = kernel_class if way == "kernel" else torch_class
                timed.reset()
                ttft, phases = ctx.strategy(name)
                rounds[key].append(
                    {"ttft_s": ttft, "forward_s": phases.get("forward", 0.0)}
                    | {f"{part}_s": timed.seconds[part] for part in PARTS}
                    | {f"{part}_flops": timed.flops[part] for part in PARTS}
                )
    finally:
        for m, kernel_class, _ in swapped:
            m.__class__ = kernel_class
        AttentionInterface.register(GQA_SDPA, attention)
        torch.nn.Linear.forward = forward  # type: ignore[method-assign]
        PrefillLinear.forward = prefill_forward  # type: ignore[method-assign]
    log(
        f"{ctx.context_tokens} context tokens, {kv.prefix.keys.dtype}, {torch.get_num_threads()} threads, median of "
        f"{runs} runs; calibrated matmul {machine.matmul_flops / 1e9:.0f} GFLOP/s"
    )
    result = {}
    for name, measured in rounds.items():
        row = {key: statistics.median(r[key] for r in measured[1:]) for key in measured[0]}
        row["rest_s"] = statistics.median(r["forward_s"] - r["attention_s"] - r["linear_s"] for r in measured[1:])
        for part in PARTS:
            row[f"{part}_gflop_s"] = row[f"{part}_flops"] / row[f"{part}_s"] / 1e9 if row[f"{part}_s"] else 0.0
        result[name] = row
        log(
            f"{name:>17}: ttft {row['ttft_s'] * 1e3:.0f} ms, forward {row['forward_s'] * 1e3:.0f}: attention "
            f"{row['attention_s'] * 1e3:.0f} ({row['attention_gflop_s']:.0f} GFLOP/s), linear layers "
            f"{row['linear_s'] * 1e3:.0f} ({row['linear_gflop_s']:.0f} GFLOP/s), the rest {row['rest_s'] * 1e3:.0f}"
        )
    if len(ways) == 2:
        for name in strategies:
            kernel, plain = rounds[runs_of[name, "kernel"]][1:], rounds[runs_of[name, "torch"]][1:]
            for part in ("linear_s", "ttft_s") if compared == "linears" else ("forward_s", "ttft_s"):
                diffs = [k[part] - t[part] for k, t in zip(kernel, plain)]
                log(
                    f"{name:>17}: {part.removesuffix('_s').replace('linear', 'linear layers')}, kernel less torch, "
                    f"paired median {statistics.median(diffs) * 1e3:+.1f} ms (kernel faster in "
                    f"{sum(d < 0 for d in diffs)} of {len(diffs)} rounds)"
                )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag.lab.bench.forward", description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4000, help="context tokens (default 4000)")
    parser.add_argument("--strategies", default="target_recompute", help="comma-separated (default target_recompute)")
    parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (default)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--linears",
        default="kernel",
        help="kernel (default: as kvrag loads the model), torch (plain nn.Linear), or kernel,torch: both in turn",
    )
    parser.add_argument("--norms", default="kernel", help="the same for the RMSNorms (kvrag.cpu.norm)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kv = KVModel.from_pretrained(None, dtype=args.dtype)
    forward_benchmark(
        kv,
        context=args.context,
        strategies=tuple(args.strategies.split(",")),
        runs=args.runs,
        linears=tuple(args.linears.split(",")),
        norms=tuple(args.norms.split(",")),
    )


if __name__ == "__main__":
    main()
