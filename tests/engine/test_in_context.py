"""Ingestion with encoding="document": a document's chunks encoded behind its earlier chunks, stored at keys of
their own, read back by retrieval; the index keeps how each chunk was encoded."""

import pytest
import torch
from tiny import byte_tokenizer, tiny_model

from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.errors import InvalidRequestError
from kvrag.kvmodel import KVModel
from kvrag.cache.store import MemoryStore

STORY = (
    "The lighthouse of Karsa was built in 1872 by Mira Holt. Its lamp burned whale oil until 1910. Orin Dask "
    "keeps the keys of the lighthouse. The river Tam floods every spring. The old mill of Brenn grinds rye."
)


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama", seed=41), byte_tokenizer(), decode_weights="model")


def engine(kv, embedder, encoding, **kw):
    return KVRAG(kv, embedder=embedder, store=MemoryStore(), chunk_tokens=60, overlap=0, encoding=encoding, **kw)


def test_a_documents_chunks_are_encoded_behind_its_earlier_ones_and_read_back_by_their_records_keys(kv, embedder):
    rag = engine(kv, embedder, "document")
    stats = rag.ingest([STORY], progress=False)
    records = sorted(rag.index.records.values(), key=lambda r: int(r.id.rpartition("#")[2]))
    assert stats.chunks == len(records) >= 3 and stats.encoded == len(records)
    assert [r.after for r in records] == list(range(len(records)))  # one run: the story fits the window
    alone = [rag.source.key(kv.chunk_ids(0, r.text)) for r in records]
    assert records[0].key == alone[0] and all(r.key != a for r, a in zip(records[1:], alone[1:]))
    expected = kv.encode_in_context([[r.text for r in records]])[0]
    for record, want in zip(records, expected):
        got = rag.store.get(record.key)
        assert got.start == want.start and torch.allclose(got.keys.float(), want.keys.float(), atol=1e-5)
    # the chunks retrieved in document order and stitched as they are: the full prefill's answer
    sources = sorted(rag.retrieve("Who keeps the keys?", top_k=len(records)), key=lambda s: s.id)
    reused = rag.answer("Who keeps the keys?", sources, strategy="reuse", max_new_tokens=12)
    full = rag.answer("Who keeps the keys?", sources, strategy="full_prefill", max_new_tokens=12)
    assert reused.stats.store_hits == len(records) and reused.stats.chunks_encoded == 0
    assert reused.text == full.text
    # retrieval through query reads the in-context entries too, encoding nothing
    answer = rag.query("Who keeps the keys?", top_k=2, max_new_tokens=4)
    assert answer.stats.chunks_encoded == 0


def test_an_evicted_in_context_entry_is_encoded_alone_and_never_stored_at_its_key(kv, embedder):
    rag = engine(kv, embedder, "document")
    rag.ingest([STORY], progress=False)
    last = max(rag.index.records.values(), key=lambda r: r.after)
    rag.store.delete(last.key)
    answer = rag.query("the old mill of Brenn", top_k=5, max_new_tokens=4)
    assert answer.stats.chunks_encoded >= 1
    assert last.key not in rag.store  # an alone encoding is not what that key holds
    again = rag.ingest([STORY], progress=False)  # re-ingesting encodes the run again, and the key is back
    assert again.encoded == len(rag.index.records) and again.store_hits == 0 and last.key in rag.store


def test_the_encoding_is_kept_with_the_index_and_old_records_read_as_alone(kv, embedder, tmp_path):
    path = tmp_path / "index"
    rag = KVRAG.from_defaults(path, model=kv, chunk_tokens=60, overlap=0, secret="", encoding="document")
    rag.ingest([STORY], progress=False)
    opened = KVRAG.load(path, model=kv, secret="")
    assert opened.encoding == "document"
    assert sorted(r.after for r in opened.index.records.values()) == list(range(len(rag.index.records)))
    assert opened.ingest([STORY], progress=False).encoded == 0
    from kvrag.engine.index import _record

    fields = {"id": "d#0", "doc_id": "d", "text": "t", "metadata": {}, "key": "k", "n_tokens": 1, "row": 0}
    assert _record(fields).after == 0
    with pytest.raises(InvalidRequestError, match="encoding must be one of"):
        engine(kv, embedder, "context")


def test_a_frameworks_texts_read_the_in_context_entries_of_the_chunks_that_hold_them(kv, embedder):
    rag = engine(kv, embedder, "document")
    rag.ingest([STORY], progress=False)
    texts = [r.text for r in sorted(rag.index.records.values(), key=lambda r: r.after)]
    answer = rag.answer("Who keeps the keys?", texts, strategy="reuse", max_new_tokens=4)
    assert answer.stats.chunks_encoded == 0 and answer.stats.store_hits == len(texts)
    assert [s.id for s in answer.sources] == [r.id for r in sorted(rag.index.records.values(), key=lambda r: r.after)]


def test_verify_checks_in_context_entries_and_repair_writes_them_back_in_context(kv, embedder, tmp_path):
    rag = KVRAG.from_defaults(tmp_path / "index", model=kv, chunk_tokens=60, overlap=0, secret="")
    assert rag.encoding == "document"  # a new index's default
    rag.ingest([STORY], progress=False)
    n = len(rag.index.records)
    assert rag.verify() == {**rag.verify(), "checked": n, "ok": n, "missing": 0, "damaged": 0}
    last = max(rag.index.records.values(), key=lambda r: r.after)
    want = rag.store.get(last.key)
    rag.store.delete(last.key)
    assert rag.verify()["missing"] == 1
    assert rag.verify(repair=True)["filled"] == 1
    back = rag.store.get(last.key)
    assert back.start == want.start and back.behind == want.behind and torch.allclose(back.keys, want.keys)
    assert rag.verify()["ok"] == n
