"""Bad input through the LlamaIndex adapter: a clear kvrag error (type and key phrase) or a correct answer."""

import math

import pytest
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.query_engine.kvrag import KVRAGKVTransform, KVRAGQueryEngine, KVRAGRetriever
from tiny import FACTS, HashEmbedder, save_tiny

from kvrag import KVRAG, ContextOverflowError, EmptyInputError, InvalidRequestError

Q = "Who runs Velloria's harbour?"
BIG = "The tide turned and the ships came in. " * 130_000  # ~5 MB


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    root = tmp_path_factory.mktemp("li-bad")
    save_tiny(root / "model")
    engine = KVRAG.from_defaults(None, model=str(root / "model"), chunk_tokens=120, overlap=8, cache_dir=root / "c")
    engine.embedder = HashEmbedder()
    engine.index.dim = HashEmbedder.DIM
    import faiss

    engine.index.vectors = faiss.IndexIDMap2(faiss.IndexFlatIP(HashEmbedder.DIM))
    engine.ingest(FACTS, progress=False)
    return engine


def nodes(*texts):
    return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in texts]


@pytest.mark.parametrize(
    "question, texts, error, phrase",
    [
        ("", None, EmptyInputError, "question is empty"),
        ("   ", None, EmptyInputError, "question is empty"),
        (Q, ["  \n "], InvalidRequestError, "has no text"),
        ("Who runs \udcff?", None, InvalidRequestError, "not valid Unicode"),
        (Q, ["caf\udce9"], InvalidRequestError, "not valid Unicode"),
        (Q, [BIG], ContextOverflowError, "split it"),
        ("Why " * 200 + "?", [FACTS[0][0]], ContextOverflowError, "context"),
    ],
)
def test_query_engine_bad_input(rag, question, texts, error, phrase):
    engine = KVRAGQueryEngine(rag, max_new_tokens=2)
    with pytest.raises(error, match=phrase):
        if texts is None:
            engine.query(question)
        else:
            engine.synthesize(QueryBundle(question), nodes(*texts))


@pytest.mark.parametrize("top_k", [0, -3, 10**9])
def test_retriever_absurd_top_k(rag, top_k):
    with pytest.raises(InvalidRequestError, match="top_k must be"):
        KVRAGQueryEngine(rag, KVRAGRetriever(rag, similarity_top_k=top_k)).query(Q)


@pytest.mark.parametrize("budget", [0, 1.5, math.nan, -1])
def test_absurd_budget(rag, budget):
    with pytest.raises(InvalidRequestError, match="budget must be"):
        KVRAGQueryEngine(rag, budget=budget, max_new_tokens=2).query(Q)


def test_ingestion_transform_bad_nodes(rag):
    transform = KVRAGKVTransform(rag)
    blank = [TextNode(text="   ")]
    assert transform(blank) == blank  # nothing to encode: passed through
    with pytest.raises(ContextOverflowError, match="split it"):
        transform([TextNode(text=BIG)])
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        transform([TextNode(text="caf\udce9")])


def test_a_huge_top_k_within_the_limit_answers_over_every_chunk(rag):
    response = KVRAGQueryEngine(rag, KVRAGRetriever(rag, similarity_top_k=10_000), max_new_tokens=2).query(Q)
    assert len(response.source_nodes) == len(rag.index) and response.metadata["kvrag"]["chunks_encoded"] == 0


def test_a_langchain_document_is_named_by_its_full_class_and_what_to_pass_is_said(rag):
    from langchain_core.documents import Document

    engine = KVRAGQueryEngine(rag, KVRAGRetriever(rag), max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"langchain_core\.documents\.base\.Document: KVRAGQueryEngine"):
        engine.synthesize(QueryBundle(Q), [Document(page_content="Orin Dask runs the harbour.")])


def test_the_prompt_is_shown_and_only_its_question_part_may_change(rag):
    from llama_index.core.prompts import PromptTemplate

    engine = KVRAGQueryEngine(rag, KVRAGRetriever(rag), max_new_tokens=2)
    layout = rag.kvmodel.layout
    original = layout.question_template
    template = engine.get_prompts()["text_qa_template"].get_template()
    assert template.startswith(layout.header + "{context_str}") and "{query_str}" in template
    try:
        engine.update_prompts({"text_qa_template": PromptTemplate(layout.header + "{context_str}Q: {query_str}\nA:")})
        assert layout.question_template == "Q: {question}\nA:"
        assert engine.query(Q).response is not None
        with pytest.raises(InvalidRequestError, match="part of every stored chunk's prefix"):
            engine.update_prompts({"text_qa_template": PromptTemplate("Context:\n{context_str}\n{query_str}")})
        with pytest.raises(InvalidRequestError, match="needs {context_str} once"):
            engine.update_prompts({"text_qa_template": PromptTemplate("{query_str} {context_str}")})
    finally:
        layout.question_template = original
