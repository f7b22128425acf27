"""kvrag.cache.writer and ingestion's encoding loop: chunks sorted into full forwards, their KV stored by a thread
beside the next forward, a bounded number of forwards' KV waiting, a failing store raised with nothing after it."""

import threading
import time

import pytest
import torch
from tiny import byte_tokenizer, tiny_model

from kvrag import KVModel, MemoryStore
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.writer import StoreWriter
from kvrag.errors import StoreError
from kvrag.model.encode import length_batches

WORDS = "the river floods every spring and the archive opens at nine".split()


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer(), batch_tokens=120)


def chunk_ids(kv, n):
    """`n` chunks of many lengths, longest and shortest mixed in the given order."""
    texts = [" ".join(WORDS[: 1 + (i * 7) % len(WORDS)]) + f" ({i})" for i in range(n)]
    return [kv.chunk_ids(i, t) for i, t in enumerate(texts)]


class Recording(MemoryStore):
    """A memory store that records its writes, fails at a given one, or waits at each until let go."""

    def __init__(self, fail_at=None, gate=None):
        super().__init__()
        self.written, self.fail_at, self.gate = [], fail_at, gate

    def put(self, key, kv):
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if self.fail_at is not None and len(self.written) == self.fail_at:
            raise StoreError("No space left on device")
        self.written.append(key)
        super().put(key, kv)


def test_every_chunk_is_stored_as_it_encodes_alone_in_full_sorted_forwards(kv, monkeypatch):
    ids = chunk_ids(kv, 14)
    source = ChunkSource(kv, Recording())
    keys = [source.key(i) for i in ids]
    forwards, batches = [], []
    encode = kv.encode_runs_ids
    monkeypatch.setattr(
        kv, "encode_runs_ids", lambda runs, **kw: forwards.append([sum(map(len, r)) for r in runs]) or encode(runs)
    )
    source.encode_and_store(ids, keys, on_batch=lambda chunks, tokens: batches.append((chunks, tokens)))
    monkeypatch.undo()
    lengths = [len(i) for i in ids]
    planned = length_batches(lengths, kv.batch_tokens)  # the whole ingest sorted by length: the least padding
    assert forwards == [[lengths[i] for i in b] for b in planned] and len(planned) > 1
    assert batches == [(len(b), sum(lengths[i] for i in b)) for b in planned]  # the progress bar's tokens, exactly
    assert sorted(source.store.written) == sorted(keys)
    for i, key in enumerate(keys):  # batched with other chunks, as encoded alone
        alone = kv.encode_ids([ids[i]])[0]
        stored = source.store.get(key)
        assert stored.token_ids.tolist() == ids[i]
        torch.testing.assert_close(stored.keys, alone.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(stored.values, alone.values, atol=1e-5, rtol=0)


def test_a_store_that_fails_raises_in_the_encoding_loop_and_nothing_after_it_is_written(kv):
    ids = chunk_ids(kv, 14)
    source = ChunkSource(kv, Recording(fail_at=3))
    with pytest.raises(StoreError, match="No space left"):
        source.encode_and_store(ids, [source.key(i) for i in ids])
    assert len(source.store.written) == 3 and len(source.store) == 3


def test_the_feeder_waits_once_queued_groups_wait_and_the_writer_keeps_their_order(kv):
    gate = threading.Event()
    store = Recording(gate=gate)
    kv_one = kv.encode_ids([[5, 6, 7]])[0]
    fed = []

    def feed():
        with StoreWriter(store, queued=1) as writer:
            for n in range(4):
                writer.put([(f"k{n}", kv_one)])
                fed.append(n)

    feeder = threading.Thread(target=feed)
    feeder.start()
    time.sleep(0.3)
    # group 0 is being written (held at the gate), group 1 waits in the queue, group 2 waits to be queued
    assert fed == [0, 1] and store.written == []
    gate.set()
    feeder.join(timeout=10)
    assert fed == [0, 1, 2, 3] and store.written == ["k0", "k1", "k2", "k3"]


def test_leaving_by_an_exception_drops_what_waits_and_does_not_wait_for_the_writer(kv):
    gate = threading.Event()
    store = Recording(gate=gate)
    kv_one = kv.encode_ids([[5, 6, 7]])[0]
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        with StoreWriter(store, queued=1) as writer:
            writer.put([("k0", kv_one)])
            writer.put([("k1", kv_one)])
            raise KeyboardInterrupt  # Ctrl-C while a write is held up
    assert time.perf_counter() - t0 < 1.0
    gate.set()
    time.sleep(0.2)
    assert store.written in ([], ["k0"])  # the write under way may end; the waiting group is dropped
