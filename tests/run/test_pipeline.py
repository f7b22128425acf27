"""The seam (kvrag.run.pipeline, kvrag.run.executor): the planner's decision reaches an executor as a Job of chunk ids
and KV only; another executor plugs in behind the same three calls; the stats are built once."""

import time

import pytest
from tiny import byte_tokenizer, tiny_model

from kvrag.answer import last_answer
from kvrag import KVModel, MemoryStore, Request
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.kv import ChunkKV
from kvrag.run import pipeline
from kvrag.run.executor import HFExecutor, Job, StoredChunk
from kvrag.run.generate import decode
from kvrag.model.recompute import full_prefill

TEXTS = [
    "The river Tam floods every spring.",
    "The harbour holds twelve ships.",
    "The archive opens at nine and closes at five.",
    "Cats sleep most of the day.",
]
Q = "When does the archive open?"
GEN = dict(max_new_tokens=6)


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


class Recording:
    """An executor that records the jobs it is given and runs them on the in-process one."""

    reads_store = False

    def __init__(self, inner):
        self.inner, self.jobs = inner, []

    def prefill(self, job, *, phases=None, pooled=False):
        self.jobs.append(job)
        return self.inner.prefill(job, phases=phases, pooled=pooled)

    def decode(self, prefill, sampling):
        return self.inner.decode(prefill, sampling)

    def release(self, prefill):
        self.inner.release(prefill)


class PlainForward:
    """Another executor: every job as one plain forward over its ids (it never reads the KV it is given)."""

    def __init__(self, kv, reads_store=False):
        self.kv, self.reads_store, self.jobs = kv, reads_store, []

    def prefill(self, job, *, phases=None, pooled=False):
        self.jobs.append(job)
        ids = [*self.kv.layout.prefix_ids, *(t for c in job.chunk_ids for t in c), *job.suffix_ids]
        return full_prefill(self.kv.model, ids)

    def decode(self, prefill, sampling):
        return decode(
            self.kv.model, prefill.cache, prefill.logits[-1], prefill.next_position, sampling, self.kv.eos_ids
        )

    def release(self, prefill):
        pass


def answer_with(kv, executor, **options):
    request = Request.of(Q, TEXTS, **options, **GEN)
    chunks = ChunkSource(kv, MemoryStore()).chunks(request.chunks)
    return pipeline_answer(kv, request, chunks, executor), chunks


def pipeline_answer(kv, request, chunks, executor):
    *_, final = pipeline.stream(kv, request, chunks, executor, started_at=time.perf_counter())
    return final


def test_a_job_holds_the_plans_chunks_in_stitched_order_as_ids_and_kv(kv):
    recording = Recording(HFExecutor(kv))
    answer, chunks = answer_with(kv, recording, strategy="target_recompute", scores=[0.1, 0.2, 0.9, 0.3])
    (job,) = recording.jobs
    assert isinstance(job, Job) and answer.stats.order == [0, 1, 3, 2]
    assert job.chunk_ids == [chunks.ids[c] for c in [0, 1, 3, 2]]
    assert all(isinstance(c, ChunkKV) for c in job.chunks) and [len(c) for c in job.chunks] == list(
        map(len, job.chunk_ids)
    )
    assert list(job.recompute) == [3] and job.recompute[3].tolist() == list(range(len(chunks.ids[2])))
    assert answer.text == kv.answer(Q, TEXTS, strategy="target_recompute", scores=[0.1, 0.2, 0.9, 0.3], **GEN).text


def test_only_the_kv_a_plan_reuses_is_read(kv):
    recording = Recording(HFExecutor(kv))
    only, chunks = answer_with(kv, recording, strategy="target_only", scores=[0.1, 0.2, 0.9, 0.3])
    assert chunks.encoded == 1 and only.stats.chunks_encoded == 1 and len(recording.jobs[-1].chunks) == 1
    full, chunks = answer_with(kv, recording, strategy="full_prefill")
    assert chunks.encoded == 0 and recording.jobs[-1].chunks == [] and recording.jobs[-1].full_prefill
    assert full.stats.recomputed_tokens == full.stats.context_tokens == sum(chunks.lengths)


def test_another_executor_plugs_in_behind_the_same_calls(kv):
    mine, _ = answer_with(kv, PlainForward(kv), strategy="reuse")
    reference = kv.answer(Q, TEXTS, strategy="full_prefill", **GEN)
    assert mine.token_ids == reference.token_ids  # the plan's order, executed without reuse
    assert mine.stats.strategy == "reuse" and mine.stats.order == [0, 1, 2, 3]


class CountingStore(MemoryStore):
    def __init__(self):
        super().__init__()
        self.reads = 0
        self.writes: list[str] = []

    def get(self, key):
        self.reads += 1
        return super().get(key)

    def put(self, key, kv):
        self.writes.append(key)
        return super().put(key, kv)


def test_an_executor_that_reads_the_store_itself_is_handed_stored_entries_unread(kv):
    store = CountingStore()
    source = ChunkSource(kv, store)
    source.chunks(TEXTS[:3]).kv()  # three of the four stored beforehand
    store.reads, store.writes = 0, []
    executor = PlainForward(kv, reads_store=True)
    request = Request.of(Q, TEXTS, strategy="reuse", **GEN)
    chunks = source.chunks(request.chunks)
    answer = pipeline_answer(kv, request, chunks, executor)
    (job,) = executor.jobs
    # the fourth was a miss: encoded, stored before the executor ran (it reads the store), and handed over as stored
    assert [type(c) for c in job.chunks] == [StoredChunk] * 4
    assert [c.key for c in job.chunks] == [source.key(i) for i in chunks.ids]
    assert {c.start for c in job.chunks} == {len(kv.chunk_prefix)} and list(map(len, job.chunks)) == chunks.lengths
    assert store.reads == 0 and store.writes == [source.key(chunks.ids[3])]  # nothing read; the miss written once
    assert (answer.stats.store_hits, answer.stats.chunks_encoded) == (3, 1)
    with pytest.raises(TypeError, match="reads no store"):
        HFExecutor(kv).prefill(job)


