"""KVRAGEmbedding: kvrag's embedder as a LlamaIndex embedding model. Translation only: vectors in, vectors out."""

from __future__ import annotations

from typing import Any, List, Optional

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import PrivateAttr

from kvrag import KVRAG, InvalidRequestError
from kvrag.adapters import Embedder


class KVRAGEmbedding(BaseEmbedding):
    """kvrag's embedder (all-MiniLM-L6-v2 from the installed package by default, offline; any sentence-transformers
    model through `kvrag.engine.embed.Embedder(name)`).

    Args:
        embedder: the embedder, e.g. a KVRAG engine's `engine.embedder`; default `Embedder()`.
        kwargs: LlamaIndex embedding fields (embed_batch_size, callback_manager, ...).

    Raises:
        InvalidRequestError: `embedder` is a KVRAG engine (pass `engine.embedder`) or has no `embed` method.
    """

    _embedder: Embedder = PrivateAttr()

    def __init__(self, embedder: Optional[Embedder] = None, **kwargs: Any) -> None:
        if isinstance(embedder, KVRAG):
            raise InvalidRequestError("KVRAGEmbedding takes an embedder, got a KVRAG engine: pass engine.embedder")
        if embedder is not None and not callable(getattr(embedder, "embed", None)):
            raise InvalidRequestError(
                f"KVRAGEmbedding takes a kvrag Embedder, got a {type(embedder).__name__}: pass "
                f"kvrag.engine.embed.Embedder()"
            )
        super().__init__(model_name=kwargs.pop("model_name", "kvrag-default-embedder"), **kwargs)
        self._embedder = embedder or Embedder()

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGEmbedding"

    @property
    def embedder(self) -> Embedder:
        """The kvrag embedder behind this model."""
        return self._embedder

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embedder.embed([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return self._embedder.embed(texts).tolist()
