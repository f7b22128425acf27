"""`kvrag bench-decode`: milliseconds a decoded token after a kvrag prefill, beside the transformers forward step
and the floor the machine's memory bandwidth sets.

A decode step must read every weight and every cached key and value once; nothing is faster than those bytes
over the bandwidth measured here (`kvrag.roofline`: a step's FLOPs are far below what the matmul rate allows). Each size is measured
side by side in one run: kvrag's step in C (`kvrag`, what decodes by default where the C kernels build), its
torch step eager (`kvrag_torch`) and compiled (`kvrag_compiled`, `compile_decoding`; the compile itself is timed
apart, in the warm-up), the transformers forward step over the same cache, and the floor.

Two more pairs time the C step with prompt-lookup drafts (`kvrag.generate.PromptLookup`, the default in an
answer) and without, over the same answers: `kvrag_lookup` beside `kvrag` on the bench's question, and
`kvrag_lookup_quote` beside `kvrag_quote` on an answer that copies a chunk (QUOTE), the kind of answer drafts
are for. Their tokens are the same; a token costs less than a step where drafts are confirmed, so these rows can
sit below the floor, which prices one step.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence


from kvrag import pipeline
from kvrag.bench import context_texts
from kvrag.demo import sample_docs
from kvrag.fastdecode import compile_decoding, decoder_of, decodes_compiled, decodes_native, native_decoding
from kvrag.generate import Sampling, decode
from kvrag.kv import ChunkKV
from kvrag.kvmodel import KVModel
from kvrag.roofline import Machine, forward_cost


QUOTE = "Copy the last paragraph above word for word."  # the question of the `_quote` rows


def _decode_time(
    kv: KVModel, question: str, encoded: list[ChunkKV], tokens: int, fast: bool, lookup: bool = False
) -> tuple[float, int, int]:
    """Seconds a token over `tokens` greedy tokens after a target_recompute prefill (one step each, or with
    prompt-lookup drafts); the cached tokens; the tokens decoded."""
    request = kv.request(question, encoded, strategy="target_recompute", max_new_tokens=tokens)
    chunks = kv.source.chunks(request.chunks)
    run = pipeline.prefill(kv, request, chunks, kv.executor, room=tokens, pooled=True)
    prefill = run.prefill
    sampling = Sampling(max_new_tokens=tokens, prompt_lookup=Sampling().prompt_lookup if lookup else 0)
    context = (prefill.prompt_ids or ()) if lookup else ()
    steps = decode(
        kv.model,
        prefill.cache,
        prefill.logits[-1],
        prefill.next_position,
        sampling,
        (),
        fast_decoding=fast,
        context=context,
    )
    next(steps)  # the first token comes from the prefill's logits: not a step
    t0 = time.perf_counter()
    count = sum(1 for _ in steps)
    seconds = time.perf_counter() - t0
    kv.executor.release(prefill)
    return seconds / max(count, 1), prefill.next_position, count


def decode_benchmark(
    kv: KVModel,
    *,
    contexts: Sequence[int] = (1000, 4000),
    tokens: int = 32,
    runs: int = 3,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Per context size: ms a token for kvrag's eager and compiled steps and the transformers forward (median of
    `runs`, interleaved), and the bandwidth floor; the ratios are to that floor. Where the fast step does not
    take the model, only the transformers forward is timed."""
    _, questions = sample_docs()
    question = questions[0]["question"]
    machine = Machine.calibrate(kv.prefix.keys.dtype, kv.prefix.keys.device)
    bandwidth = machine.read_bytes
    fast = decoder_of(kv.model) is not None
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; fast step: {'yes' if fast else 'no'}")
    compiled_before, native_before = decodes_compiled(kv.model), decodes_native(kv.model)
    paths: dict[str, Callable[[int], tuple[float, int, int]]] = {
        "transformers_step": lambda n: _decode_time(kv, question, texts, n, False)
    }
    if fast:
        if native_decoding(kv.model, True):
            paths["kvrag"] = lambda n: _on_step(kv, True, False, lambda: _decode_time(kv, question, texts, n, True))
            for name, asked in (("", question), ("_quote", QUOTE)):
                if name:
                    paths["kvrag" + name] = functools.partial(_native, kv, asked, lambda: texts, False)
                paths["kvrag_lookup" + name] = functools.partial(_native, kv, asked, lambda: texts, True)
        paths["kvrag_torch"] = lambda n: _on_step(kv, False, False, lambda: _decode_time(kv, question, texts, n, True))
        paths["kvrag_compiled"] = lambda n: _on_step(
            kv, False, True, lambda: _decode_time(kv, question, texts, n, True)
        )
    rows = []
    compile_s = None
    try:
        for size in contexts:
            texts = kv.encode(context_texts(kv, size, 200))  # encoded once: only the prefill and decoding repeat
            for name, path in paths.items():  # warm-up of every path (the compile happens in the first one)
                t0 = time.perf_counter()
                path(4)
                if name == "kvrag_compiled" and compile_s is None:
                    compile_s = time.perf_counter() - t0
            times: dict[str, list[float]] = {name: [] for name in paths}
            cached = 0
            for _ in range(runs):
                for name, path in paths.items():
                    t, cached, _steps = path(tokens)
                    times[name].append(t)
            machine = machine.best(Machine.calibrate(kv.prefix.keys.dtype, kv.prefix.keys.device))  # the best so far
            rows.append(_row(kv, machine, times, cached, tokens, compile_s, log))
    finally:
        compile_decoding(kv.model, compiled_before)
        native_decoding(kv.model, native_before)
    return rows


def _native(
    kv: KVModel, question: str, texts: Callable[[], list[ChunkKV]], lookup: bool, tokens: int
) -> tuple[float, int, int]:
    """The C step's seconds a token, with or without prompt-lookup drafts."""
    return _on_step(kv, True, False, lambda: _decode_time(kv, question, texts(), tokens, True, lookup))


def _on_step(
    kv: KVModel, native: bool, compiled: bool, run: Callable[[], tuple[float, int, int]]
) -> tuple[float, int, int]:
    """`run` with the model on the C step, or on the torch step eager or compiled."""
    native_decoding(kv.model, native)
    compile_decoding(kv.model, compiled)
    return run()


def _row(
    kv: KVModel,
    machine: Machine,
    times: dict[str, list[float]],
    cached: int,
    tokens: int,
    compile_s: float | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One size's row: the median ms a token of each path, and each as a ratio to the floor."""
    floor = forward_cost(kv, 1, cached + tokens // 2).floor(machine)  # a step in the middle of the answer
    ms = {name: 1000 * sorted(v)[len(v) // 2] for name, v in times.items()}
    row = {
        "context_tokens": cached,
        "ms_per_token": ms,
        "floor_ms": 1000 * floor,
        "over_floor": {name: m / (1000 * floor) for name, m in ms.items()},
        "bandwidth_gb_s": machine.read_bytes / 1e9,
        "compile_s": compile_s,
    }
    shown = ", ".join(f"{name} {m:.1f} ms/token ({m / (1000 * floor):.2f}x)" for name, m in ms.items())
    log(f"{cached:>6} cached tokens: floor {1000 * floor:.1f} ms ({machine.read_bytes / 1e9:.1f} GB/s); {shown}")
    return row
