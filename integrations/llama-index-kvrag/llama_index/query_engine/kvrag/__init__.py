"""kvrag for LlamaIndex: a query engine that answers over stored per-chunk KV, and its companions.

- `KVRAGQueryEngine`: a `BaseQueryEngine` over any LlamaIndex retriever; retrieved nodes whose KV is
  stored are reused, the others are encoded on the miss and stored.
- `KVRAGRetriever`: a `BaseRetriever` over kvrag's own index.
- `KVRAGKVTransform`: an `IngestionPipeline` step that precomputes and stores node KV.
- `KVRAGLLM`: kvrag's model as a LlamaIndex LLM (`Settings.llm`).
- `KVRAGEmbedding`: kvrag's embedder as a LlamaIndex embedding model (offline default).
"""

from llama_index.query_engine.kvrag.components import KVRAGEmbedding, KVRAGKVTransform, KVRAGLLM, KVRAGRetriever
from llama_index.query_engine.kvrag.query_engine import KVRAGAnswerEvent, KVRAGQueryEngine

__all__ = ["KVRAGAnswerEvent", "KVRAGEmbedding", "KVRAGKVTransform", "KVRAGLLM", "KVRAGQueryEngine", "KVRAGRetriever"]
