"""One folder for a LlamaIndex index and the kvrag engine whose store holds its nodes' KV: `persist` and `load`.

The folder is the kvrag engine's own (its manifest, index and disk KV store, all written by kvrag); LlamaIndex's
StorageContext goes in its `llama_index` subfolder. This module only places the two: each framework writes and
reads its own part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Tuple

from llama_index.core import StorageContext, load_index_from_storage
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.indices.base import BaseIndex
from llama_index.embeddings.kvrag import KVRAGEmbedding

from kvrag import KVRAG, IndexLoadError, InvalidRequestError, MemoryStore

LLAMA_INDEX_DIR = "llama_index"  # LlamaIndex's StorageContext, inside the kvrag folder


def persist(index: BaseIndex, engine: KVRAG) -> Path:
    """Write the LlamaIndex index and the kvrag engine to the engine's folder; return the folder.

    The nodes' KV is already there (the engine's disk KV store, written as `KVRAGKVTransform` or a query
    encoded it); this commits kvrag's manifest and index, and LlamaIndex's storage under `llama_index/`.

    Raises:
        InvalidRequestError: the engine has no folder or keeps its KV in memory only (build it with
            `KVRAG.from_defaults(folder)` before ingesting).
    """
    if not isinstance(engine, KVRAG):
        raise InvalidRequestError(f"persist takes (index, engine), got a {type(engine).__name__} as the engine")
    if not isinstance(index, BaseIndex):
        raise InvalidRequestError(f"persist takes (index, engine), got a {type(index).__name__} as the index")
    if engine.path is None or isinstance(engine.store, MemoryStore):
        raise InvalidRequestError(
            "the kvrag engine keeps its KV in memory only, so the nodes' KV would be lost: build it on a folder, "
            "KVRAG.from_defaults(folder), before ingesting, then persist(index, engine)"
        )
    folder = engine.persist()
    index.storage_context.persist(persist_dir=str(folder / LLAMA_INDEX_DIR))
    return folder


def load(folder: str | Path, *, embed_model: Optional[BaseEmbedding] = None, **kwargs: Any) -> Tuple[BaseIndex, KVRAG]:
    """The LlamaIndex index and the kvrag engine that `persist` wrote to `folder`.

    Args:
        folder: the folder `persist` returned.
        embed_model: the index's embedding model; default `KVRAGEmbedding(engine.embedder)`, the embedder the
            engine was built with.
        kwargs: `KVRAG.load`'s (store, memory_bytes, device, cache_dir, namespace, require_store).

    Raises:
        IndexLoadError: the folder holds no LlamaIndex storage or no kvrag index.
    """
    storage = Path(folder) / LLAMA_INDEX_DIR
    if not storage.is_dir():
        raise IndexLoadError(f"no LlamaIndex storage at {storage}: write the folder with persist(index, engine)")
    engine = KVRAG.load(folder, **kwargs)
    index = load_index_from_storage(
        StorageContext.from_defaults(persist_dir=str(storage)),
        embed_model=embed_model or KVRAGEmbedding(engine.embedder),
    )
    return index, engine
