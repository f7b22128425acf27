"""KVRAGRetriever: a kvrag engine's retrieval as a LangChain retriever.

It translates `KVRAG.retrieve`'s Sources into LangChain Documents and nothing more: ranking, filters and
BM25 fusion stay in the engine.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

from kvrag import KVRAG, Source
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, model_validator


def to_document(source: Source) -> Document:
    """A retrieved chunk as a Document: its text, its metadata plus its chunk `id` and retrieval `score`."""
    return Document(
        page_content=source.text, id=source.id, metadata={**source.metadata, "id": source.id, "score": source.score}
    )


class KVRAGRetriever(BaseRetriever):
    """The top-k chunks of a kvrag index, best first, as Documents.

    Each Document carries the chunk text as `page_content` and the chunk's metadata plus `"id"` (the chunk
    id, `<doc_id>#<n>`) and `"score"` (cosine similarity; the fused rank score with `bm25=True`). Feed them
    to `KVRAGRunnable` as `{"question": ..., "documents": ...}` and their KV comes from the engine's store.

    Args:
        engine: the kvrag engine to search.
        k: how many chunks to return (`top_k`); `invoke(query, k=3)` overrides it for one call.
        filters: metadata filters (`{"key": value}` or `{"key": [values]}`), applied before top-k, so a
            filter that matches fewer than k chunks returns only those.
        bm25: fuse the dense and BM25 rankings by reciprocal rank (`hybrid` is its deprecated name).

    Example:
        >>> retriever = KVRAGRetriever(engine=KVRAG.from_defaults("./my-index"), k=3)
        >>> retriever.invoke("How many ships does Velloria's harbour hold?")
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVRAG
    k: int = Field(default=5, description="how many chunks to return (top_k)")
    filters: dict[str, Any] | None = Field(default=None, description="metadata filters, applied before top-k")
    bm25: bool = Field(default=False, description="fuse dense and BM25 rankings")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values: Any) -> Any:
        if isinstance(values, dict) and "hybrid" in values:
            warnings.warn("KVRAGRetriever(hybrid=) is renamed bm25=", DeprecationWarning, stacklevel=4)
            values = {**values, "bm25": values.pop("hybrid")}
        return values

    def _search(self, query: str, k: int | None, filters: dict[str, Any] | None, bm25: bool | None) -> list[Document]:
        sources = self.engine.retrieve(
            query,
            top_k=self.k if k is None else k,
            filters=self.filters if filters is None else filters,
            bm25=self.bm25 if bm25 is None else bm25,
        )
        return [to_document(s) for s in sources]

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        k: int | None = None,
        filters: dict[str, Any] | None = None,
        bm25: bool | None = None,
    ) -> list[Document]:
        return self._search(query, k, filters, bm25)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
        filters: dict[str, Any] | None = None,
        hybrid: bool | None = None,
    ) -> list[Document]:
        # The engine embeds and searches synchronously: a worker thread keeps the event loop free.
        return await asyncio.to_thread(self._search, query, k, filters, hybrid)
