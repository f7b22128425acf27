"""`kvrag bench-decode`: milliseconds a decoded token after a kvrag prefill, beside the transformers forward step
and the floor the machine's memory bandwidth sets.

A decode step must read every weight and every cached key and value once; nothing is faster than those bytes
over the bandwidth measured here (`kvrag.roofline`: a step's FLOPs are far below what the matmul rate allows). Each size is measured
side by side in one run: kvrag's step, the transformers forward step over the same cache, and the floor.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence


from kvrag import pipeline
from kvrag.bench import context_texts
from kvrag.demo import sample_docs
from kvrag.fastdecode import decoder_of
from kvrag.generate import Sampling, decode
from kvrag.kv import ChunkKV
from kvrag.kvmodel import KVModel
from kvrag.roofline import Machine, forward_cost


def _decode_time(kv: KVModel, question: str, encoded: list[ChunkKV], tokens: int, fast: bool) -> tuple[float, int, int]:
    """Seconds a token over `tokens` greedy steps after a target_recompute prefill; the cached tokens; the steps."""
    request = kv.request(question, encoded, strategy="target_recompute", max_new_tokens=tokens)
    chunks = kv.source.chunks(request.chunks)
    run = pipeline.prefill(kv, request, chunks, kv.executor, room=tokens, pooled=True)
    prefill = run.prefill
    sampling = Sampling(max_new_tokens=tokens)
    steps = decode(kv.model, prefill.cache, prefill.logits[-1], prefill.next_position, sampling, (), fast_decoding=fast)
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
    """Per context size: ms a token for kvrag's step and the transformers forward (median of `runs`, interleaved),
    and the bandwidth floor; the ratios are to that floor."""
    _, questions = sample_docs()
    question = questions[0]["question"]
    machine = Machine.calibrate(kv.prefix.keys.dtype, kv.prefix.keys.device)
    bandwidth = machine.read_bytes
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; fast step: {'yes' if decoder_of(kv.model) else 'no'}")
    rows = []
    for size in contexts:
        texts = kv.encode(context_texts(kv, size, 200))  # encoded once: only the prefill and decoding repeat
        _decode_time(kv, question, texts, 4, True)  # warm-up of both paths
        _decode_time(kv, question, texts, 4, False)
        times: dict[str, list[float]] = {"kvrag": [], "transformers_step": []}
        cached = 0
        for _ in range(runs):
            t, cached, _steps = _decode_time(kv, question, texts, tokens, True)
            times["kvrag"].append(t)
            times["transformers_step"].append(_decode_time(kv, question, texts, tokens, False)[0])
        floor = forward_cost(kv, 1, cached + tokens // 2).floor(machine)  # a step in the middle of the answer
        ms = {name: 1000 * sorted(v)[len(v) // 2] for name, v in times.items()}
        row = {
            "context_tokens": cached,
            "ms_per_token": ms,
            "floor_ms": 1000 * floor,
            "over_floor": {name: m / (1000 * floor) for name, m in ms.items()},
            "bandwidth_gb_s": bandwidth / 1e9,
        }
        rows.append(row)
        log(
            f"{cached:>6} cached tokens: kvrag {ms['kvrag']:.1f} ms/token, transformers step "
            f"{ms['transformers_step']:.1f} ms/token, floor {1000 * floor:.1f} ms "
            f"(kvrag {row['over_floor']['kvrag']:.2f}x the floor)"
        )
    return rows
