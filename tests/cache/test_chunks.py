"""kvrag.cache.chunks: one request's chunks: ids checked at once, KV only when read, each fetched once: from the
store under the namespace's key, else encoded and stored; a failing store is a warning and a recompute."""

import pytest
import torch
from tiny import byte_tokenizer, tiny_model

from kvrag import KVModel, MemoryStore
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.store import StoreWarning
from kvrag.errors import ContextOverflowError, InvalidRequestError, StoreError

TEXTS = ["The river Tam floods every spring.", "The archive opens at nine.", "Zed is short."]


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


def test_ids_now_kv_only_when_read_and_each_chunk_once(kv):
    store = MemoryStore()
    chunks = ChunkSource(kv, store).chunks(TEXTS)
    assert chunks.lengths == [len(kv.layout.chunk_ids(t)) for t in TEXTS] and chunks.encoded == 0
    first = chunks.kv([2])
    assert chunks.encoded == 1 and len(store) == 1
    again = chunks.kv([2, 0])
    assert again[0] is first[0] and chunks.encoded == 2 and chunks.store_hits == 0
    fresh = kv.encode(TEXTS[:1])[0]
    torch.testing.assert_close(again[1].keys, fresh.keys)


def test_stored_chunks_are_hits_and_a_namespace_has_keys_of_its_own(kv):
    store = MemoryStore()
    ChunkSource(kv, store).chunks(TEXTS).kv()
    hits = ChunkSource(kv, store).chunks(TEXTS)
    hits.kv()
    assert hits.store_hits == 3 and hits.encoded == 0
    other = ChunkSource(kv, store, namespace="tenant-b").chunks(TEXTS)
    other.kv()
    assert other.store_hits == 0 and other.encoded == 3 and len(store) == 6
    ids = kv.layout.chunk_ids(TEXTS[0])
    assert ChunkSource(kv, store).key(ids) == kv.chunk_key(ids) != ChunkSource(kv, store, "tenant-b").key(ids)


def test_given_chunk_kv_is_used_as_is(kv):
    enc = kv.encode(TEXTS[:2])
    chunks = ChunkSource(kv, MemoryStore()).chunks([enc[0], TEXTS[1]])
    got = chunks.kv()
    assert got[0] is enc[0] and chunks.encoded == 1 and chunks.texts()[1] == TEXTS[1]


class Broken(MemoryStore):
    def _get(self, key):
        raise StoreError("down")

    def put(self, key, kv):
        raise StoreError("down")


def test_a_store_that_fails_is_a_warning_and_the_chunk_is_encoded(kv):
    chunks = ChunkSource(kv, Broken()).chunks(TEXTS[:1])
    with pytest.warns(StoreWarning, match="the KV store failed"):
        got = chunks.kv()
    assert chunks.encoded == 1 and got[0].encoder == kv.encoder_id


def test_chunks_are_checked_against_the_model_when_resolved(kv):
    other = KVModel(tiny_model("qwen2"), byte_tokenizer()).encode(TEXTS[:1])[0]
    with pytest.raises(InvalidRequestError, match="encoded by another model"):
        ChunkSource(kv).chunks([other])
    with pytest.raises(ContextOverflowError, match="split it"):
        ChunkSource(kv).chunks(["word " * 2000])
