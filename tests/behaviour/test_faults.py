"""Faults: damaged and foreign KV entries, concurrent and killed ingestion, a store that goes away, a full disk.

Each case ends in the answer a healthy engine gives (recomputing what cannot be trusted) or in a clean error
that leaves everything already stored as it was.
"""

import copy
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_server import RedisServer, free_port
from tiny import FACTS, HashEmbedder, byte_tokenizer, save_tiny, tiny_model

import kvrag.cache.codec
from kvrag import KVModel
from kvrag.cache.codec import decode_entry, encode_entry
from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import DiskStore, MemoryStore, RedisStore, TieredStore
from kvrag.engine.rag import KVRAG, StoreWarning
from kvrag.errors import StoreError

HERE = Path(__file__).resolve().parents[1]  # tests/, where tiny.py is
Q = "Who runs Velloria's harbour?"
GEN = {"top_k": 2, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def hash_embedder(monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", HashEmbedder)


def engine(model_dir, path, **kwargs):
    return KVRAG.from_defaults(path, model=str(model_dir), chunk_tokens=120, overlap=8, **kwargs)


def entry_path(rag, key):
    return next(Path(rag.path, "kv").rglob(f"{key}.kv.safetensors"))


# -- damaged entries -------------------------------------------------------------------------------------


def _flip_in_header(blob, field):
    """Change one character of a metadata value (`start`) or of the keys tensor's dtype, keeping the length."""
    (length,) = __import__("struct").unpack("<Q", blob[:8])
    header = blob[8 : 8 + length].decode()
    if field == "start":
        at = header.index('"start":"') + len('"start":"')
        new = "7" if header[at] != "7" else "8"
    else:  # the keys' dtype: F16 read as I16, the same size
        at = header.index('"keys":{"dtype":"F16"') + len('"keys":{"dtype":"')
        new = "I"
    header = header[:at] + new + header[at + 1 :]
    return blob[:8] + header.encode() + blob[8 + length :]


DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "empty": lambda b: b"",
    "flipped tensor byte": lambda b: b[:-9] + bytes([b[-9] ^ 0xFF]) + b[-8:],
    "flipped start in the header": lambda b: _flip_in_header(b, "start"),
    "flipped dtype in the header": lambda b: _flip_in_header(b, "dtype"),
    "garbage": lambda b: os.urandom(len(b)),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_entry_is_recomputed_stored_again_and_the_answer_is_unchanged(model_dir, tmp_path, how):
    rag = engine(model_dir, tmp_path / "index")
    rag.ingest(FACTS, progress=False)
    before = rag.query(Q, **GEN)
    key = rag.index.records[before.sources[0].id].key
    path = entry_path(rag, key)
    path.write_bytes(DAMAGE[how](path.read_bytes()))
    rag.store.front.delete(key)  # the disk entry is read, not the in-memory copy
    after = rag.query(Q, **GEN)
    assert after.stats.chunks_encoded == 1 and after.stats.store_hits == 1
    assert after.token_ids == before.token_ids
    assert rag.store.back.get(key) is not None  # the recomputed KV was stored over the damaged entry


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_any_single_damaged_byte_is_a_miss_or_reads_back_identical(data):
    g = torch.Generator().manual_seed(0)
    chunk = ChunkKV(torch.arange(6), torch.randn(2, 2, 6, 4, generator=g), torch.randn(2, 2, 6, 4, generator=g), 9, "e")
    blob = bytearray(encode_entry(chunk, key="ab" * 32, dtype=data.draw(st.sampled_from(["float32", "int8"]))))
    at = data.draw(st.integers(0, len(blob) - 1))
    blob[at] ^= data.draw(st.integers(1, 255))
    back = decode_entry(bytes(blob), key="ab" * 32, encoder="e", dtype=torch.float32, device="cpu")
    if back is not None:  # only a change that means nothing (JSON padding) may read back, and then exactly
        reference = decode_entry(
            encode_entry(chunk, key="ab" * 32, dtype="float32"),
            key="ab" * 32,
            encoder="e",
            dtype=torch.float32,
            device="cpu",
        )
        assert back.start == 9 and torch.equal(back.token_ids, chunk.token_ids)
        assert back.keys.shape == reference.keys.shape and torch.allclose(back.keys, reference.keys, atol=0.05)


# -- entries written for something else ------------------------------------------------------------------


def other_models():
    """KVModels that must never share entries with the tiny llama in float32 under its chat template."""
    base = tiny_model("llama")
    bf16 = copy.deepcopy(base)
    return {
        "another model": KVModel(tiny_model("llama", seed=1), byte_tokenizer()),
        "another dtype": KVModel(bf16.to(torch.bfloat16).eval(), byte_tokenizer()),
        "another template": KVModel(
            base,
            byte_tokenizer(
                chat_template="{% for m in messages %}{{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
            ),
        ),
    }


@pytest.mark.parametrize("which", ["another model", "another dtype", "another template", "another format version"])
def test_an_entry_written_for_another_model_dtype_template_or_format_is_never_used(tmp_path, monkeypatch, which):
    ours = KVModel(tiny_model("llama"), byte_tokenizer())
    text = FACTS[1][0]
    theirs = ours if which == "another format version" else other_models()[which]
    foreign = DiskStore(tmp_path / "kv", storage_dtype="float32")
    foreign.bind(encoder=theirs.encoder_id, dtype=theirs.prefix.keys.dtype, device="cpu")
    their_kv = theirs.encode([text])[0]
    our_key = ours.chunk_key(ours.layout.chunk_ids(text))
    if which != "another format version":
        assert theirs.chunk_key(theirs.layout.chunk_ids(text)) != our_key  # a different key: a plain miss
    with monkeypatch.context() as patched:
        if which == "another format version":
            patched.setattr(kvrag.cache.codec, "KV_FORMAT_VERSION", 99)
        foreign.put(our_key, their_kv)  # and even planted at our key, it is refused
    store = DiskStore(tmp_path / "kv", storage_dtype="float32")
    store.bind(encoder=ours.encoder_id, dtype=torch.float32, device="cpu")
    assert our_key in store and store.get(our_key) is None


# -- two processes, and a process killed -----------------------------------------------------------------

CHILD = r"""
import json, os, signal, sys, time
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from tiny import HashEmbedder
import kvrag.engine.rag, kvrag.files, kvrag.cache.store.disk
kvrag.engine.rag.Embedder = HashEmbedder
from kvrag.engine.rag import KVRAG

args = json.loads(sys.argv[1])
rag = KVRAG.from_defaults(args["index"], model=args["model"], chunk_tokens=400, overlap=8)
rag.kvmodel.batch_tokens = 256  # many small encoding forwards, so a kill lands in the middle
for batch in args.get("committed", []):
    rag.ingest([(t, {{"batch": 1}}) for t in batch], progress=False)
kill = args.get("kill")
if kill in ("kv entry", "index commit"):
    module = kvrag.cache.store.disk if kill == "kv entry" else kvrag.files
    real, calls = module.os.replace, [0]
    def replace(src, dst):
        calls[0] += 1
        # the 3rd KV entry written but not renamed / the index files written but not the manifest
        if (kill == "kv entry" and calls[0] == 3) or (kill == "index commit" and str(dst).endswith(".json")):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)
    module.os.replace = replace
if "barrier" in args:
    open(args["ready"], "w").close()
    while not os.path.exists(args["barrier"]):
        time.sleep(0.01)
def progress(done, total):
    print("progress", done, total, flush=True)
    time.sleep(0.02)
stats = rag.ingest([(t, {{"batch": 2}}) for t in args["texts"]], progress=False, on_progress=progress)
print("done", json.dumps({{"encoded": stats.encoded, "chunks": stats.chunks}}), flush=True)
"""


def child(tmp_path, **args):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(HERE)))
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def texts(tag, n, words=25):
    return [f"{tag} record {i}: " + " ".join(f"{tag}{i}w{j}" for j in range(words)) + "." for i in range(n)]


