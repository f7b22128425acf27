"""KVRAGKVTransform: an IngestionPipeline step that precomputes and stores node KV. Translation only."""

from __future__ import annotations

from typing import Any, Sequence

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from kvrag import KVRAG, InvalidRequestError


class KVRAGKVTransform(TransformComponent):
    """An ingestion step that encodes and stores each node's KV in the engine's KV store (nodes pass through).

    The KV is keyed by the node's text without metadata, as `KVRAGQueryEngine` reads it back. Its `to_dict`
    holds only what the KV depends on (the model's encoder id), so the pipeline cache is stable.

    Args:
        engine: the kvrag engine whose model encodes and whose store keeps the KV.

    Raises:
        InvalidRequestError: `engine` is not a KVRAG.
    """

    encoder: str = Field(description="kvrag encoder id: model fingerprint and prompt prefix")
    _engine: KVRAG = PrivateAttr()

    def __init__(self, engine: KVRAG, **kwargs: Any) -> None:
        if not isinstance(engine, KVRAG):
            raise InvalidRequestError(
                f"KVRAGKVTransform stores KV through a kvrag engine, got a {type(engine).__name__}: pass a kvrag.KVRAG"
            )
        super().__init__(encoder=engine.kvmodel.encoder_id, **kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGKVTransform"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = [n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]
        self._engine.store_kv([t for t in texts if t.strip()], progress=bool(kwargs.get("show_progress", False)))
        return nodes
