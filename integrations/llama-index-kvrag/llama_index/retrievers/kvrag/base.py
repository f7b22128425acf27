"""KVRAGRetriever: top-k over kvrag's own index as a LlamaIndex retriever. Translation only: the search is kvrag's.

It translates LlamaIndex `MetadataFilters` to kvrag's filter dict and kvrag's sources to scored nodes; it
never embeds, ranks or filters itself.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any, Dict, List, Mapping, Optional, Union

from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from kvrag import KVRAG, InvalidRequestError, Source
from kvrag.adapters import check_filters, check_top_k

SUPPORTED_FILTERS = (
    "kvrag's retriever takes MetadataFilters of ExactMatchFilter / FilterOperator.EQ and FilterOperator.IN "
    "filters joined by FilterCondition.AND (one filter a key), or a dict {key: value or [values]}"
)


def to_kvrag_filters(filters: Union[MetadataFilters, Mapping[str, Any], None]) -> Optional[Dict[str, Any]]:
    """LlamaIndex metadata filters as kvrag's filter dict (`{key: value}` or `{key: [values]}`), or None.

    Raises:
        InvalidRequestError: an operator other than EQ and IN, an OR or NOT condition, nested filters, a key
            filtered twice, or a filter that is neither MetadataFilters nor a dict.
    """
    if filters is None:
        return None
    if isinstance(filters, Mapping):
        return check_filters(filters)
    if not isinstance(filters, MetadataFilters):
        raise InvalidRequestError(f"filters is a {type(filters).__name__}: {SUPPORTED_FILTERS}")
    if filters.condition == FilterCondition.NOT:
        raise InvalidRequestError(f"filters are negated (FilterCondition.NOT): {SUPPORTED_FILTERS}")
    if filters.condition == FilterCondition.OR and len(filters.filters) > 1:  # OR of one filter is that filter
        raise InvalidRequestError(f"filters are joined by FilterCondition.OR: {SUPPORTED_FILTERS}")
    out: Dict[str, Any] = {}
    for f in filters.filters:
        if not isinstance(f, MetadataFilter):
            raise InvalidRequestError(f"filters nest a {type(f).__name__}: {SUPPORTED_FILTERS}")
        if f.key in out:
            raise InvalidRequestError(f"the key {f.key!r} is filtered twice: {SUPPORTED_FILTERS}")
        if f.operator == FilterOperator.EQ and not isinstance(f.value, list):
            out[f.key] = f.value
        elif f.operator == FilterOperator.IN and isinstance(f.value, list):
            out[f.key] = list(f.value)
        else:
            raise InvalidRequestError(
                f"the filter {f.key!r} {f.operator.value} {f.value!r} is not supported: {SUPPORTED_FILTERS}. "
                "For other filters, index the nodes in a vector store that supports them and pass "
                "index.as_retriever(filters=...) to KVRAGQueryEngine"
            )
    return out or None


def _node(source: Source) -> NodeWithScore:
    """A kvrag Source as a node with its score; one given for its run, not retrieved, says so in its metadata."""
    metadata = source.metadata if source.retrieved else {**source.metadata, "retrieved": False}
    return NodeWithScore(node=TextNode(id_=source.id, text=source.text, metadata=metadata), score=source.score)


class KVRAGRetriever(BaseRetriever):
    """Top-k over kvrag's own index (dense, or dense + BM25), metadata filters applied before top-k.

    Args:
        engine: the kvrag engine whose index is searched.
        similarity_top_k: how many nodes, 1..10000.
        filters: LlamaIndex `MetadataFilters` (EQ and IN filters joined by AND) or kvrag's dict
            `{key: value or [values]}`.
        bm25: fuse the dense ranking with BM25's.
        whole_runs: where two or more retrieved chunks are of one run of a document encoded in its context, return
            the run whole (`KVRAG.retrieve`'s; None: kvrag's default); a node so added has `retrieved` False in
            its metadata.
        callback_manager: LlamaIndex callbacks (retrieve events).

    Raises:
        InvalidRequestError: `engine` is not a KVRAG, `similarity_top_k` is out of range, or `filters` uses what
            kvrag's index cannot filter on (see `to_kvrag_filters`).
    """

    def __init__(
        self,
        engine: KVRAG,
        *,
        similarity_top_k: int = 5,
        filters: Union[MetadataFilters, Mapping[str, Any], None] = None,
        bm25: bool = False,
        hybrid: Optional[bool] = None,
        whole_runs: Optional[bool] = None,
        callback_manager: Optional[CallbackManager] = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(engine, KVRAG):
            raise InvalidRequestError(
                f"KVRAGRetriever searches a kvrag engine's index, got a {type(engine).__name__}: "
                "pass a kvrag.KVRAG (KVRAG.from_defaults(path))"
            )
        if hybrid is not None:
            warnings.warn("KVRAGRetriever(hybrid=) is renamed bm25=", DeprecationWarning, stacklevel=2)
            bm25 = hybrid
        self.engine = engine
        self.similarity_top_k = check_top_k(similarity_top_k)
        self.filters = to_kvrag_filters(filters)
        self.bm25 = bool(bm25)
        self.whole_runs = None if whole_runs is None else bool(whole_runs)
        super().__init__(callback_manager=callback_manager, **kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        sources = self.engine.retrieve(
            query_bundle.query_str, top_k=self.similarity_top_k, filters=self.filters, bm25=self.bm25,
            whole_runs=self.whole_runs,
        )
        return [_node(s) for s in sources]

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)
