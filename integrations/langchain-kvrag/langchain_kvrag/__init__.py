"""LangChain adapter of kvrag: a retriever over a kvrag index, a runnable that answers with kvrag over reused
chunk KV, and kvrag's model as a chat model.

Thin translation between LangChain types (Document, Runnable, callbacks, config) and kvrag's KVRAG engine;
every retrieval, KV and generation decision stays in kvrag.
"""

from langchain_kvrag.chat_models import ChatKVRAG
from langchain_kvrag.retrievers import KVRAGRetriever, to_document
from langchain_kvrag.runnables import KVRAGRunnable, QuestionWithDocuments

__version__ = "0.1.0"

__all__ = ["ChatKVRAG", "KVRAGRetriever", "KVRAGRunnable", "QuestionWithDocuments", "to_document"]
