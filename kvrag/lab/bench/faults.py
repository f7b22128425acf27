"""What a hung KV store costs: queries whose chunk KV is in memory, alone and while another query waits on a
Redis server that stopped answering (SIGSTOP), on the embedded default model and the bundled Python docs.

    python -m kvrag.lab.bench.faults [--runs 5] [--timeout 5]

Prints the median time of an in-memory query before and during the hang, their ratio, and what the query
that reads the hung server costs (about one socket timeout: the circuit breaker skips the store after it).
It starts and stops its own redis-server (Debian's package) and never runs beside other measurements.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
import warnings
from typing import Any, Callable

from kvrag.cache.store import MemoryStore, RedisStore, StoreWarning, TieredStore
from kvrag.engine.documents import Document
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.lab.bench.storage import start_redis
from kvrag.lab.demo import sample_docs
from kvrag.kvmodel import KVModel


def hung_store_benchmark(
    kv: KVModel, *, runs: int = 5, timeout: float = 5.0, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Median seconds of an in-memory query alone and during a Redis hang; the hung query's seconds.
    Long by design: the timed rounds and their set-up read as one piece, as every benchmark here."""
    started = start_redis()
    if started is None:
        raise RuntimeError("redis-server is not installed or did not start (apt-get install redis-server)")
    proc, port = started
    try:
        rag = KVRAG(
            kv,
            embedder=Embedder(),
            store=TieredStore(MemoryStore(), RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout=timeout)),
        )
        chunks, items = sample_docs()
        rag.ingest(
            [Document(c["text"], {"source": c["source"]}, id=c["id"]) for c in chunks], split=False, progress=False
        )
        texts = [c["text"] for c in chunks]
        warm, cold = texts[:5], texts[5:10]
        question = items[0]["question"]
        options = dict(max_new_tokens=16, strategy="target_recompute")

        def warm_query() -> float:
            t0 = time.perf_counter()
            rag.answer(question, warm, **options)
            return time.perf_counter() - t0

        warm_query()
        alone = [warm_query() for _ in range(runs)]
        os.kill(proc.pid, signal.SIGSTOP)
        hung: dict[str, float] = {}

        def cold_query() -> None:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", StoreWarning)
                rag.answer(question, cold, **options)
            hung["seconds"] = time.perf_counter() - t0

        during = []
        for _ in range(runs):  # each run: a fresh cold query waiting on the hung server, the warm one beside it
            for text in cold:  # these must come from Redis (the last run's recompute put them in memory)
                rag.store.front.delete(rag.source.key(kv.chunk_ids(0, text)))
            rag.store.back._down_until = 0.0  # the breaker closed again: this cold query waits its timeout
            worker = threading.Thread(target=cold_query)
            worker.start()
            time.sleep(0.2)
            during.append(warm_query())
            waited = worker.is_alive()
            worker.join()
            if not waited:
                log("note: the cold query ended before the warm one; raise --timeout for a cleaner figure")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)
    result = {
        "alone_s": statistics.median(alone),
        "during_hang_s": statistics.median(during),
        "hung_query_s": hung["seconds"],
        "timeout_s": timeout,
    }
    result["ratio"] = result["during_hang_s"] / result["alone_s"]
    log(
        f"in-memory query: {result['alone_s']:.3f} s alone, {result['during_hang_s']:.3f} s while another waits on a "
        f"hung Redis ({result['ratio']:.2f}x); the query reading the hung server: {result['hung_query_s']:.2f} s "
        f"(socket timeout {timeout:g} s, 5 chunks to read)"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag.lab.bench.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=5.0, help="the Redis socket timeout in seconds")
    args = parser.parse_args()
    hung_store_benchmark(KVModel.from_pretrained(), runs=args.runs, timeout=args.timeout)


if __name__ == "__main__":
    main()
