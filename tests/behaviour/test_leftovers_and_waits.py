"""Every wait bounded, every read capped, every leftover removable: a held lock is waited for a bound and its holder
named, a secret file that is a FIFO is refused at once, an index file of absurd size is damaged (never allocated), a
first ingest interrupted before its first commit is recognised by `info` and removed by `gc`, a failed first ingest
leaves no folder, and the command line escapes control characters and answers Ctrl-C at start-up in one line."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny import FACTS, HashEmbedder, save_tiny

from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
from kvrag.cache.store.redis_store import _advice
from kvrag.cli import main
from kvrag.engine import folder as folder_module
from kvrag.engine.folder import LOCK_FILE, MANIFEST, IndexFolder
from kvrag.engine.rag import KVRAG
from kvrag.errors import IndexLoadError, InvalidRequestError, LockTimeoutError, printable

pytestmark = pytest.mark.usefixtures("hash_embedder")

# Holds an index folder's lock from another process until its stdin closes: "ex" exclusive, "sh" shared.
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX if sys.argv[2] == "ex" else fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()
"""


def hold(path: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def in_thread(fn, seconds=20.0):
    """fn() on a thread that must end within `seconds` (a hang fails the test instead of the run)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # handed back
            out["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def index(model_dir, tmp_path):
    """An index folder of two facts, committed (so its lock file exists)."""
    path = tmp_path / "idx"
    KVRAG.from_defaults(path, model=str(model_dir)).ingest(FACTS[:2], progress=False)
    return path


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- every wait bounded ----------------------------------------------------------------------------------------


def test_a_reader_waits_a_bound_for_a_stuck_writer_then_names_it(index, capsys):
    writer = hold(index / LOCK_FILE, "ex")
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeoutError, match=rf"locked by pid {writer.pid} \(writing\): waited 0.5 s to read"):
            in_thread(lambda: KVRAG.load(index, lock_timeout_s=0.5))  # before: waited forever, silently
        assert time.monotonic() - t0 < 5
        code, _, err = cli(capsys, "info", "--index", index, "--lock-timeout", "0.3")
        assert code == 2 and f"pid {writer.pid}" in err and "--lock-timeout" in err and err.count("\n") == 1
    finally:
        writer.kill()
    assert len(KVRAG.load(index, lock_timeout_s=0.5).index) == 2  # let go: opened at once


def test_a_writer_waits_a_bound_for_a_reader_then_names_it(index):
    rag = KVRAG.load(index, lock_timeout_s=0.3)
    reader = hold(index / LOCK_FILE, "sh")
    try:
        with pytest.raises(LockTimeoutError, match=rf"pid {reader.pid} \(reading\): waited 0.3 s to write"):
            in_thread(lambda: rag.ingest(FACTS[2:3], progress=False))  # before: waited forever
    finally:
        reader.kill()
    assert len(rag.index) == 2  # nothing half-added
    rag.ingest(FACTS[2:3], progress=False)
    assert len(KVRAG.load(index).index) == 3


HOLD_AS_KVRAG = """
import sys
from kvrag.engine.folder import IndexFolder
with IndexFolder(sys.argv[1]).lock():
    print("held", flush=True)
    sys.stdin.read()
"""


def test_an_exclusive_holder_writes_its_pid_into_the_lock_file_and_clears_it(index, monkeypatch):
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD_AS_KVRAG, str(index)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "held"
        assert (index / LOCK_FILE).read_text().strip() == str(writer.pid)
        # where the kernel's lock table says nothing, the pid in the file names the holder
        monkeypatch.setattr(folder_module, "_holders", lambda fd: [])
        with pytest.raises(LockTimeoutError, match=rf"locked by pid {writer.pid} \(writing\)"):
            with IndexFolder(index, lock_timeout_s=0.1).lock(shared=True):
                pass
        writer.stdin.close()
        writer.wait(10)
    finally:
        writer.kill()
    assert (index / LOCK_FILE).read_text() == ""  # let go: nobody is named


def test_a_lock_timeout_must_be_a_finite_number_of_seconds(tmp_path):
    for bad in (-1, float("nan"), float("inf"), "5", True):
        with pytest.raises(InvalidRequestError, match="lock_timeout_s must be a finite number"):
            IndexFolder(tmp_path, lock_timeout_s=bad)


def test_a_secret_file_that_is_a_fifo_is_refused_at_once(index, tmp_path, capsys):
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    code, _, err = in_thread(lambda: cli(capsys, "info", "--index", index, "--secret-file", fifo))  # before: hung
    assert code == 2 and "cannot read the secret file" in err and "not a regular file" in err


# -- every read capped ------------------------------------------------------------------------------------------


def test_an_index_file_of_absurd_size_is_damaged_never_allocated(index):
    manifest = json.loads((index / MANIFEST).read_text())
    assert set(manifest["sizes"]) == {"vectors", "chunks"}
    chunks = next((index / "index").glob("chunks-*.jsonl"))
    with open(chunks, "r+b") as f:
        f.truncate(1 << 40)  # a sparse terabyte: before, read whole (MemoryError)
    with pytest.raises(IndexLoadError, match="is damaged"):
        KVRAG.load(index)


def test_a_disk_entry_whose_header_does_not_match_its_size_is_damaged_unread(kv, tmp_path):
    store = DiskStore(tmp_path / "kv")
    rag = KVRAG(kv, embedder=HashEmbedder(), store=TieredStore(MemoryStore(), store))
    rag.store_kv([FACTS[0][0]])
    path = next((tmp_path / "kv").rglob("*.kv.safetensors"))
    key = path.name.split(".")[0]
    good = path.read_bytes()
    assert store._read(key) == good
    path.write_bytes(good + b"\0" * 100)  # more than its header says
    assert store._read(key) == b""
    path.write_bytes(b"\xff" * 8 + good[8:])  # a header length no entry has
    assert store._read(key) == b""
    path.write_bytes(good)
    store.max_entry_bytes = len(good) - 1  # a configured maximum below the entry
    assert store._read(key) == b""


# -- every leftover removable -----------------------------------------------------------------------------------


def test_a_first_ingest_interrupted_before_its_commit_is_named_by_info_and_removed_by_gc(model_dir, tmp_path, capsys):
    idx = tmp_path / "idx"
    rag = KVRAG.from_defaults(idx, model=str(model_dir))
    rag.store_kv([t for t, _ in FACTS])  # what a first ingest killed before its commit leaves: KV, no manifest
    entries = list((idx / "kv").rglob("*.kv.safetensors"))
    assert len(entries) == len(FACTS) and not (idx / MANIFEST).exists()
    code, _, err = cli(capsys, "info", "--index", idx)  # before: "no kvrag index at ...", and gc said the same
    assert code == 2 and "interrupted before its first commit" in err and f"{len(FACTS)} KV entries" in err
    assert f"kvrag gc --index {idx}" in err
    with pytest.raises(IndexLoadError, match="interrupted before its first commit"):
        KVRAG.load(idx)
    code, out, _ = cli(capsys, "gc", "--index", idx, "--dry-run")
    assert code == 0 and f"would remove {len(FACTS)} KV entries" in out and all(p.exists() for p in entries)
    code, out, _ = cli(capsys, "gc", "--index", idx)
    assert code == 0 and f"removed {len(FACTS)} KV entries" in out and "the folder is gone" in out
    assert not idx.exists()


def test_gc_of_an_uncommitted_folder_removes_only_what_kvrag_wrote(model_dir, tmp_path, capsys):
    idx = tmp_path / "idx"
    KVRAG.from_defaults(idx, model=str(model_dir)).store_kv([FACTS[0][0]])
    mine = idx / "notes.txt"
    mine.write_text("the user's")
    (idx / "kv" / "readme").write_text("also the user's")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.kv.safetensors").write_text("keep")
    (idx / "kv" / "ab").mkdir(exist_ok=True)
    (idx / "kv" / "ab" / "link").symlink_to(outside)
    code, out, _ = cli(capsys, "gc", "--index", idx)
    assert code == 0 and "removed 1 KV entries" in out and "gone" not in out
    assert mine.read_text() == "the user's" and (idx / "kv" / "readme").exists()
    assert (outside / "keep.kv.safetensors").read_text() == "keep"  # a link is never walked
    assert not list((idx / "kv").rglob("*.kv.safetensors"))


def test_a_failed_first_ingest_leaves_no_folder_behind(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    big = tmp_path / "big.txt"
    big.write_text("harbour " * 300_000)  # 2.4 MB
    cases = [
        [tmp_path / "missing.txt"],
        [empty],
        [big, "--max-file-mb", "1", "--strict"],
    ]
    for n, case in enumerate(cases):
        idx = tmp_path / f"idx{n}"
        code, _, err = cli(capsys, "ingest", *case, "--index", idx, "--model", model_dir, "--quiet")
        assert code == 2 and err.startswith("kvrag: error:"), err
        assert not idx.exists(), (case, list(idx.rglob("*")))  # before: idx/kv/ was left, empty


def test_redis_out_of_memory_advice_says_one_thing():
    advice = _advice(Exception("OOM command not allowed when used memory > 'maxmemory'."))
    assert "out of memory" in advice and "gc" not in advice and "removed" not in advice


# -- the command line ---------------------------------------------------------------------------------------------


def test_control_characters_in_echoed_input_are_escaped(tmp_path, capsys):
    odd = tmp_path / "a\x1b[2Jb\rc"
    code, _, err = cli(capsys, "info", "--index", odd)
    assert code == 2 and "\x1b" not in err and "\r" not in err and "\\x1b[2Jb\\x0dc" in err
    assert printable("q\x07\x9b\u00e9\t") == "q\\x07\\x9b\u00e9\\x09"


def test_ctrl_c_while_starting_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["kvrag.cli.main"], "_run", interrupted)
    assert main(["info", "--index", "anywhere"]) == 130  # before: a KeyboardInterrupt traceback
    assert capsys.readouterr().err == "kvrag: interrupted\n"


def test_a_redis_entry_larger_than_an_entry_can_be_is_damaged_never_fetched_whole():
    from redis_server import RedisServer

    from kvrag.cache.store import RedisStore

    server = RedisServer()
    try:
        store = RedisStore(server.url, namespace="capped", max_entry_bytes=1000)
        key = "ab" * 32
        assert store._read(key) is None  # nothing there: a miss
        store.client.set(store.prefix + key, b"x" * 5000)
        assert store._read(key) == b""  # before: fetched whole, whatever its size
        store.client.set(store.prefix + key, b"")
        assert store._read(key) == b""
        store.client.set(store.prefix + key, b"y" * 1000)
        assert store._read(key) == b"y" * 1000
    finally:
        server.stop()
