"""KVRAGQueryEngine's and KVRAGRetriever's arguments: accepted and applied, or refused where the object is built
with a kvrag error that says what is accepted."""

import asyncio

import pytest
from llama_index.core.llms import MockLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.vector_stores.types import (
    ExactMatchFilter,
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)
from llama_index.llms.kvrag import KVRAGLLM
from llama_index.query_engine.kvrag import KVRAGQueryEngine
from llama_index.retrievers.kvrag import KVRAGRetriever
from tiny import FACTS

from kvrag import KVRAG, InvalidRequestError, KVModel, MemoryStore

Q = "Who runs Velloria's harbour?"


@pytest.fixture(scope="module")
def rag(model_dir, embedder):
    engine = KVRAG(KVModel.from_pretrained(model_dir), embedder=embedder, store=MemoryStore())
    engine.ingest(FACTS, progress=False)
    return engine


class KeepLast(BaseNodePostprocessor):
    """Keeps only the lowest-ranked node (so that applying it is visible in the answer)."""

    @classmethod
    def class_name(cls) -> str:
        return "KeepLast"

    def _postprocess_nodes(self, nodes, query_bundle=None):
        return nodes[-1:]


def test_similarity_top_k_configures_kvrags_own_retriever(rag):
    response = KVRAGQueryEngine(rag, similarity_top_k=3, max_new_tokens=4).query(Q)
    assert len(response.source_nodes) == 3
    assert response.response == rag.query(Q, top_k=3, max_new_tokens=4).text


def test_node_postprocessors_are_applied_before_the_answer(rag):
    engine = KVRAGQueryEngine(rag, similarity_top_k=3, node_postprocessors=[KeepLast()], max_new_tokens=4)
    third = rag.retrieve(Q, top_k=3)[-1]
    response = engine.query(Q)
    assert [n.node.node_id for n in response.source_nodes] == [third.id]
    assert response.response == rag.answer(Q, [third.text], scores=[third.score], max_new_tokens=4).text
    assert [n.node.node_id for n in asyncio.run(engine.aquery(Q)).source_nodes] == [third.id]


def test_a_kvrag_llm_gives_the_decoding_defaults(rag):
    engine = KVRAGQueryEngine(rag, similarity_top_k=2, llm=KVRAGLLM(rag.kvmodel, max_new_tokens=3))
    assert engine.query(Q).metadata["kvrag"]["new_tokens"] == 3
    engine = KVRAGQueryEngine(rag, similarity_top_k=2, llm=KVRAGLLM(rag.kvmodel, max_new_tokens=3), max_new_tokens=2)
    assert engine.query(Q).metadata["kvrag"]["new_tokens"] == 2  # an explicit argument wins


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda rag: KVRAGQueryEngine(rag, KVRAGRetriever(rag), similarity_top_k=3), "similarity_top_k configures"),
        (
            lambda rag: KVRAGQueryEngine(KVRAGRetriever(rag), rag),
            r"engine first.*KVRAGQueryEngine\(engine, retriever\)",
        ),
        (lambda rag: KVRAGQueryEngine(rag.kvmodel), "got a KVModel: pass a kvrag.KVRAG"),
        (lambda rag: KVRAGQueryEngine(rag, "the index"), "retriever is a str"),
        (lambda rag: KVRAGQueryEngine(rag, top_k=3), "unknown argument.*top_k.*it takes retriever, similarity_top_k"),
        (lambda rag: KVRAGQueryEngine(rag, strategy="fastest"), "unknown strategy 'fastest': use one of"),
        (lambda rag: KVRAGQueryEngine(rag, picker="oracle?"), "picker"),
        (lambda rag: KVRAGQueryEngine(rag, budget=1.5), "budget must be"),
        (lambda rag: KVRAGQueryEngine(rag, max_new_tokens=0), "max_new_tokens must be at least 1"),
        (lambda rag: KVRAGQueryEngine(rag, temperature="hot"), "temperature must be a number"),
        (lambda rag: KVRAGQueryEngine(rag, node_postprocessors=[len]), "node_postprocessors holds a builtin"),
        (lambda rag: KVRAGQueryEngine(rag, llm=MockLLM()), "owns the KV cache"),
        (lambda rag: KVRAGQueryEngine(rag, similarity_top_k=0), "top_k must be an int in 1..10000"),
        (lambda rag: KVRAGRetriever(rag.kvmodel), "got a KVModel"),
        (lambda rag: KVRAGRetriever(rag, similarity_top_k=True), "top_k must be an int"),
    ],
)
def test_bad_arguments_fail_where_the_object_is_built(rag, make, phrase):
    with pytest.raises(InvalidRequestError, match=phrase):
        make(rag)


