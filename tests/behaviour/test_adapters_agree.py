"""Same question, same strategy (or none: the same default): the core API, the LlamaIndex engine and the LangChain
runnable agree, and both adapters answer an empty retrieval alike."""

import pytest
from tiny import save_tiny

from kvrag import KVRAG

FACTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
    "The old mill of Brenn grinds barley and rye for three villages.",
]


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    save_tiny(root / "model")
    engine = KVRAG.from_defaults(None, model=str(root / "model"), chunk_tokens=120, overlap=8, cache_dir=root / "c")
    engine.ingest(FACTS, progress=False)
    return engine


@pytest.mark.parametrize("strategy", [None, "target_recompute", "reuse", "full_prefill", "token_select"])
def test_core_llama_index_and_langchain_give_the_same_text(rag, strategy):
    from langchain_kvrag import KVRAGRunnable
    from llama_index.query_engine.kvrag import KVRAGQueryEngine, KVRAGRetriever

    question = "Who runs Velloria's harbour?"
    options = dict(strategy=strategy, budget=0.2, max_new_tokens=8)
    core = rag.query(question, top_k=3, **options).text
    llama = KVRAGQueryEngine(rag, KVRAGRetriever(rag, similarity_top_k=3), **options).query(question).response
    chain = KVRAGRunnable(engine=rag, strategy=strategy, budget=0.2, top_k=3, max_new_tokens=8).invoke(question)
    assert core == llama == chain and len(core) > 0


def test_nothing_retrieved_is_the_same_no_context_answer_in_both_adapters(rag):
    from langchain_kvrag import KVRAGRunnable
    from llama_index.query_engine.kvrag import KVRAGQueryEngine, KVRAGRetriever

    from kvrag import NO_CONTEXT

    question, none = "Who runs Velloria's harbour?", {"topic": "none"}
    llama = KVRAGQueryEngine(rag, KVRAGRetriever(rag, filters=none)).query(question)
    chain = KVRAGRunnable(engine=rag, filters=none, return_dict=True).invoke(question)
    assert llama.response == chain["answer"] == NO_CONTEXT
    untimed = [
        {k: v for k, v in stats.items() if not k.endswith("_s")} for stats in (llama.metadata["kvrag"], chain["stats"])
    ]
    assert untimed[0] == untimed[1] and untimed[0]["new_tokens"] == 0 and chain["finish_reason"] == "no_context"
