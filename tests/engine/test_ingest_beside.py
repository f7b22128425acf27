"""kvrag.engine.ingest: the embedder runs on a thread of its own, beside the encoding forwards where the model is on
an accelerator and beside the last store writes on the CPU; the index is the same either way, an embedder that fails
fails the ingest, and nothing half-ingested is committed."""

import threading

import pytest
from tiny import HashEmbedder, byte_tokenizer, tiny_model

import kvrag.engine.ingest as ingest_module
from kvrag import KVModel, MemoryStore
from kvrag.engine.rag import KVRAG

TEXTS = [f"Fact {i}: the harbour of Quell opens at {i} in the morning." for i in range(5)]
QUESTION = "When does the harbour open at 3?"


class ThreadEmbedder(HashEmbedder):
    """Records the thread each embedding ran on and the forwards done when it began; fails when told to."""

    def __init__(self, forwards=None, fail=False):
        super().__init__()
        self.calls, self.forwards, self.fail = [], forwards, fail

    def embed(self, texts):
        self.calls.append((threading.current_thread(), len(self.forwards) if self.forwards is not None else None))
        if self.fail and len(texts) > 1:
            raise RuntimeError("the embedder ran out of memory")
        return super().embed(texts)


@pytest.fixture
def kv(monkeypatch):
    kv = KVModel(tiny_model("llama"), byte_tokenizer(), batch_tokens=80)  # several forwards
    kv.forwards = []
    encode = kv.encode_runs_ids  # ingestion's one encoding forward
    monkeypatch.setattr(kv, "encode_runs_ids", lambda runs, **kw: kv.forwards.append(len(runs)) or encode(runs, **kw))
    return kv


def test_on_the_cpu_the_embedder_starts_after_the_last_forward_on_a_thread_of_its_own(kv):
    embedder = ThreadEmbedder(kv.forwards)
    rag = KVRAG(kv, embedder=embedder, store=MemoryStore())
    stats = rag.ingest(TEXTS, progress=False)
    thread, forwards_done = embedder.calls[-1]
    assert stats.encoded == len(TEXTS) and len(kv.forwards) > 1
    assert thread is not threading.main_thread() and forwards_done == len(kv.forwards)


def test_beside_the_forwards_the_index_and_the_answers_are_the_same(kv, monkeypatch):
    after = KVRAG(kv, embedder=ThreadEmbedder(), store=MemoryStore())
    after.ingest(TEXTS, progress=False)
    monkeypatch.setattr(ingest_module, "_embeds_beside", lambda kvmodel: True)
    embedder = ThreadEmbedder()
    beside = KVRAG(kv, embedder=embedder, store=MemoryStore())
    assert beside.ingest(TEXTS, progress=False).encoded == len(TEXTS)
    assert embedder.calls[-1][0] is not threading.main_thread()
    a, b = (rag.query(QUESTION, top_k=2, max_new_tokens=3) for rag in (beside, after))
    assert [(s.text, s.score) for s in a.sources] == [(s.text, s.score) for s in b.sources]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("beside", [False, True])
def test_an_embedder_that_fails_fails_the_ingest_and_indexes_nothing(kv, monkeypatch, beside):
    monkeypatch.setattr(ingest_module, "_embeds_beside", lambda kvmodel: beside)
    rag = KVRAG(kv, embedder=ThreadEmbedder(fail=True), store=MemoryStore())
    with pytest.raises(RuntimeError, match="ran out of memory"):
        rag.ingest(TEXTS, progress=False)
    assert len(rag.index) == 0
