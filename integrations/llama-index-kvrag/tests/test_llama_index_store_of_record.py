"""One store of record: nodes ingested by a LlamaIndex pipeline only (their KV stored by kvrag, their text indexed by
LlamaIndex) are answered over through the LlamaIndex index, and both persist to one folder and load back."""

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.query_engine.kvrag import KVRAGKVTransform, KVRAGQueryEngine, load, persist

from kvrag import KVRAG, EmptyInputError, IndexLoadError, InvalidRequestError, KVModel, MemoryStore

TEXTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
    "The old mill of Brenn grinds barley and rye for three villages.",
]
Q = "Who runs Velloria's harbour?"


def pipeline_ingest(rag, embed_model):
    transformations = [SentenceSplitter(chunk_size=64, chunk_overlap=0), KVRAGKVTransform(rag), embed_model]
    nodes = IngestionPipeline(transformations=transformations).run(documents=[Document(text=t) for t in TEXTS])
    return VectorStoreIndex(nodes, embed_model=embed_model)


def test_the_engines_own_empty_index_says_to_answer_over_the_llama_index_one(model_dir, embedder, embed_model):
    rag = KVRAG(KVModel.from_pretrained(model_dir), embedder=embedder, store=MemoryStore())
    index = pipeline_ingest(rag, embed_model)
    assert len(rag.store) == 4 and len(rag.index) == 0  # KV stored, nothing indexed by kvrag
    with pytest.raises(EmptyInputError, match=r"from_index\(index, engine\).*retriever=index.as_retriever\(\)"):
        KVRAGQueryEngine(rag)
    response = KVRAGQueryEngine.from_index(index, rag, similarity_top_k=3, max_new_tokens=4).query(Q)
    assert len(response.source_nodes) == 3 and response.source_nodes[0].node.get_content().startswith("Velloria")
    assert response.metadata["kvrag"]["chunks_encoded"] == 0 and response.metadata["kvrag"]["store_hits"] == 3
    with pytest.raises(InvalidRequestError, match="persist"):
        persist(index, rag)  # its KV lives in memory only
    with pytest.raises(InvalidRequestError, match="index first"):
        KVRAGQueryEngine.from_index(rag, index)


def test_persist_and_load_one_folder(tmp_path, model_dir, embed_model):
    folder = tmp_path / "kv-index"
    rag = KVRAG.from_defaults(folder, model=str(model_dir))
    index = pipeline_ingest(rag, embed_model)
    first = KVRAGQueryEngine.from_index(index, rag, similarity_top_k=3, max_new_tokens=6).query(Q)
    assert persist(index, rag) == folder
    assert (folder / "kvrag-index.json").is_file() and (folder / "llama_index" / "docstore.json").is_file()

    index2, rag2 = load(folder)
    assert rag2 is not rag and len(rag2.store) == 4
    again = KVRAGQueryEngine.from_index(index2, rag2, similarity_top_k=3, max_new_tokens=6).query(Q)
    assert again.response == first.response
    assert [n.node.node_id for n in again.source_nodes] == [n.node.node_id for n in first.source_nodes]
    assert again.metadata["kvrag"]["chunks_encoded"] == 0 and again.metadata["kvrag"]["store_hits"] == 3
    with pytest.raises(IndexLoadError, match="no LlamaIndex storage"):
        load(tmp_path)
