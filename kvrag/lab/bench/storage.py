"""Storage figures for the benchmark: store reads, KV bytes a token per storage dtype, quantized entries' error.

Reads time `store.get` as the engine calls it (bytes fetched, checksum, decode to the model's dtype); Redis
is a real redis-server started on a free loopback port when the binary is installed, skipped otherwise.
The int8, int4 and k4v3 checks compare first-token distributions over KV stored so with those over float16-stored KV
on the built-in study items. Never asserted in tests.
"""

from __future__ import annotations

import math
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvrag.cache.codec import STORAGE_DTYPES, decode_entry, encode_entry
from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import DiskStore, KVStore, MemoryStore, RedisStore
from kvrag.kvmodel import KVModel

DISK_DTYPES = ("float16", "int8", "int4", "k4v3")  # the storage dtypes whose reads are timed on disk
QUANTIZED = ("int8", "int4", "k4v3")  # the storage dtypes whose first-token KL the bench reports


def start_redis(port: int | None = None, password: str | None = None) -> tuple[subprocess.Popen, int] | None:
    """Start a throwaway redis-server on a loopback port (a free one by default) and wait until it answers.

    Returns the process and its port, or None when no binary is installed or it did not come up.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port, password=password)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.terminate()
    proc.wait(timeout=10)
    return None


@contextmanager
def redis_server() -> Iterator[str | None]:
    """A throwaway redis-server on a free loopback port (its URL), or None when none could be started."""
    started = start_redis()
    if started is None:
        yield None
        return
    proc, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def bytes_per_token(kv: KVModel, chunks: Sequence[ChunkKV]) -> dict[str, float]:
    """Stored bytes a context token for each storage dtype (tensors, scales, header), and in memory (model dtype)."""
    tokens = sum(map(len, chunks))
    out = {"memory (" + str(kv.prefix.keys.dtype).removeprefix("torch.") + ")": sum(c.nbytes for c in chunks) / tokens}
    for dtype in STORAGE_DTYPES:
        out[dtype] = sum(len(encode_entry(c, key=kv.chunk_key(c), dtype=dtype)) for c in chunks) / tokens
    return out


def read_bandwidth(
    kv: KVModel, chunks: Sequence[ChunkKV], *, runs: int = 3, log: Callable[[str], None] = print
) -> dict[str, dict[str, float]]:
    """Seconds to read every chunk back with `store.get` (median of `runs`), as MB/s of stored bytes and tokens/s."""
    keys = [kv.chunk_key(c) for c in chunks]
    tokens = sum(map(len, chunks))
    out: dict[str, dict[str, float]] = {}

    def measure(name: str, store: KVStore, stored_bytes: int) -> None:
        store.bind(encoder=kv.encoder_id, dtype=kv.prefix.keys.dtype, device=kv.prefix.keys.device)
        for key, chunk in zip(keys, chunks):
            store.put(key, chunk)
        times = []
        for _ in range(runs + 1):  # the first read warms caches (page cache, allocator)
            t0 = time.perf_counter()
            got = [store.get(k) for k in keys]
            times.append(time.perf_counter() - t0)
            if any(g is None for g in got):
                raise RuntimeError(f"the {name} store lost an entry during the benchmark")
        seconds = statistics.median(times[1:])
        out[name] = {
            "seconds": seconds,
            "stored_mb": stored_bytes / 1e6,
            "mb_per_s": stored_bytes / 1e6 / seconds,
            "tokens_per_s": tokens / seconds,
        }

    size = {d: sum(len(encode_entry(c, key=k, dtype=d)) for c, k in zip(chunks, keys)) for d in DISK_DTYPES}
    measure("memory", MemoryStore(), sum(c.nbytes for c in chunks))
    with tempfile.TemporaryDirectory() as tmp:
        measure("disk (float16)", DiskStore(f"{tmp}/f16", "float16"), size["float16"])
        for dtype in DISK_DTYPES[1:]:  # de-quantizing is part of a read
            measure(f"disk ({dtype})", DiskStore(f"{tmp}/{dtype}", dtype), size[dtype])
    with redis_server() as url:
        if url is None:
            log("no redis-server binary found: Redis read bandwidth skipped")
        else:
            measure("redis (float16)", RedisStore(url, namespace="bench"), size["float16"])
    return out


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the softmax distributions, in nats."""
    p = torch.log_softmax(p_logits.double(), dim=-1)
    q = torch.log_softmax(q_logits.double(), dim=-1)
    return float((p.exp() * (p - q)).sum())


def _roundtrip(kv: KVModel, chunk: ChunkKV, dtype: str) -> ChunkKV:
    key = kv.chunk_key(chunk)
    out = decode_entry(
        encode_entry(chunk, key=key, dtype=dtype),
        key=key,
        encoder=chunk.encoder,
        dtype=kv.prefix.keys.dtype,
        device=kv.prefix.keys.device,
    )
    assert out is not None
    return out


def builtin_items(
    limit: int, *, max_chars: int | None = None, small: bool = False
) -> tuple[str, list[tuple[str, list[str], int]]]:
    """(source, [(question, chunk texts, target index)]): the study's built-in items, else synthetic ones.

    `small` keeps two chunks an item and `max_chars` cuts each chunk: for a quick check on a tiny model.
    """
    try:
        from kvrag.lab.study import load_items
        from kvrag.lab.study.data import SINGLE

        items, _ = load_items("builtin:" + ",".join(SINGLE), limit=limit, **({"chunks": (2, 2)} if small else {}))
        source = "kvrag.lab.study built-in items (api_docs, open_qa, dialogue)"
        out = [(i.question, [c.text for c in i.chunks], i.target_index) for i in items]
    except ImportError:
        from kvrag.lab.synthetic import dialogue, encyclopedia

        source = "kvrag.lab.synthetic encyclopedia and dialogue"
        out = []
        for make in (encyclopedia, dialogue):
            docs, questions = make(seed=0)
            texts = {d.id: d.text for d in docs}
            for n, q in enumerate(questions[:limit]):
                others = [t for i, t in texts.items() if i != q.target][n : n + 4]
                out.append(
                    (q.question, [*others[:2], texts[q.target], *others[2:]][: 2 if small else None], 1 if small else 2)
                )
    if max_chars is not None:
        out = [(q, [t[:max_chars] for t in texts], target) for q, texts, target in out]
    return source, out


def quantized_error(
    kv: KVModel,
    dtype: str = "int8",
    *,
    limit: int = 4,
    strategies: Sequence[str] = ("reuse", "target_recompute"),
    small: bool = False,
) -> dict[str, Any]:
    """First-token KL of answers over chunk KV stored in `dtype` (one of QUANTIZED) against the same over
    float16-stored KV."""
    source, items = builtin_items(limit, max_chars=100 if small else None, small=small)
    kls: dict[str, list[float]] = {s: [] for s in strategies}
    for question, texts, target in items:
        chunks = kv.encode(texts)
        stored = {d: [_roundtrip(kv, c, d) for c in chunks] for d in ("float16", dtype)}
        for strategy in strategies:
            logits = {
                d: kv.prefill(question, stored[d], strategy=strategy, target=target).prefill.logits[-1] for d in stored
            }
            kls[strategy].append(kl_divergence(logits["float16"], logits[dtype]))
    return {
        "items": len(items),
        "source": source,
        "first_token_kl": {
            s: {"mean": statistics.fmean(v), "max": max(v), "median": statistics.median(v)} for s, v in kls.items()
        },
        "finite": all(math.isfinite(x) for v in kls.values() for x in v),
    }
