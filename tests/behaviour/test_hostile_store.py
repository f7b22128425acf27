"""More of a hostile world, at the store and index level: links and FIFOs inside a store or index folder, a
manifest stripped of its checksums, entries written before namespace views, an ingest racing gc, and an
engine opened read-only over a store the caller gave."""

import json
import os
import threading
import time

import pytest
from tiny import FACTS, HashEmbedder, save_tiny

from kvrag.cache.chunks import ChunkSource
from kvrag.cache.store import DiskStore, MemoryStore, StoreWarning, TieredStore
from kvrag.cli import main
from kvrag.engine.folder import MANIFEST
from kvrag.engine.rag import KVRAG
from kvrag.errors import IndexLoadError, StoreError

SECRET = "k" * 32
pytestmark = pytest.mark.usefixtures("hash_embedder")
GEN = dict(max_new_tokens=3, strategy="reuse")


def in_thread(fn, seconds=10.0):
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


def test_the_sweep_never_walks_a_linked_bucket_and_a_linked_tenant_folder_is_refused(tmp_path):
    victim = tmp_path / "victim"
    (victim / "ab").mkdir(parents=True)
    old = victim / ".secret.tmp"
    old.write_text("keep me")
    (victim / "ab" / ".keep.tmp").write_text("keep me too")
    for path in (old, victim / "ab" / ".keep.tmp"):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "cd").symlink_to(victim)
    DiskStore(tmp_path / "kv").sweep(older_than_s=0)  # before: deleted victim/.secret.tmp through kv/cd
    (tmp_path / "kv" / "ns-t").symlink_to(victim)
    with pytest.raises(StoreError, match="symbolic link"):
        DiskStore(tmp_path / "kv").scoped("t")  # before: listed, swept and deleted under victim/
    assert old.read_text() == "keep me" and (victim / "ab" / ".keep.tmp").read_text() == "keep me too"


def test_a_fifo_in_an_index_folder_or_a_store_is_refused_at_once(kv, tmp_path):
    model = save_tiny(tmp_path / "model")
    index = tmp_path / "index"
    KVRAG.from_defaults(index, model=str(model)).ingest(FACTS, progress=False)
    entry = next((index / "kv").rglob("*.kv.safetensors"))
    entry.unlink()
    os.mkfifo(entry)  # a KV entry that would block its reader forever
    rag = KVRAG.load(index, read_only=True)
    with pytest.warns(StoreWarning, match="not a regular file"):
        in_thread(lambda: rag.query("Who runs Velloria's harbour?", top_k=5, **GEN))
    chunks = next((index / "index").glob("chunks-*.jsonl"))
    chunks.unlink()
    os.mkfifo(chunks)
    with pytest.raises(IndexLoadError, match="not a regular file"):
        in_thread(lambda: KVRAG.load(index))
    (index / ".kvrag.lock").unlink()
    os.mkfifo(index / ".kvrag.lock")
    assert in_thread(lambda: main(["info", "--index", str(index)])) == 2


def test_with_a_secret_a_manifest_stripped_of_its_checksums_is_refused(tmp_path):
    model = save_tiny(tmp_path / "model")
    index = tmp_path / "index"
    KVRAG.from_defaults(index, model=str(model), secret=SECRET).ingest(FACTS, progress=False)
    manifest = json.loads((index / MANIFEST).read_text())
    chunks = index / "index" / f"chunks-{manifest['index']}.jsonl"
    lines = chunks.read_text().splitlines()
    chunks.write_text("\n".join(line.replace("Orin Dask", "Mallory") for line in lines) + "\n")
    del manifest["checksums"]  # what a forger without the secret can do to hide the edit
    (index / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(IndexLoadError, match="changed by someone without its secret"):
        KVRAG.load(index, secret=SECRET)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    fresh = tmp_path / "fresh"
    for n in range(2):  # before: the second ingest failed, its flags checked without the secret
        note = tmp_path / f"note{n}.txt"
        note.write_text(FACTS[n][0])
        args = ["ingest", str(note), "--index", str(fresh), "--model", str(model), "--secret-file", str(secret_file)]
        assert main([*args, "--quiet"]) == 0
    assert len(KVRAG.load(fresh, secret=SECRET).index.docs()) == 2


def test_a_namespaced_engine_still_reads_the_entries_a_kvrag_before_views_wrote(kv, tmp_path):
    shared = DiskStore(tmp_path / "kv")
    old = ChunkSource(kv, shared, "tenant-a")  # the previous layout: the namespace in the key only
    texts = [t for t, _ in FACTS[:2]]
    old.encode_and_store(
        [kv.chunk_ids(i, t) for i, t in enumerate(texts)], [old.key(kv.chunk_ids(i, t)) for i, t in enumerate(texts)]
    )
    # unkeyed, as that kvrag wrote them: opened with secret="" (the default key would find none of them)
    old_layout = dict(embedder=HashEmbedder(), store=DiskStore(tmp_path / "kv"), read_only=True, secret="")
    rag = KVRAG(kv, namespace="tenant-a", **old_layout)
    answer = rag.answer("Who runs the harbour?", texts, **GEN)
    assert answer.stats.store_hits == 2 and answer.stats.chunks_encoded == 0
    other = KVRAG(kv, namespace="tenant-b", **{**old_layout, "store": DiskStore(tmp_path / "kv")})
    assert other.answer("Who runs the harbour?", texts, **GEN).stats.store_hits == 0  # another tenant's key


def test_an_entry_removed_while_an_ingest_encodes_is_stored_again_before_it_commits(kv, tmp_path):
    store = TieredStore(MemoryStore(), DiskStore(tmp_path / "kv"))
    rag = KVRAG(kv, embedder=HashEmbedder(), store=store, path=tmp_path / "index")
    rag.ingest(FACTS[:2], progress=False)

    embed = rag.embedder.embed

    def gc_then_embed(texts):  # a `kvrag gc` between this ingest's encoding and its commit: its entries are orphans
        live = {r.key for r in rag.index.records.values()}
        for key in [k for k in store.keys() if k not in live]:
            store.delete(key)
        return embed(texts)

    rag.embedder.embed = gc_then_embed
    rag.ingest(FACTS[2:], progress=False)
    info = rag.info()
    assert info["kv_missing"] == 0 and info["kv_entries"] == len(FACTS)  # before: missing after the commit


def test_read_only_writes_nothing_into_a_store_the_caller_gave(kv, tmp_path):
    back = DiskStore(tmp_path / "kv")
    rag = KVRAG(kv, embedder=HashEmbedder(), store=TieredStore(MemoryStore(), back), read_only=True)
    rag.answer("Who runs the harbour?", [FACTS[1][0]], **GEN)
    assert list(back.keys()) == []  # before: the recomputed chunk was written
    with pytest.raises(Exception, match="read-only"):
        rag.ingest(FACTS, progress=False)


def test_a_chunk_missed_before_the_lock_and_stored_meanwhile_is_not_encoded_again(kv):
    store = TieredStore(MemoryStore(), MemoryStore())
    source = ChunkSource(kv, store)
    chunks = source.chunks([FACTS[0][0]])
    chunks.prefetch()  # a miss
    source.keep(source.key(chunks.ids[0]), kv.encode([FACTS[0][0]])[0])  # another request stores it meanwhile
    chunks.kv()
    assert chunks.encoded == 0 and chunks.store_hits == 1
