"""kvrag for LlamaIndex: a query engine that answers over stored per-chunk KV, and its companions.

- `KVRAGQueryEngine`: a `BaseQueryEngine` over any LlamaIndex retriever (`from_index(index, engine)`); retrieved
  nodes whose KV is stored are reused, the others are encoded on the miss and stored.
- `KVRAGKVTransform`: an `IngestionPipeline` step that precomputes and stores node KV.
- `persist(index, engine)` / `load(folder)`: the LlamaIndex index and the kvrag engine in one folder.
- Re-exported from their own modules: `KVRAGLLM` (`llama_index.llms.kvrag`), `KVRAGEmbedding`
  (`llama_index.embeddings.kvrag`), `KVRAGRetriever` (`llama_index.retrievers.kvrag`).
"""

from llama_index.embeddings.kvrag import KVRAGEmbedding
from llama_index.llms.kvrag import KVRAGLLM
from llama_index.query_engine.kvrag.persist import load, persist
from llama_index.query_engine.kvrag.query_engine import KVRAGAnswerEvent, KVRAGQueryEngine
from llama_index.query_engine.kvrag.transform import KVRAGKVTransform
from llama_index.retrievers.kvrag import KVRAGRetriever

__all__ = [
    "KVRAGAnswerEvent",
    "KVRAGEmbedding",
    "KVRAGKVTransform",
    "KVRAGLLM",
    "KVRAGQueryEngine",
    "KVRAGRetriever",
    "load",
    "persist",
]