def every_entry_is_whole(rag):
    """Every KV file in the store decodes (none is half written) and every indexed chunk's KV is stored."""
    back = rag.store.back
    files = list(back.keys())
    assert files and all(back.get(k) is not None for k in files)
    return set(files)


def test_two_processes_ingesting_into_one_index_lose_nothing(model_dir, tmp_path):
    index = tmp_path / "index"
    a, b = texts("alpha", 6), texts("beta", 6)
    procs = [
        child(
            tmp_path,
            index=str(index),
            model=str(model_dir),
            texts=batch,
            ready=str(tmp_path / f"r{i}"),
            barrier=str(tmp_path / "go"),
        )
        for i, batch in enumerate((a, b))
    ]
    deadline = time.time() + 120
    while not all((tmp_path / f"r{i}").exists() for i in range(2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    rag = KVRAG.load(index)
    assert {r.text for r in rag.index.records.values()} == set(a) | set(b)
    assert every_entry_is_whole(rag) >= {r.key for r in rag.index.records.values()}
    answer = rag.query("alpha3w4 alpha3w7 alpha3w19", top_k=1, max_new_tokens=2)
    assert answer.stats.chunks_encoded == 0 and answer.sources[0].text == a[3]


@pytest.mark.parametrize("kill", ["kv entry", "index commit", "external SIGKILL"])
def test_a_process_killed_mid_ingestion_leaves_a_whole_index_that_a_rerun_completes(model_dir, tmp_path, kill):
    index = tmp_path / "index"
    first, second = texts("gamma", 3), texts("delta", 30)
    proc = child(
        tmp_path,
        index=str(index),
        model=str(model_dir),
        committed=[first],
        texts=second,
        kill=None if kill == "external SIGKILL" else kill,
    )
    if kill == "external SIGKILL":
        for line in proc.stdout:  # kill it between two encoding batches of the second ingest
            if line.startswith("progress"):
                proc.send_signal(signal.SIGKILL)
                break
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert "done" not in out

    rag = KVRAG.load(index)  # loads, and holds the committed ingest only
    assert {r.text for r in rag.index.records.values()} == set(first)
    whole = every_entry_is_whole(rag)  # no half-written entry; a killed writer's temporary file is not one
    assert {r.key for r in rag.index.records.values()} <= whole
    stats = rag.ingest([(t, {"batch": 2}) for t in second], progress=False)  # the re-run completes it
    assert stats.chunks == len(second) and stats.store_hits + stats.encoded == len(second)
    assert {r.text for r in KVRAG.load(index).index.records.values()} == set(first) | set(second)
    fresh = KVModel(rag.kvmodel.model, rag.kvmodel.tokenizer)
    a = rag.query("delta17w3 delta17w11 delta17w20", top_k=1, max_new_tokens=4)
    assert a.sources[0].text == second[17] and a.stats.chunks_encoded == 0
    assert (
        a.token_ids
        == fresh.answer(
            "delta17w3 delta17w11 delta17w20",
            [s.text for s in a.sources],
            scores=[s.score for s in a.sources],
            max_new_tokens=4,
        ).token_ids
    )


# -- Redis down at start and mid-query ----------------------------------------------------------------------


def test_redis_down_at_start_answers_by_recomputing_and_uses_redis_once_it_is_up(model_dir, tmp_path):
    built = engine(model_dir, tmp_path / "index")
    built.ingest(FACTS, progress=False)
    expected = built.query(Q, **GEN)
    port = free_port()
    with pytest.warns(StoreWarning, match="unreachable at start"):
        rag = KVRAG.load(
            tmp_path / "index",
            store=TieredStore(
                MemoryStore(), RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5, retry_after_s=0.0)
            ),
        )
    with pytest.warns(StoreWarning, match="recomputing the chunk"):
        down = rag.query(Q, **GEN)
    assert down.stats.chunks_encoded == 2 and down.token_ids == expected.token_ids
    server = RedisServer(port=port)
    try:
        rag.store.front.delete(rag.index.records[down.sources[0].id].key)
        up = rag.query(Q, **GEN)  # no warning now: the miss is read from Redis and stored there
        assert up.token_ids == expected.token_ids and len(rag.store.back) >= 1
    finally:
        server.stop()
    with pytest.raises(StoreError, match="Start the server"):
        KVRAG.load(tmp_path / "index", store=RedisStore(f"redis://127.0.0.1:{port}/0"), require_store=True)


def test_redis_going_down_in_the_middle_of_one_query(model_dir, tmp_path):
    server = RedisServer()
    try:
        store = TieredStore(MemoryStore(), RedisStore(server.url, namespace="mid-query"))
        rag = engine(model_dir, None, store=store)
        rag.ingest(FACTS, progress=False)
        expected = rag.query(Q, top_k=3, max_new_tokens=6)
        for key in list(store.front.keys()):
            store.front.delete(key)
        real_get, reads = store.back.client.getrange, []

        def get_then_die(name, start, end):
            reads.append(name)
            blob = real_get(name, start, end)
            if len(reads) == 1:
                server.stop()  # after the first chunk's KV was read
            return blob

        store.back.client.getrange = get_then_die  # a read is capped: GETRANGE up to what an entry can be
        with pytest.warns(StoreWarning, match="recomputing the chunk"):
            answer = rag.query(Q, top_k=3, max_new_tokens=6)
    finally:
        server.stop()
    assert answer.stats.store_hits == 1 and answer.stats.chunks_encoded == 2
    assert answer.token_ids == expected.token_ids


# -- a full disk ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["kv entry", "index"])
def test_a_full_disk_is_a_clean_error_that_corrupts_nothing(model_dir, tmp_path, monkeypatch, where):
    rag = engine(model_dir, tmp_path / "index")
    rag.ingest(FACTS, progress=False)
    before = rag.query(Q, **GEN)
    entries = {p: p.read_bytes() for p in (tmp_path / "index").rglob("*") if p.is_file() and p.name != ".kvrag.lock"}
    real_fsync = os.fsync

    def full(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if where == "kv entry" or f"{os.sep}index{os.sep}index{os.sep}" in target or "kvrag-index.json" in target:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    with (
        monkeypatch.context() as patched,
        pytest.raises(StoreError, match="No space left on device.*(unchanged|nothing stored was changed)"),
    ):
        patched.setattr(os, "fsync", full)
        rag.ingest(texts("epsilon", 4), progress=False)
    after = {p: p.read_bytes() for p in (tmp_path / "index").rglob("*") if p.is_file() and p.name != ".kvrag.lock"}
    if where == "index":  # the KV entries were stored (they are valid), the index and manifest are untouched
        assert {p: b for p, b in after.items() if "kv" not in p.parts} == {
            p: b for p, b in entries.items() if "kv" not in p.parts
        }
    else:
        assert after == entries  # not a byte changed, no temporary file left
    assert not [p for p in after if p.name.endswith(".tmp")]
    assert len(rag.index) == len(FACTS) and rag.query(Q, **GEN).token_ids == before.token_ids
    reloaded = KVRAG.load(tmp_path / "index")
    assert len(reloaded.index) == len(FACTS) and reloaded.query(Q, **GEN).token_ids == before.token_ids
    stats = rag.ingest(texts("epsilon", 4), progress=False)  # with space again, the same ingest completes
    assert stats.documents == 4 and stats.encoded == (0 if where == "index" else stats.chunks)
    assert len(KVRAG.load(tmp_path / "index").index) == len(FACTS) + stats.chunks
