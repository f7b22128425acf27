"""KVRAGRetriever: a kvrag engine's retrieval as a LangChain retriever.

It translates `KVRAG.retrieve`'s Sources into LangChain Documents and nothing more: ranking, filters and
BM25 fusion stay in the engine.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

from kvrag import KVRAG, InvalidRequestError, Source
from kvrag.adapters import check_filters, check_top_k
from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from langchain_kvrag._arguments import OpenedFromIndex, refuse_unknown


def to_document(source: Source) -> Document:
    """A retrieved chunk as a Document: its text, its metadata plus its chunk `id` and retrieval `score` (and
    `"retrieved": False` for a chunk given for its run, `KVRAG.retrieve(whole_runs=)`)."""
    added = {} if source.retrieved else {"retrieved": False}
    return Document(
        page_content=source.text,
        id=source.id,
        metadata={**source.metadata, "id": source.id, "score": source.score, **added},
    )


SEARCH_KWARGS = ("k", "filter", "filters", "bm25")  # a call's keyword arguments, and `search_kwargs`' keys


class KVRAGRetriever(OpenedFromIndex, BaseRetriever):
    """The top-k chunks of a kvrag index, best first, as Documents.

    Each Document carries the chunk text as `page_content` and the chunk's metadata plus `"id"` (the chunk
    id, `<doc_id>#<n>`) and `"score"` (cosine similarity; the fused rank score with `bm25=True`). Feed them
    to `KVRAGRunnable` as `{"question": ..., "documents": ...}` and their KV comes from the engine's store.

    Args:
        engine: the kvrag engine to search.
        k: how many chunks to return (`top_k`).
        filters: metadata filters (`{"key": value}` or `{"key": [values]}`), applied before top-k, so a
            filter that matches fewer than k chunks returns only those.
        bm25: fuse the dense and BM25 rankings by reciprocal rank (`hybrid` is its deprecated name).
        whole_runs: where two or more retrieved chunks are of one run of a document encoded in its context, return
            the run whole (`KVRAG.retrieve`'s; None: kvrag's default).
        search_kwargs: the same settings in a vector store retriever's words: `{"k": 3, "filter": {...}}`.

    A call overrides them for itself: `invoke(query, k=3, filter={"source": "a.txt"})` (`filters=` and
    `bm25=` too). Arguments are checked when the retriever is built, and a call's when it is made.

    Example:
        >>> retriever = KVRAGRetriever(engine=KVRAG.from_defaults("./my-index"), k=3)
        >>> retriever.invoke("How many ships does Velloria's harbour hold?")
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVRAG | None = Field(default=None, exclude=True, description="the kvrag engine")
    index: str | None = Field(default=None, description="the index folder the engine is opened from")
    k: int = Field(default=5, description="how many chunks to return (top_k)")
    filters: dict[str, Any] | None = Field(default=None, description="metadata filters, applied before top-k")
    bm25: bool = Field(default=False, description="fuse dense and BM25 rankings")
    whole_runs: bool | None = Field(default=None, description="read a run two retrieved chunks share whole")
    search_kwargs: dict[str, Any] = Field(default_factory=dict, description="k, filter, bm25 (vector store style)")

    def __init__(self, **kwargs: Any) -> None:
        # Checked before pydantic sees them, so a mistake is kvrag's error (pydantic would wrap it).
        if "hybrid" in kwargs:
            warnings.warn("KVRAGRetriever(hybrid=) is renamed bm25=", DeprecationWarning, stacklevel=2)
            kwargs["bm25"] = kwargs.pop("hybrid")
        refuse_unknown(type(self), BaseRetriever, kwargs)
        engine, index = kwargs.get("engine"), kwargs.get("index")
        if engine is None and index is not None:
            engine = kwargs["engine"] = KVRAG.load(index)
        if not isinstance(engine, KVRAG):
            raise InvalidRequestError(f"engine is a {type(engine).__name__}: pass a kvrag.KVRAG (or index=, a folder)")
        if index is None and engine.path is not None:
            kwargs["index"] = str(engine.path)
        search = _search_arguments(kwargs.get("search_kwargs") or {}, "search_kwargs")
        for name, value in search.items():
            if kwargs.get(name) is not None and kwargs[name] != value:
                raise InvalidRequestError(f"{name} is given twice (as {name}= and in search_kwargs): give it once")
            kwargs[name] = value
        kwargs["filters"] = check_filters(kwargs.get("filters"))
        check_top_k(kwargs.get("k", 5))
        super().__init__(**kwargs)

    # -- serialization: as KVRAGRunnable's, the engine reopened from its index folder --------------------

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_kvrag", "retrievers"]


    def _search(self, query: str, arguments: dict[str, Any]) -> list[Document]:
        call = _search_arguments(arguments, "a call")
        sources = self.engine.retrieve(
            query,
            top_k=call.get("k", self.k),
            filters=call.get("filters", self.filters),
            bm25=call.get("bm25", self.bm25),
            whole_runs=self.whole_runs,
        )
        return [to_document(s) for s in sources]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        return self._search(query, kwargs)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        # The engine embeds and searches synchronously: a worker thread keeps the event loop free.
        return await asyncio.to_thread(self._search, query, kwargs)


def _search_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """k / filter / filters / bm25 from a call's keyword arguments or `search_kwargs`, as k / filters / bm25."""
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where} is a {type(arguments).__name__}: give a dict of {', '.join(SEARCH_KWARGS)}")
    unknown = sorted(set(arguments) - set(SEARCH_KWARGS))
    if unknown:
        raise InvalidRequestError(
            f"unknown search argument(s) {', '.join(unknown)} in {where}: it takes {', '.join(SEARCH_KWARGS)}"
        )
    if "filter" in arguments and "filters" in arguments:
        raise InvalidRequestError(f"{where} gives both filter and filters: give one")
    out = {k: v for k, v in arguments.items() if v is not None}
    if "filter" in out:
        out["filters"] = out.pop("filter")
    if "filters" in out:
        out["filters"] = check_filters(out["filters"])
    if "k" in out:
        check_top_k(out["k"])
    if "bm25" in out and not isinstance(out["bm25"], bool):
        raise InvalidRequestError(f"bm25 must be True or False, got {out['bm25']!r}")
    return out

