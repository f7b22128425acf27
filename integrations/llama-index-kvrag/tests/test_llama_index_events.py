"""KVRAGQueryEngine reports through LlamaIndex's own callbacks and instrumentation what the stock
RetrieverQueryEngine, its synthesizer and its LLM report: query, retrieve, synthesize, templating and the LLM call
with its prompt and response, in every call and streaming mode."""

import asyncio
import itertools

import pytest
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload, LlamaDebugHandler
from llama_index.query_engine.kvrag import KVRAGAnswerEvent, KVRAGQueryEngine

from kvrag import KVRAG, KVModel, MemoryStore

TEXTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
]
Q = "Who runs Velloria's harbour?"
MODES = [("sync", False), ("sync", True), ("async", False), ("async", True)]


@pytest.fixture(scope="module")
def rag(model_dir, embedder):
    engine = KVRAG(KVModel.from_pretrained(model_dir), embedder=embedder, store=MemoryStore())
    engine.ingest(TEXTS, progress=False)
    return engine


def ask(engine, call, streaming, before_reading=lambda: None):
    """The response and its text, read to the end (`before_reading` runs between the call and the reading)."""
    if call == "sync":
        response = engine.query(Q)
        before_reading()
        return response, "".join(response.response_gen) if streaming else response.response

    async def run():
        response = await engine.aquery(Q)
        before_reading()
        return response, "".join([p async for p in response.async_response_gen()]) if streaming else response.response

    return asyncio.run(run())


@pytest.mark.parametrize("call, streaming", MODES)
def test_callbacks_carry_query_retrieve_synthesize_templating_and_llm(rag, call, streaming):
    debug = LlamaDebugHandler()
    engine = KVRAGQueryEngine(
        rag, similarity_top_k=2, streaming=streaming, callback_manager=CallbackManager([debug]), max_new_tokens=5
    )
    llm_events_before_reading = []
    response, text = ask(
        engine, call, streaming, lambda: llm_events_before_reading.extend(debug.get_llm_inputs_outputs())
    )
    starts = [e.event_type for e in debug.get_events() if e.id_ and e.time and e.payload is not None]
    first_seen = list(dict.fromkeys(starts))
    assert first_seen[:5] == [
        CBEventType.QUERY,
        CBEventType.RETRIEVE,
        CBEventType.SYNTHESIZE,
        CBEventType.TEMPLATING,
        CBEventType.LLM,
    ]
    [(start, end)] = debug.get_llm_inputs_outputs()
    prompt = start.payload[EventPayload.PROMPT]
    assert Q in prompt and all(n.node.get_content() in prompt for n in response.source_nodes)
    assert start.payload[EventPayload.ADDITIONAL_KWARGS]["max_new_tokens"] == 5
    completion = end.payload[EventPayload.COMPLETION]
    assert (
        completion.text == text
        and completion.additional_kwargs["completion_tokens"] == response.metadata["kvrag"]["new_tokens"]
    )
    # a stream's LLM event ends when the stream is read to its end, as a stock streaming LLM's does
    assert [len(pair) for pair in llm_events_before_reading] == ([1] if streaming else [2])
    [templating] = [e for e in debug.get_events(CBEventType.TEMPLATING) if EventPayload.TEMPLATE in (e.payload or {})]
    assert "{context}" in templating.payload[EventPayload.TEMPLATE]
    assert templating.payload[EventPayload.TEMPLATE_VARS]["question"] == Q


@pytest.mark.parametrize("call, streaming", MODES)
def test_instrumentation_events_of_a_stock_query(rag, events, call, streaming):
    engine = KVRAGQueryEngine(rag, similarity_top_k=2, streaming=streaming, max_new_tokens=5)
    response, text = ask(engine, call, streaming)
    ours = {
        "QueryStartEvent",
        "QueryEndEvent",
        "RetrievalStartEvent",
        "RetrievalEndEvent",
        "SynthesizeStartEvent",
        "SynthesizeEndEvent",
        "LLMCompletionStartEvent",
        "LLMCompletionInProgressEvent",
        "LLMCompletionEndEvent",
        "KVRAGAnswerEvent",
    }
    names = [k for k, _ in itertools.groupby(e.class_name() for e in events if e.class_name() in ours)]
    head = ["QueryStartEvent", "RetrievalStartEvent", "RetrievalEndEvent", "SynthesizeStartEvent"]
    if streaming:  # synthesis and the query return the stream; the model's events come as it is read
        tail = ["LLMCompletionStartEvent", "SynthesizeEndEvent", "QueryEndEvent", "LLMCompletionInProgressEvent"]
        tail += ["KVRAGAnswerEvent", "LLMCompletionEndEvent"]
    else:
        tail = ["LLMCompletionStartEvent", "LLMCompletionEndEvent", "KVRAGAnswerEvent", "SynthesizeEndEvent"]
        tail += ["QueryEndEvent"]
    assert names == head + tail
    [start] = [e for e in events if e.class_name() == "LLMCompletionStartEvent"]
    [end] = [e for e in events if e.class_name() == "LLMCompletionEndEvent"]
    assert Q in start.prompt and start.model_dict["class_name"] == "KVRAGLLM" and start.span_id
    assert end.response.text == text and end.response.raw["stats"] == response.metadata["kvrag"]
    progress = [e for e in events if e.class_name() == "LLMCompletionInProgressEvent"]
    if streaming:
        assert "".join(e.response.delta for e in progress) == text and progress[-1].response.text == text
    else:
        assert progress == []
    [answer] = [e for e in events if isinstance(e, KVRAGAnswerEvent)]
    assert answer.stats == response.metadata["kvrag"] and answer.stats["new_tokens"] >= 1
