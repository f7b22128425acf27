"""LlamaIndex's SubQuestionQueryEngine with kvrag's splitter as its question generator and kvrag's query engine as
its tool: offline, no JSON from a model, every sub-question over the one store of chunk KV."""

import pytest
from llama_index.core import QueryBundle
from llama_index.core.query_engine import SubQuestionQueryEngine
from llama_index.core.tools import QueryEngineTool, ToolMetadata
from llama_index.llms.kvrag import KVRAGLLM
from llama_index.query_engine.kvrag import KVRAGQueryEngine
from llama_index.question_gen.kvrag import KVRAGQuestionGenerator

from kvrag import KVRAG, InvalidRequestError
from kvrag.cache.store import MemoryStore
from kvrag.engine.documents import Document
from kvrag.model.kvmodel import KVModel

FACTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
    "The old mill of Brenn grinds barley and rye for three villages.",
]


def tools(*names):
    return [ToolMetadata(name=n, description=f"{n} facts") for n in names]


def test_the_generator_splits_in_code_and_routes_to_one_tool():
    gen = KVRAGQuestionGenerator()
    got = gen.generate(tools("facts"), QueryBundle("Who built the lighthouse of Karsa, and who runs the harbour?"))
    assert [(s.sub_question, s.tool_name) for s in got] == [
        ("Who built the lighthouse of Karsa?", "facts"), ("Who runs the harbour?", "facts")]
    whole = "What floods every spring?"  # nothing to split: the question itself
    assert [s.sub_question for s in gen.generate(tools("facts"), QueryBundle(whole))] == [whole]
    bridge = "What is the birth year of the founder of Velloria?"  # a hop: SubQuestionQueryEngine cannot feed it
    assert [s.sub_question for s in gen.generate(tools("facts"), QueryBundle(bridge))] == [bridge]
    assert gen.get_prompts() == {}
    with pytest.raises(InvalidRequestError, match="has 2 tools"):
        gen.generate(tools("a", "b"), QueryBundle(whole))
    assert KVRAGQuestionGenerator("b").generate(tools("a", "b"), QueryBundle(whole))[0].tool_name == "b"
    with pytest.raises(InvalidRequestError, match="not one of the engine's tools"):
        KVRAGQuestionGenerator("c").generate(tools("a", "b"), QueryBundle(whole))


@pytest.mark.slow
def test_sub_question_engine_over_kvrag_reads_every_chunk_kv_from_the_one_store(embedder):
    kv = KVModel.from_pretrained()  # the embedded model: LlamaIndex's refine prompt outgrows a tiny one's positions
    rag = KVRAG(kv, embedder=embedder, store=MemoryStore())
    rag.ingest([Document(t) for t in FACTS], split=False, progress=False)
    tool = QueryEngineTool(
        query_engine=KVRAGQueryEngine(rag, similarity_top_k=2, max_new_tokens=16),
        metadata=ToolMetadata(name="facts", description="facts about Karsa and Velloria"),
    )
    engine = SubQuestionQueryEngine.from_defaults(
        query_engine_tools=[tool], question_gen=KVRAGQuestionGenerator(), llm=KVRAGLLM(kv, max_new_tokens=24),
        use_async=False,
    )
    before = rag.info()
    response = engine.query("Who built the lighthouse of Karsa, and who runs Velloria's harbour?")
    nodes = [n.node.get_content() for n in response.source_nodes]
    asked = [n for n in nodes if n.startswith("Sub question:")]  # beside them, each tool call's retrieved nodes
    assert len(asked) == 2 and len(nodes) == 2 + 2 * 2
    assert asked[0].startswith("Sub question: Who built the lighthouse of Karsa?")
    assert asked[1].startswith("Sub question: Who runs Velloria's harbour?")
    assert "Mira Holt" in asked[0] and "Orin Dask" in asked[1]  # each sub-answer holds its fact
    after = rag.info()
    # each sub-question read its plan's chunks (its pick, or the candidates the likelihood pass scores) from the
    # store, and not one chunk was missing there
    assert 2 <= after["store_hits"] - before["store_hits"] <= 4 and after["store_misses"] == before["store_misses"]
    assert isinstance(str(response), str)