def topics(retriever, question="Which building?"):
    return [(n.node.metadata["topic"], n.node.metadata["lang"]) for n in retriever.retrieve(question)]


def test_retriever_takes_llama_index_metadata_filters(rag):
    exact = KVRAGRetriever(
        rag, similarity_top_k=5, filters=MetadataFilters(filters=[ExactMatchFilter(key="topic", value="buildings")])
    )
    assert topics(exact) and all(t == "buildings" for t, _ in topics(exact))
    as_dict = KVRAGRetriever(rag, similarity_top_k=5, filters={"topic": "buildings"})
    assert topics(exact) == topics(as_dict) and len(topics(exact)) == 3
    both = MetadataFilters(
        filters=[
            MetadataFilter(key="topic", value="buildings"),
            MetadataFilter(key="lang", value=["fr", "de"], operator=FilterOperator.IN),
        ],
        condition=FilterCondition.AND,
    )
    assert topics(KVRAGRetriever(rag, similarity_top_k=5, filters=both)) == [("buildings", "fr")]


@pytest.mark.parametrize(
    "filters, phrase",
    [
        (
            MetadataFilters(
                filters=[MetadataFilter(key="topic", value="ports"), MetadataFilter(key="lang", value="fr")],
                condition=FilterCondition.OR,
            ),
            "joined by FilterCondition.OR",
        ),
        (
            MetadataFilters(filters=[MetadataFilter(key="year", value=1900, operator=FilterOperator.GT)]),
            "'year' > 1900",
        ),
        (MetadataFilters(filters=[MetadataFilters(filters=[ExactMatchFilter(key="lang", value="en")])]), "nest"),
        (MetadataFilters(filters=[ExactMatchFilter(key="lang", value="en")], condition=FilterCondition.NOT), "NOT"),
        (
            MetadataFilters(
                filters=[ExactMatchFilter(key="lang", value="en"), ExactMatchFilter(key="lang", value="fr")]
            ),
            "filtered twice",
        ),
        ([("lang", "en")], "filters is a list"),
    ],
)
def test_retriever_refuses_filters_kvrag_cannot_apply(rag, filters, phrase):
    with pytest.raises(InvalidRequestError, match=phrase) as err:
        KVRAGRetriever(rag, filters=filters)
    assert "FilterOperator.EQ and FilterOperator.IN" in str(err.value)  # what is supported


def test_whole_runs_reaches_the_engine_and_a_node_given_for_its_run_says_so(rag, monkeypatch):
    from kvrag import Source

    asked = []

    def retrieve(question, **kwargs):
        asked.append(kwargs["whole_runs"])
        return [Source("d#0", "a", 0.9), Source("d#1", "b", 0.5, retrieved=False)]

    monkeypatch.setattr(rag, "retrieve", retrieve)
    nodes = KVRAGRetriever(rag, whole_runs=True).retrieve("q?")
    assert asked == [True] and "retrieved" not in nodes[0].node.metadata
    assert nodes[1].node.metadata["retrieved"] is False and nodes[1].score == 0.5
    KVRAGRetriever(rag).retrieve("q?")
    assert asked == [True, None]  # None: kvrag's default
