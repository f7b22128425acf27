"""The LlamaIndex adapter on a tiny model: a VectorStoreIndex retriever, streaming, async, ingestion, events."""

import asyncio

import pytest
from tiny import save_tiny

from kvrag import KVRAG, InvalidRequestError
from kvrag.embed import Embedder
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.ingestion import IngestionCache, IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import ImageNode, NodeWithScore, QueryBundle
from llama_index.query_engine.kvrag import (
    KVRAGAnswerEvent,
    KVRAGEmbedding,
    KVRAGKVTransform,
    KVRAGLLM,
    KVRAGQueryEngine,
    KVRAGRetriever,
)
from llama_index.query_engine.kvrag.query_engine import NO_CONTEXT

TEXTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
    "The old mill of Brenn grinds barley and rye for three villages.",
]
Q = "Who runs Velloria's harbour?"


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    root = tmp_path_factory.mktemp("li")
    save_tiny(root / "model")
    return KVRAG.from_defaults(None, model=str(root / "model"), chunk_tokens=120, overlap=8, cache_dir=root / "cache")


@pytest.fixture(scope="module")
def embed_model():
    return KVRAGEmbedding(Embedder())


@pytest.fixture(scope="module")
def vector_index(embed_model):
    return VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS], embed_model=embed_model)


def test_query_over_a_vector_store_index_retriever(rag, vector_index):
    engine = KVRAGQueryEngine(rag, vector_index.as_retriever(similarity_top_k=3), max_new_tokens=6)
    first = engine.query(Q)
    assert isinstance(first, Response) and len(first.source_nodes) == 3
    assert first.source_nodes[0].node.get_content().startswith("Velloria") and first.source_nodes[0].score > 0
    stats = first.metadata["kvrag"]
    assert stats["strategy"] == "target_recompute" and stats["order"][-1] == stats["target"] == 0
    again = engine.query(Q).metadata["kvrag"]
    assert again["chunks_encoded"] == 0 and again["store_hits"] == 3  # encoded on the first miss, then stored
    # the same answer as the core API over the same chunks, scores and strategy
    nodes = engine.retrieve(QueryBundle(Q))
    core = rag.answer(Q, [n.node.get_content() for n in nodes], scores=[n.score for n in nodes], max_new_tokens=6)
    assert first.response == core.text


def test_same_answer_as_the_core_query_with_kvrag_retrieval(rag):
    rag.ingest(TEXTS, progress=False)
    engine = KVRAGQueryEngine(rag, KVRAGRetriever(rag, similarity_top_k=3), max_new_tokens=6)
    assert engine.query(Q).response == rag.query(Q, top_k=3, max_new_tokens=6).text


def test_streaming_and_async(rag, vector_index):
    retriever = vector_index.as_retriever(similarity_top_k=2)
    plain = KVRAGQueryEngine(rag, retriever, max_new_tokens=8).query(Q)
    streaming = KVRAGQueryEngine(rag, retriever, streaming=True, max_new_tokens=8).query(Q)
    assert isinstance(streaming, StreamingResponse) and streaming.metadata == {}
    assert "".join(streaming.response_gen) == plain.response and streaming.metadata["kvrag"]["new_tokens"] == 8

    async def run():
        a = await KVRAGQueryEngine(rag, retriever, max_new_tokens=8).aquery(Q)
        s = await KVRAGQueryEngine(rag, retriever, streaming=True, max_new_tokens=8).aquery(Q)
        assert isinstance(s, AsyncStreamingResponse)
        return a.response, "".join([p async for p in s.response_gen])

    assert asyncio.run(run()) == (plain.response, plain.response)


def test_ingestion_transform_fills_the_store_so_the_query_encodes_nothing(tmp_path, embed_model):
    root = tmp_path
    save_tiny(root / "model")
    fresh = KVRAG.from_defaults(None, model=str(root / "model"), cache_dir=root / "cache")
    transform = KVRAGKVTransform(fresh)
    assert transform.to_dict() == KVRAGKVTransform(fresh).to_dict()  # deterministic: the pipeline cache keys on it
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0), transform, embed_model],
        cache=IngestionCache(),
    )
    nodes = pipeline.run(documents=[Document(text=t) for t in TEXTS])
    assert len(fresh.store) == len(nodes) == 4
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    response = KVRAGQueryEngine(fresh, index.as_retriever(similarity_top_k=3), max_new_tokens=4).query(Q)
    assert response.metadata["kvrag"]["chunks_encoded"] == 0 and response.metadata["kvrag"]["store_hits"] == 3


def test_events_reach_llama_index_instrumentation(rag, vector_index):
    seen = []

    class Recorder(BaseEventHandler):
        @classmethod
        def class_name(cls):
            return "Recorder"

        def handle(self, event, **kwargs):
            seen.append(event)

    root = get_dispatcher()
    handler = Recorder()
    root.add_event_handler(handler)
    try:
        KVRAGQueryEngine(rag, vector_index.as_retriever(similarity_top_k=2), max_new_tokens=3).query(Q)
    finally:
        root.event_handlers.remove(handler)
    names = [e.class_name() for e in seen]
    assert "QueryStartEvent" in names and "QueryEndEvent" in names
    kvrag_events = [e for e in seen if isinstance(e, KVRAGAnswerEvent)]
    assert len(kvrag_events) == 1 and kvrag_events[0].stats["new_tokens"] == 3


def test_mixing_another_llm_empty_retrieval_and_non_text_nodes(rag):
    with pytest.raises(InvalidRequestError, match="owns the KV cache"):
        KVRAGQueryEngine(rag, llm=MockLLM())
    KVRAGQueryEngine(rag, llm=KVRAGLLM(rag.kvmodel))  # the model that owns the cache is fine
    engine = KVRAGQueryEngine(rag)
    assert engine.synthesize(QueryBundle(Q), []).response == NO_CONTEXT
    with pytest.raises(InvalidRequestError, match="ImageNode"):
        engine.synthesize(QueryBundle(Q), [NodeWithScore(node=ImageNode(image="aGk="), score=1.0)])


def test_kvrag_as_settings_llm(rag):
    llm = KVRAGLLM(rag.kvmodel, max_new_tokens=5)
    Settings.llm = llm
    try:
        done = Settings.llm.complete("Say hi.")
        streamed = list(Settings.llm.stream_complete("Say hi."))
        assert done.text == streamed[-1].text and done.raw["new_tokens"] == 5
        chat = Settings.llm.chat(
            [__import__("llama_index.core.llms", fromlist=["ChatMessage"]).ChatMessage(role="user", content="Say hi.")]
        )
        assert chat.message.content
    finally:
        Settings.llm = MockLLM()
