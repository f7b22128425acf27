"""Waits with a bound: a hung store costs only the queries that read it (and those at most about its timeout),
queries in flight are capped, ingest encodes without the folder's lock, Ctrl-C ends an ingest at once,
`gc` collects what a killed ingest left, and an async stream closed early stops its worker."""

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from redis_server import RedisServer
from tiny import FACTS, HashEmbedder, save_tiny

from kvrag.cache.store import DiskStore, MemoryStore, RedisStore, StoreWarning, TieredStore
from kvrag.cli import main
from kvrag.engine.aio import in_thread
from kvrag.engine.folder import LOCK_FILE
from kvrag.engine.rag import KVRAG
from kvrag.errors import BusyError

TESTS = Path(__file__).resolve().parents[1]  # tests/, where tiny.py is
pytestmark = pytest.mark.usefixtures("hash_embedder")
GEN = dict(max_new_tokens=3, strategy="reuse")


def test_a_hung_redis_costs_queries_served_from_memory_nothing(kv):
    server = RedisServer()
    timeout = 3.0
    try:
        redis_store = RedisStore(server.url, socket_timeout=timeout)
        rag = KVRAG(kv, embedder=HashEmbedder(), store=TieredStore(MemoryStore(), redis_store))
        rag.ingest(FACTS, progress=False)
        in_memory = ("Who runs Velloria's harbour?", [FACTS[1][0], FACTS[2][0]])
        cold = [FACTS[0][0], FACTS[3][0], FACTS[4][0]]
        expected = rag.answer(*in_memory, **GEN)
        baseline = min(_timed(lambda: rag.answer(*in_memory, **GEN)) for _ in range(3))
        for text in cold:  # these three must come from Redis
            rag.store.front.delete(rag.source.key(kv.chunk_ids(0, text)))
        os.kill(server.proc.pid, signal.SIGSTOP)
        slow: dict = {}

        def cold_query():
            t0 = time.perf_counter()
            with pytest.warns(StoreWarning):
                slow["answer"] = rag.answer("When was the lighthouse built?", cold, **GEN)
            slow["seconds"] = time.perf_counter() - t0

        worker = threading.Thread(target=cold_query)
        worker.start()
        time.sleep(0.3)  # the worker is now waiting on the hung server
        during = _timed(lambda: rag.answer(*in_memory, **GEN))
        assert worker.is_alive(), "the cold query should still be waiting on Redis"
        worker.join()
        # the query from memory never waited on Redis (before: it waited behind the model lock, 3 s and more)
        assert during < baseline + 1.0 < timeout, (during, baseline)
        # three chunks to read from the hung server cost one timeout, not three (the circuit breaker)
        assert timeout * 0.9 < slow["seconds"] < 2 * timeout, slow["seconds"]
        assert slow["answer"].stats.store_hits == 0 and slow["answer"].stats.chunks_encoded == 3
        assert rag.answer(*in_memory, **GEN).token_ids == expected.token_ids
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


