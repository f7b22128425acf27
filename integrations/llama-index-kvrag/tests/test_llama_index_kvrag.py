"""The LlamaIndex adapter on a tiny model: a VectorStoreIndex retriever, streaming, async, ingestion."""

import asyncio

import pytest

from kvrag import KVRAG, IndexLoadError, InvalidRequestError, KVModel, MemoryStore
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.ingestion import IngestionCache, IngestionPipeline
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import ImageNode, NodeWithScore, QueryBundle, TextNode
from llama_index.query_engine.kvrag import KVRAGKVTransform, KVRAGLLM, KVRAGQueryEngine, KVRAGRetriever
from tiny import save_tiny

TEXTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
    "The old mill of Brenn grinds barley and rye for three villages.",
]
Q = "Who runs Velloria's harbour?"


@pytest.fixture(scope="module")
def rag(model_dir, embedder):
    return KVRAG(
        KVModel.from_pretrained(model_dir), embedder=embedder, store=MemoryStore(), chunk_tokens=120, overlap=8
    )


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


def test_ingestion_transform_fills_the_store_so_the_query_encodes_nothing(model_dir, embedder, embed_model):
    fresh = KVRAG(KVModel.from_pretrained(model_dir), embedder=embedder, store=MemoryStore())
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


def test_mixing_another_llm_and_non_text_nodes(rag, vector_index):
    with pytest.raises(InvalidRequestError, match="owns the KV cache"):
        KVRAGQueryEngine(rag, vector_index.as_retriever(), llm=MockLLM())
    engine = KVRAGQueryEngine(rag, vector_index.as_retriever(), llm=KVRAGLLM(rag.kvmodel))  # the cache's own model
    with pytest.raises(InvalidRequestError, match="ImageNode"):
        engine.synthesize(QueryBundle(Q), [NodeWithScore(node=ImageNode(image="aGk="), score=1.0)])


def test_one_model_serves_settings_llm_and_the_engine_and_reopens_its_index(model_dir, tmp_path, embed_model):
    """`Settings.llm = KVRAGLLM(kv)` and an engine built on `kv` share one copy of the weights: the query engine over
    a LlamaIndex index takes that LLM, and the engine's folder reopens on the same model (another is refused)."""
    kv = KVModel.from_pretrained(model_dir)
    llm = KVRAGLLM(kv, max_new_tokens=4)
    rag = KVRAG.from_defaults(tmp_path / "index", model=llm.kvmodel)
    assert rag.kvmodel is kv
    rag.ingest(TEXTS)
    nodes = [TextNode(text=t) for t in TEXTS]
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    response = KVRAGQueryEngine.from_index(index, rag, similarity_top_k=2, llm=llm).query(Q)
    assert response.metadata["kvrag"]["new_tokens"] == 4
    again = KVRAG.from_defaults(tmp_path / "index", model=kv)
    assert again.kvmodel is kv and len(again.index) == len(rag.index)
    other = KVModel.from_pretrained(save_tiny(tmp_path / "other", seed=1))
    with pytest.raises(IndexLoadError, match="built with another model"):
        KVRAG.from_defaults(tmp_path / "index", model=other)


def test_the_response_tells_the_nodes_read_from_those_only_retrieved_and_names_the_plan(rag, vector_index):
    retriever = vector_index.as_retriever(similarity_top_k=3)
    engine = KVRAGQueryEngine(rag, retriever, strategy="target_only", max_new_tokens=4)
    extra = NodeWithScore(node=TextNode(text="An extra node, listed only."), score=0.1)
    response = engine.synthesize(QueryBundle(Q), engine.retrieve(QueryBundle(Q)), additional_source_nodes=[extra])
    order = response.metadata["kvrag"]["order"]
    marks = [n.node.metadata.get("kvrag_read") for n in response.source_nodes]
    assert marks == [i in order for i in range(3)] + [None] and marks.count(True) == 1
    assert response.metadata["plan"] == "target_only" and response.metadata["abstained"] is False
    assert response.metadata["read"] == [response.metadata["sources"][i] for i in order]
    read_node = response.source_nodes[order[0]].node
    assert "kvrag_read" not in read_node.get_content(metadata_mode="llm")  # never shown to an LLM or embedder
    assert all("kvrag_read" not in n.node.metadata for n in retriever.retrieve(Q))  # the stored nodes untouched
    # the same nodes read and plan as the core API (and so the CLI) over the same chunks
    core = rag.answer(Q, [n.node.get_content() for n in response.source_nodes[:3]],
                      scores=[n.score for n in response.source_nodes[:3]], strategy="target_only", max_new_tokens=4)
    assert [s.read for s in core.sources] == marks[:3]
    streaming = KVRAGQueryEngine(rag, retriever, strategy="full_prefill", max_new_tokens=4, streaming=True).query(Q)
    assert "".join(streaming.response_gen) is not None
    assert [n.node.metadata["kvrag_read"] for n in streaming.source_nodes] == [True] * 3
    assert streaming.metadata["plan"] == "full_prefill" and len(streaming.metadata["read"]) == 3
