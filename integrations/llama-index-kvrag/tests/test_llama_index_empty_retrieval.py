"""Nothing retrieved: `kvrag.NO_CONTEXT` without generation, in the response type of each call and streaming mode."""

import asyncio

import pytest
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.schema import QueryBundle
from llama_index.query_engine.kvrag import KVRAGQueryEngine, KVRAGRetriever
from tiny import FACTS

from kvrag import KVRAG, NO_CONTEXT, Answer, KVModel, MemoryStore

Q = "Who runs Velloria's harbour?"
NO_CONTEXT_STATS = Answer.no_context().stats.to_dict()


@pytest.fixture(scope="module")
def rag(model_dir, embedder):
    engine = KVRAG(KVModel.from_pretrained(model_dir), embedder=embedder, store=MemoryStore())
    engine.ingest(FACTS, progress=False)
    return engine


def engine_over_nothing(rag, streaming):
    debug = LlamaDebugHandler(print_trace_on_end=False)
    retriever = KVRAGRetriever(rag, filters={"topic": "no such topic"})  # filters that match no chunk
    return KVRAGQueryEngine(rag, retriever, streaming=streaming, callback_manager=CallbackManager([debug])), debug


def test_query(rag):
    engine, debug = engine_over_nothing(rag, streaming=False)
    response = engine.query(Q)
    assert type(response) is Response and response.response == NO_CONTEXT and response.source_nodes == []
    assert response.metadata["kvrag"] == NO_CONTEXT_STATS
    assert debug.get_events(CBEventType.LLM) == []  # no generation
    assert engine.synthesize(QueryBundle(Q), []).response == NO_CONTEXT


def test_streaming_query(rag, capsys):
    engine, debug = engine_over_nothing(rag, streaming=True)
    response = engine.query(Q)
    assert isinstance(response, StreamingResponse) and response.metadata["kvrag"] == NO_CONTEXT_STATS
    response.print_response_stream()
    assert capsys.readouterr().out.strip() == NO_CONTEXT
    assert list(engine.query(Q).response_gen) == [NO_CONTEXT]
    assert debug.get_events(CBEventType.LLM) == []


def test_async_query(rag):
    engine, _ = engine_over_nothing(rag, streaming=False)
    response = asyncio.run(engine.aquery(Q))
    assert type(response) is Response and response.response == NO_CONTEXT
    assert response.metadata["kvrag"] == NO_CONTEXT_STATS


def test_async_streaming_query(rag):
    engine, debug = engine_over_nothing(rag, streaming=True)

    async def run():
        response = await engine.aquery(Q)
        assert isinstance(response, AsyncStreamingResponse) and response.metadata["kvrag"] == NO_CONTEXT_STATS
        return [piece async for piece in response.async_response_gen()]

    assert asyncio.run(run()) == [NO_CONTEXT]
    assert debug.get_events(CBEventType.LLM) == []
