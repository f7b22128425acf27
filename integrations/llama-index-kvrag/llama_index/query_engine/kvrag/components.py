"""kvrag's retriever, ingestion transform, LLM and embedding as LlamaIndex components. Translation only."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any, Dict, List, Optional, Sequence

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode, TransformComponent

from kvrag import KVRAG, Answer, KVModel
from kvrag.embed import Embedder


class KVRAGRetriever(BaseRetriever):
    """Top-k over kvrag's own index (dense, or dense + BM25), metadata filters applied before top-k."""

    def __init__(
        self,
        engine: KVRAG,
        *,
        similarity_top_k: int = 5,
        filters: Optional[Dict[str, Any]] = None,
        bm25: bool = False,
        hybrid: Optional[bool] = None,
        **kwargs: Any,
    ) -> None:
        if hybrid is not None:
            warnings.warn("KVRAGRetriever(hybrid=) is renamed bm25=", DeprecationWarning, stacklevel=2)
            bm25 = hybrid
        self.engine, self.similarity_top_k, self.filters, self.bm25 = engine, similarity_top_k, filters, bm25
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        sources = self.engine.retrieve(
            query_bundle.query_str, top_k=self.similarity_top_k, filters=self.filters, bm25=self.bm25
        )
        return [
            NodeWithScore(node=TextNode(id_=s.id, text=s.text, metadata=s.metadata), score=s.score) for s in sources
        ]

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class KVRAGKVTransform(TransformComponent):
    """An ingestion step that encodes and stores each node's KV (nodes pass through unchanged).

    Its `to_dict` holds only what the KV depends on (the model's encoder id), so the pipeline cache is stable.
    """

    encoder: str = Field(description="kvrag encoder id: model fingerprint and prompt prefix")
    _engine: KVRAG = PrivateAttr()

    def __init__(self, engine: KVRAG, **kwargs: Any) -> None:
        super().__init__(encoder=engine.kvmodel.encoder_id, **kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGKVTransform"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = [n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]
        self._engine.store_kv([t for t in texts if t.strip()], progress=bool(kwargs.get("show_progress", False)))
        return nodes


class KVRAGEmbedding(BaseEmbedding):
    """kvrag's embedder (all-MiniLM-L6-v2 from the installed package by default; any sentence-transformers model)."""

    _embedder: Embedder = PrivateAttr()

    def __init__(self, embedder: Optional[Embedder] = None, **kwargs: Any) -> None:
        super().__init__(model_name=kwargs.pop("model_name", "kvrag-default-embedder"), **kwargs)
        self._embedder = embedder or Embedder()

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embedder.embed([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return self._embedder.embed(texts).tolist()


class KVRAGLLM(CustomLLM):
    """kvrag's model as a LlamaIndex LLM: plain completion over a whole prompt (no chunk reuse).

    Chat messages are rendered with the model's own chat template. Use `KVRAGQueryEngine` to answer over
    retrieved nodes with reuse.
    """

    max_new_tokens: int = Field(default=256, description="upper bound on generated tokens")
    temperature: float = Field(default=0.0, description="0 is greedy")
    _kv: KVModel = PrivateAttr()

    def __init__(self, kv: KVModel, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._kv = kv
        if self.messages_to_prompt is None or getattr(self.messages_to_prompt, "__name__", "") == "messages_to_prompt":
            self.messages_to_prompt = self._render_chat

    @property
    def kv(self) -> KVModel:
        return self._kv

    def _render_chat(self, messages: Sequence[Any]) -> str:
        return self._kv.layout.chat_prompt([{"role": m.role.value, "content": m.content or ""} for m in messages])

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._kv.max_positions,
            num_output=self.max_new_tokens,
            model_name=self._kv.fingerprint.architecture,
            is_chat_model=False,
        )

    def _stream(self, prompt: str, **kwargs: Any):  # type: ignore[no-untyped-def]
        options = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, **kwargs}
        return self._kv.stream_prompt(prompt, **options)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        answer = next(item for item in self._stream(prompt, **kwargs) if isinstance(item, Answer))
        return CompletionResponse(text=answer.text, raw=answer.stats.to_dict())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        def gen() -> CompletionResponseGen:
            text = ""
            for item in self._stream(prompt, **kwargs):
                if isinstance(item, str):
                    text += item
                    yield CompletionResponse(text=text, delta=item)

        return gen()