class SlowWrites(MemoryStore):
    """A back store whose writes take `seconds` (a congested server): reads are instant."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def put(self, key, kv):
        time.sleep(self.seconds)
        super().put(key, kv)


def test_a_slow_store_write_holds_up_no_other_query(kv):
    rag = KVRAG(kv, embedder=HashEmbedder(), store=TieredStore(MemoryStore(), SlowWrites(0.0)))
    rag.ingest(FACTS[:2], progress=False)
    in_memory = ("Who runs Velloria's harbour?", [FACTS[0][0], FACTS[1][0]])
    baseline = min(_timed(lambda: rag.answer(*in_memory, **GEN)) for _ in range(3))
    rag.store.back.seconds = 2.0
    worker = threading.Thread(target=lambda: rag.answer("A new chunk?", ["A chunk never stored before."], **GEN))
    worker.start()
    time.sleep(0.3)  # the worker has encoded its chunk and is writing it
    during = _timed(lambda: rag.answer(*in_memory, **GEN))
    alive = worker.is_alive()
    worker.join()
    assert alive and during < baseline + 1.0, (during, baseline)  # before: it waited for the write, 2 s
    assert rag.source.key(kv.chunk_ids(0, "A chunk never stored before.")) in rag.store


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_queries_in_flight_are_bounded_with_a_clear_error(kv):
    rag = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore(), max_in_flight=2)
    rag.ingest(FACTS, progress=False)
    opts = dict(max_new_tokens=8, strategy="reuse", top_k=2)
    held = [rag.stream("Who runs the harbour?", **opts) for _ in range(2)]
    for stream in held:
        next(stream)  # admitted and decoding
    with pytest.raises(BusyError, match="2 queries are already in flight.*max_in_flight"):
        rag.query("Who runs the harbour?", **opts)
    held[0].close()  # a slot frees when a stream ends
    assert rag.query("Who runs the harbour?", **opts).text is not None
    held[1].close()
    with pytest.raises(Exception, match="max_in_flight must be an int of at least 1"):
        KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore(), max_in_flight=0)


def test_ingest_encodes_without_holding_the_folders_lock(kv, tmp_path):
    rag = KVRAG(
        kv, embedder=HashEmbedder(), store=TieredStore(MemoryStore(), DiskStore(tmp_path / "kv")), path=tmp_path
    )
    rag.ingest(FACTS[:1], progress=False)  # commits: the lock file exists
    shared_ok = []

    def on_progress(done, total):  # runs while chunks are being encoded
        with open(tmp_path / LOCK_FILE, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # a reader in another process
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                shared_ok.append(True)
            except BlockingIOError:
                shared_ok.append(False)

    rag.ingest([t for t, _ in FACTS[1:]], progress=False, on_progress=on_progress)
    assert shared_ok and all(shared_ok)  # before: the exclusive lock was held through the whole ingest
    assert len(rag.index) == len(FACTS) and len(rag.folder.load_index(rag.folder.manifest())) == len(FACTS)


def test_gc_removes_orphans_and_stale_temp_files_and_info_reports_them(kv, tmp_path, monkeypatch):
    model = save_tiny(tmp_path / "model")
    index = tmp_path / "index"
    assert main(["ingest", *_texts(tmp_path, FACTS), "--index", str(index), "--model", str(model), "--quiet"]) == 0
    rag = KVRAG.load(index)
    # what a SIGKILLed ingest leaves: entries no committed chunk refers to, and a writer's temporary file
    rag.store_kv(["An orphan chunk from a killed ingest.", "Another one."])
    bucket = next(p for p in (index / "kv").iterdir() if p.is_dir())
    tmp = bucket / ".deadbeefdeadbeef.x.tmp"
    tmp.write_bytes(b"partial")
    os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    info = KVRAG.load(index, read_only=True).info()  # read-only: sweeps nothing
    assert info["kv_orphans"] == 2 and info["kv_entries"] == len(FACTS) + 2 and info["kv_missing"] == 0
    assert tmp.exists()
    assert main(["gc", "--index", str(index), "--dry-run"]) == 0
    assert KVRAG.load(index, read_only=True).info()["kv_orphans"] == 2 and tmp.exists()  # a dry run removes nothing
    assert KVRAG.load(index, read_only=True).gc(dry_run=True) == {"orphan_entries": 2, "temp_files": 1}
    assert main(["gc", "--index", str(index)]) == 0
    after = KVRAG.load(index)
    assert after.info()["kv_orphans"] == 0 and after.info()["kv_entries"] == len(FACTS) and not tmp.exists()
    answer = after.query("Who runs Velloria's harbour?", top_k=2, **GEN)
    assert answer.stats.store_hits == 2 and answer.stats.chunks_encoded == 0  # nothing live was collected
    assert main(["gc", "--index", str(index), "--redis", "redis://127.0.0.1:1/0"]) == 2  # needs --exclusive


def _texts(tmp_path, facts):
    paths = []
    for i, (text, _) in enumerate(facts):
        path = tmp_path / f"fact{i}.txt"
        path.write_text(text)
        paths.append(str(path))
    return paths


RUN_CLI = """
import sys
sys.path.insert(0, {tests!r})
import kvrag.engine.rag, tiny
kvrag.engine.rag.Embedder = tiny.HashEmbedder
from kvrag.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_ends_an_ingest_within_a_second_keeping_what_committed(tmp_path):
    model = save_tiny(tmp_path / "model")
    index = tmp_path / "index"
    first = tmp_path / "first.txt"
    first.write_text(FACTS[0][0])
    assert main(["ingest", str(first), "--index", str(index), "--model", str(model), "--quiet"]) == 0
    big = tmp_path / "big.txt"
    big.write_text("\n".join(f"Line {i} of a long file about harbours and mills." for i in range(60_000)))
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI.format(tests=str(TESTS)), "ingest", str(big), "--index", str(index), "--yes"],
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a suite started in the background inherits SIGINT ignored, and so would the child
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not list((index / "kv").rglob("*.kv.safetensors"))[1:]:
            time.sleep(0.05)  # wait until it is encoding the big file
        assert proc.poll() is None, proc.stderr.read()
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        stopped = time.perf_counter() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130 and stopped < 1.0, (proc.returncode, stopped)
    assert "interrupted" in proc.stderr.read()
    again = KVRAG.load(index)
    assert len(again.index.docs()) == 1  # as last committed; the big file's encoded KV is kept for a rerun
    assert again.info()["kv_orphans"] >= 1


def test_an_async_stream_closed_early_stops_its_worker():
    produced, closed = [], threading.Event()

    def slow_items():
        try:
            for i in range(100):
                time.sleep(0.02)
                produced.append(i)
                yield i
        finally:
            closed.set()

    async def consume():
        stream = in_thread(slow_items)
        got = [await stream.__anext__() for _ in range(2)]
        await stream.aclose()
        return got

    assert asyncio.run(consume()) == [0, 1]
    assert closed.wait(2.0)  # before: the worker ran all 100 items to the end
    assert len(produced) < 10
