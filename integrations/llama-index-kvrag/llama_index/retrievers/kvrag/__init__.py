"""Top-k over kvrag's own index as a LlamaIndex retriever: `from llama_index.retrievers.kvrag import KVRAGRetriever`."""

from llama_index.retrievers.kvrag.base import KVRAGRetriever, to_kvrag_filters

__all__ = ["KVRAGRetriever", "to_kvrag_filters"]
