"""The components' former home, kept so `from llama_index.query_engine.kvrag.components import ...` still works.

They now live by LlamaIndex kind: `llama_index.llms.kvrag`, `llama_index.embeddings.kvrag`,
`llama_index.retrievers.kvrag`; the transform in `llama_index.query_engine.kvrag.transform`.
"""

from llama_index.embeddings.kvrag import KVRAGEmbedding
from llama_index.llms.kvrag import KVRAGLLM
from llama_index.query_engine.kvrag.transform import KVRAGKVTransform
from llama_index.retrievers.kvrag import KVRAGRetriever

__all__ = ["KVRAGEmbedding", "KVRAGKVTransform", "KVRAGLLM", "KVRAGRetriever"]
