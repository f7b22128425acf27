"""KVRAGRetriever: langchain-tests' standard retriever suite, and what its Documents carry."""

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from langchain_tests.integration_tests import RetrieversIntegrationTests

from kvrag import InvalidRequestError
from langchain_kvrag import KVRAGRetriever


class TestKVRAGRetrieverStandard(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _engine(self, rag):
        self.engine = rag  # the properties below are read by the standard tests, which take no fixtures

    @property
    def retriever_constructor(self) -> type[KVRAGRetriever]:
        return KVRAGRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"engine": self.engine}

    @property
    def retriever_query_example(self) -> str:
        return "Who built the lighthouse of Karsa?"


def test_documents_carry_the_chunk_text_metadata_id_and_score(rag):
    docs = KVRAGRetriever(engine=rag, k=3).invoke("Who runs Velloria's harbour?")
    sources = rag.retrieve("Who runs Velloria's harbour?", top_k=3)
    assert [d.page_content for d in docs] == [s.text for s in sources]
    assert [d.id for d in docs] == [d.metadata["id"] for d in docs] == [s.id for s in sources]
    assert [d.metadata["score"] for d in docs] == [s.score for s in sources]
    assert docs[0].page_content.startswith("Velloria") and docs[0].metadata["topic"] == "ports"
    assert docs[0].metadata["score"] >= docs[1].metadata["score"] >= docs[2].metadata["score"]


def test_filters_and_hybrid_as_fields_and_per_call(rag, facts):
    buildings = KVRAGRetriever(engine=rag, k=5, filters={"topic": "buildings", "lang": "en"})
    assert len(buildings.invoke("Who built it?")) == 2
    assert KVRAGRetriever(engine=rag, k=5).invoke("Who built it?", filters={"topic": ["ports", "rivers"]})[0].metadata[
        "topic"
    ] in {"ports", "rivers"}
    assert KVRAGRetriever(engine=rag, filters={"topic": "none"}).invoke("anything") == []
    hybrid = KVRAGRetriever(engine=rag, k=2, bm25=True).invoke("When does the river Tam flood?")
    assert hybrid[0].page_content == facts[2][0]
    with pytest.raises(InvalidRequestError, match="top_k"):
        KVRAGRetriever(engine=rag, k=0).invoke("anything")


async def test_async_matches_sync(rag):
    retriever = KVRAGRetriever(engine=rag, k=2)
    question = "What does the mill grind?"
    assert await retriever.ainvoke(question, k=1) == retriever.invoke(question, k=1)
    assert len(await retriever.abatch(["mill", "river"])) == 2


def test_composes_with_a_lambda_and_reports_callbacks(rag):
    events = []

    class Recorder(BaseCallbackHandler):
        def on_retriever_start(self, serialized, query, **kwargs):
            events.append(("start", query))

        def on_retriever_end(self, documents, **kwargs):
            events.append(("end", len(documents)))

    chain = KVRAGRetriever(engine=rag, k=2) | RunnableLambda(lambda docs: [d.metadata["id"] for d in docs])
    ids = chain.invoke("Who built the lighthouse?", config={"callbacks": [Recorder()]})
    assert len(ids) == 2 and all("#" in i for i in ids)
    assert events == [("start", "Who built the lighthouse?"), ("end", 2)]
    assert all(isinstance(d, Document) for d in KVRAGRetriever(engine=rag).batch(["a tower", "a river"])[0])


def test_a_vector_store_retrievers_vocabulary_is_understood(rag):
    question = "Who built it?"
    expected = KVRAGRetriever(engine=rag, k=2, filters={"topic": "buildings"}).invoke(question)
    assert len(expected) == 2
    styled = KVRAGRetriever(engine=rag, search_kwargs={"k": 2, "filter": {"topic": "buildings"}})
    assert styled.invoke(question) == expected
    assert KVRAGRetriever(engine=rag).invoke(question, k=2, filter={"topic": "buildings"}) == expected


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"filters": "x"}, "filters is a str"),
        ({"filters": {"topic": {"$eq": "ports"}}}, "filter 'topic' wants"),
        ({"search_kwargs": {"k": 2, "score_threshold": 0.5}}, "unknown search argument.*score_threshold"),
        ({"search_kwargs": {"k": 2}, "k": 3}, "k is given twice"),
        ({"similarity_top_k": 3}, "unknown argument.*similarity_top_k"),
        ({"k": "3"}, "top_k must be"),
    ],
)
def test_bad_arguments_fail_when_the_retriever_is_built(rag, kwargs, phrase):
    with pytest.raises(InvalidRequestError, match=phrase):
        KVRAGRetriever(engine=rag, **kwargs)


def test_a_call_with_an_argument_it_does_not_take_is_refused(rag):
    with pytest.raises(InvalidRequestError, match="unknown search argument.*fetch_k"):
        KVRAGRetriever(engine=rag).invoke("anything", fetch_k=20)
    with pytest.raises(InvalidRequestError, match="both filter and filters"):
        KVRAGRetriever(engine=rag).invoke("anything", filter={}, filters={})


def test_whole_runs_reaches_the_engine_and_a_chunk_given_for_its_run_says_so(rag, monkeypatch):
    from kvrag import Source

    asked = []

    def retrieve(question, **kwargs):
        asked.append(kwargs["whole_runs"])
        return [Source("d#0", "a", 0.9), Source("d#1", "b", 0.5, retrieved=False)]

    monkeypatch.setattr(rag, "retrieve", retrieve)
    docs = KVRAGRetriever(engine=rag, whole_runs=True).invoke("q?")
    assert asked == [True] and "retrieved" not in docs[0].metadata and docs[1].metadata["retrieved"] is False
    KVRAGRetriever(engine=rag).invoke("q?")
    assert asked == [True, None]  # None: kvrag's default
