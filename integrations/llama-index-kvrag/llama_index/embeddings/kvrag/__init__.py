"""kvrag's embedder as a LlamaIndex embedding model: `from llama_index.embeddings.kvrag import KVRAGEmbedding`."""

from llama_index.embeddings.kvrag.base import KVRAGEmbedding

__all__ = ["KVRAGEmbedding"]
