"""Benchmarks that print figures measured side by side in one process (never asserted in tests).

`ingest_benchmark`: kvrag's chunk encoding and whole ingestion against the model's raw batched forward
over the same chunks in the same batches (prefix cache, padding, no KV kept).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from kvrag.demo import sample_docs
from kvrag.embed import Embedder
from kvrag.encode import _batches, encode_chunks, prefix_cache
from kvrag.engine import KVRAG
from kvrag.kvmodel import KVModel
from kvrag.store import DiskStore, MemoryStore, TieredStore


def _median_time(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def raw_forward(kv: KVModel, chunk_ids: list[list[int]]) -> None:
    """The least work encoding can be: the same batched forwards behind the prefix, nothing extracted or kept."""
    device = kv.prefix.keys.device
    start = len(kv.prefix)
    for group in _batches([len(c) for c in chunk_ids], kv.batch_tokens):
        width = max(len(chunk_ids[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long, device=device)
        for row, i in enumerate(group):
            ids[row, : len(chunk_ids[i])] = torch.as_tensor(chunk_ids[i])
        positions = torch.arange(start, start + width, device=device).expand(len(group), -1)
        kv.model(
            input_ids=ids,
            position_ids=positions,
            cache=prefix_cache(kv.prefix, len(group)),
            use_cache=True,
            logits_to_keep=1,
        )


def ingest_benchmark(kv: KVModel, *, copies: int = 3, runs: int = 3, print_fn: Callable[[str], None] = print) -> dict:
    """Chunks/s and tokens/s of raw forward, kvrag encoding, and ingestion into memory and disk stores."""
    chunks, _ = sample_docs()
    texts = [f"{c['text']}\n(copy {n})" for n in range(copies) for c in chunks]
    ids = [kv.chunk_ids(i, t) for i, t in enumerate(texts)]
    tokens = sum(map(len, ids))
    embedder = Embedder()
    results = {
        "raw batched forward": _median_time(lambda: raw_forward(kv, ids), runs),
        "kvrag encode_chunks": _median_time(
            lambda: encode_chunks(kv.model, kv.prefix, ids, batch_tokens=kv.batch_tokens, encoder=kv.encoder_id), runs
        ),
    }

    def ingest(store_factory: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            rag = KVRAG(kv, embedder=embedder, store=store_factory())
            rag.ingest(texts, split=False, progress=False)

        return run

    results["ingest, memory store"] = _median_time(ingest(MemoryStore), runs)
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(10**6))
        results["ingest, memory + disk (fp16)"] = _median_time(
            ingest(lambda: TieredStore(MemoryStore(), DiskStore(f"{tmp}/{next(counter)}"))), runs
        )
    raw = results["raw batched forward"]
    print_fn(
        f"{len(texts)} chunks, {tokens} tokens, batch_tokens {kv.batch_tokens}, {torch.get_num_threads()} threads, "
        f"median of {runs} runs after a warm-up"
    )
    print_fn(f"{'':<30}{'seconds':>9}{'chunks/s':>10}{'tokens/s':>10}{'x raw':>8}")
    for name, seconds in results.items():
        print_fn(
            f"{name:<30}{seconds:>9.3f}{len(texts) / seconds:>10.1f}{tokens / seconds:>10.0f}{raw / seconds:>8.2f}"
        )
    return {"chunks": len(texts), "tokens": tokens, "seconds": results}
