"""A disk store bounded in bytes: least recently used entries evicted past the bound (never a pinned one), the
bound held under concurrent writers and readers, an evicted entry only a miss, answers unchanged; KV on demand."""

import threading

import pytest
import torch
from tiny import FACTS, HashEmbedder

from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import DiskStore, MemoryStore
from kvrag.engine.rag import KVRAG
from kvrag.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("hash_embedder")
Q = "Who runs Velloria's harbour?"
GEN = dict(max_new_tokens=6, strategy="reuse")


def entry(i: int, tokens: int = 64) -> ChunkKV:
    g = torch.Generator().manual_seed(i)
    return ChunkKV(
        torch.arange(tokens),
        torch.randn(2, 1, tokens, 16, generator=g),
        torch.randn(2, 1, tokens, 16, generator=g),
        0,
        "e",
    )


def bound_store(tmp_path, entries: int, **kwargs) -> tuple[DiskStore, int]:
    probe = DiskStore(tmp_path / "probe", "float32")
    probe.bind(encoder="e", dtype=torch.float32, device="cpu")
    probe.put("0" * 64, entry(0))
    size = probe.nbytes
    store = DiskStore(tmp_path / "kv", "float32", max_bytes=entries * size, **kwargs)
    store.bind(encoder="e", dtype=torch.float32, device="cpu")
    return store, size


def key(i: int) -> str:
    return f"{i:064x}"


def test_the_least_recently_used_entries_go_first_and_a_pinned_one_never(tmp_path):
    store, size = bound_store(tmp_path, 4)
    store.pin([key(1)])
    for i in range(4):
        store.put(key(i), entry(i))
    assert store.get(key(0)) is not None  # 0 is now the most recent; 1 pinned; 2 the least recent
    store.put(key(4), entry(4))
    assert store.nbytes <= store.max_bytes and store.evictions >= 1
    assert key(2) not in store and key(1) in store and key(0) in store and key(4) in store
    assert store.get(key(2)) is None  # only a miss
    for i in range(5, 40):
        store.put(key(i), entry(i))
        assert store.nbytes <= store.max_bytes
    assert key(1) in store


def test_the_bound_holds_under_concurrent_writers_and_readers(tmp_path):
    store, size = bound_store(tmp_path, 6)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(25):
                store.put(key(1000 * t + i), entry(i))
                store.get(key(1000 * t + i // 2))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and store.nbytes <= store.max_bytes + size and store.evictions >= 4 * 25 - 6


def test_a_bad_bound_is_refused():
    with pytest.raises(InvalidRequestError, match="max_bytes"):
        DiskStore("/tmp/unused-kvrag-store", max_bytes=0)


def test_answers_over_a_bounded_store_are_an_unbounded_stores_and_kv_on_demand_fills_it(kv, tmp_path):
    texts = [t for t, _ in FACTS]
    free = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore())
    free.ingest(texts, progress=False)
    want = free.query(Q, top_k=3, **GEN)

    probe = KVRAG(kv, embedder=HashEmbedder(), store=DiskStore(tmp_path / "probe"))
    probe.ingest(texts[:1], progress=False)
    small = DiskStore(tmp_path / "kv", max_bytes=2 * probe.store.nbytes)  # about two entries of the 3 a query reads
    rag = KVRAG(kv, embedder=HashEmbedder(), store=small, path=tmp_path / "index")
    stats = rag.ingest(texts, progress=False, encode=False)  # KV on demand: nothing encoded now
    assert stats.encoded == 0 and len(list(small.keys())) == 0
    got = rag.query(Q, top_k=3, **GEN)
    assert got.token_ids == want.token_ids and got.stats.chunks_encoded == 3
    assert small.nbytes <= small.max_bytes + probe.store.nbytes and small.evictions >= 1
    again = rag.query(Q, top_k=3, **GEN)
    assert again.token_ids == want.token_ids
    info = rag.info()
    assert info["kv_evictions"] == small.evictions and info["kv_max_bytes"] == small.max_bytes
    rag.persist()
    assert KVRAG.load(tmp_path / "index", model=kv).info()["kv_max_bytes"] == small.max_bytes


def test_the_command_line_bounds_an_index_and_ingests_kv_on_demand(tmp_path, capsys):
    from tiny import save_tiny

    from kvrag.cli import main

    model = save_tiny(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    for n, (text, _) in enumerate(FACTS):
        (docs / f"{n}.txt").write_text(text)
    index = tmp_path / "index"
    common = ["--index", str(index), "--model", str(model), "--quiet"]
    assert main(["ingest", str(docs), *common, "--max-kv-gb", "0.00002", "--kv-on-demand"]) == 0
    assert not list((index / "kv").rglob("*.safetensors"))  # nothing encoded yet
    capsys.readouterr()
    assert main(["ask", Q, "--index", str(index), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    assert list((index / "kv").rglob("*.safetensors"))  # kept at its first retrieval, though `ask` reads only
    assert KVRAG.load(index).info()["kv_max_bytes"] == 20_000  # kept with the index
    code = main(["ingest", str(docs), *common, "--max-kv-gb", "1", "--redis", "redis://localhost:1"])
    assert code == 2 and "bound Redis itself" in capsys.readouterr().err