def test_the_store_is_read_for_the_chunks_a_plan_reuses_and_its_picker_measures_only(kv):
    store = CountingStore()
    source = ChunkSource(kv, store)
    source.chunks(TEXTS).kv()  # every chunk stored
    scores = [0.1, 0.2, 0.9, 0.3]
    for options, reads in [
        (dict(strategy="target_only"), 1),  # the retriever's pick alone
        (dict(strategy="target_only", picker="likelihood"), 3),  # its three candidates, the pick among them
        (dict(strategy="reuse"), 4),
        (dict(strategy="full_prefill"), 0),
    ]:
        store.reads = 0
        request = Request.of(Q, TEXTS, scores=scores, **options, **GEN)
        chunks = source.chunks(request.chunks)
        answer = pipeline_answer(kv, request, chunks, HFExecutor(kv))
        assert store.reads == answer.stats.store_hits == reads, options
        assert answer.stats.chunks_encoded == 0


@pytest.mark.parametrize("picker, reads", [("retriever", 1), ("likelihood", 3)])
def test_the_store_is_read_while_another_request_holds_the_model(kv, picker, reads):
    import threading

    store = CountingStore()
    source = ChunkSource(kv, store)
    source.chunks(TEXTS).kv()
    store.reads = 0
    request = Request.of(Q, TEXTS, strategy="target_only", picker=picker, scores=[0.1, 0.2, 0.9, 0.3], **GEN)
    chunks = source.chunks(request.chunks)
    done = []
    thread = threading.Thread(target=lambda: done.append(pipeline_answer(kv, request, chunks, HFExecutor(kv))))
    with kv.lock:  # another request's forward
        thread.start()
        deadline = time.monotonic() + 10
        while store.reads < reads and time.monotonic() < deadline:
            time.sleep(0.01)
        # the retriever's pick is planned and its chunk read; the likelihood picker's candidates are read, and its
        # measurement waits for the model
        assert store.reads == reads and not done
    thread.join(10)
    assert done and store.reads == reads


def test_the_stats_come_from_the_request_the_plan_and_the_chunks(kv):
    store = MemoryStore()
    source = ChunkSource(kv, store)
    source.chunks(TEXTS[:2]).kv()  # two of the four stored beforehand
    request = Request.of(Q, TEXTS, strategy="reuse", target=2, **GEN)
    answer = pipeline_answer(kv, request, source.chunks(request.chunks), HFExecutor(kv))
    s = answer.stats
    assert (s.store_hits, s.chunks_encoded, s.target_given, s.budget) == (2, 2, 2, 0.05)
    assert s.ttft_s > 0 and s.total_s >= s.ttft_s and s.new_tokens == len(answer.token_ids) <= 6
    assert s.prompt_tokens == len(kv.prefix) + s.context_tokens + len(kv.layout.suffix_ids(Q))


def test_a_prompt_that_does_not_fit_is_refused_before_any_work(kv):
    request = Request.of(Q, TEXTS, strategy="reuse", max_new_tokens=10_000)
    chunks = ChunkSource(kv).chunks(request.chunks)
    with pytest.raises(Exception, match="token context"):
        pipeline_answer(kv, request, chunks, HFExecutor(kv))
    assert chunks.encoded == 0


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_likelihood_pickers_pass_over_the_winner_is_the_answers_prefill(name):
    kv = KVModel(tiny_model(name), byte_tokenizer())
    source = ChunkSource(kv, MemoryStore())
    calls = []
    forward = HFExecutor.prefill
    executor = kv.executor

    def counted(self, job, **kw):
        calls.append(job)
        return forward(self, job, **kw)

    picked = last_answer(
        pipeline.stream(kv, Request.of(Q, TEXTS, strategy="target_only", picker="likelihood", **GEN),
                        source.chunks(TEXTS), executor, started_at=time.perf_counter())
    )
    HFExecutor.prefill = counted
    try:
        again = last_answer(
            pipeline.stream(kv, Request.of(Q, TEXTS, strategy="target_only", picker="likelihood", **GEN),
                            source.chunks(TEXTS), executor, started_at=time.perf_counter())
        )
        assert calls == []  # no prefill of its own: the picker's pass was it
        given = last_answer(
            pipeline.stream(kv, Request.of(Q, TEXTS, strategy="target_only", target=picked.stats.target,
                                           picker="oracle", **GEN),
                            source.chunks(TEXTS), executor, started_at=time.perf_counter())
        )
        assert len(calls) == 1  # the same chunk picked another way: the executor's prefill
    finally:
        HFExecutor.prefill = forward
    assert again.token_ids == picked.token_ids == given.token_ids and given.stats.target == picked.stats.target
    one = [TEXTS[picked.stats.target]]
    alone = last_answer(pipeline.stream(kv, Request.of(Q, one, strategy="full_prefill", **GEN),
                                                 source.chunks(one), executor, started_at=time.perf_counter()))
    assert picked.token_ids == alone.token_ids  # exactly full prefill over the picked chunk
