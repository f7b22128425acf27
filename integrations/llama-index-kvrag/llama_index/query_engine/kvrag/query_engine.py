"""KVRAGQueryEngine: LlamaIndex's query interface over kvrag's engine. Translation only: no engine logic."""

from __future__ import annotations

from typing import Any, AsyncGenerator, Generator, List, Optional, Sequence

import llama_index.core.instrumentation as instrument
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.schema import ImageNode, MetadataMode, NodeWithScore, QueryBundle, TextNode

from kvrag import KVRAG, Answer, InvalidRequestError
from kvrag.request import scores_of

dispatcher = instrument.get_dispatcher(__name__)

NO_CONTEXT = "No context was found for the question."


class KVRAGAnswerEvent(BaseEvent):
    """Emitted after each answer with kvrag's stats (strategy, order, recomputed tokens, ttft, ...)."""

    stats: dict

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGAnswerEvent"


def node_texts(nodes: Sequence[NodeWithScore]) -> list[str]:
    """The text kvrag stores KV for: the node's content without metadata (as `KVRAGKVTransform` encodes it)."""
    texts = []
    for n in nodes:
        node = n.node
        if isinstance(node, ImageNode) or not isinstance(node, TextNode):
            raise InvalidRequestError(
                f"node {node.node_id} is a {type(node).__name__}: kvrag answers over text nodes only"
            )
        text = node.get_content(metadata_mode=MetadataMode.NONE)
        if not text.strip():
            raise InvalidRequestError(f"node {node.node_id} has no text: drop it before the query engine")
        texts.append(text)
    return texts


class KVRAGQueryEngine(BaseQueryEngine):
    """Answers with kvrag's model over the stored KV of the retrieved nodes.

    Args:
        engine: the kvrag engine (its model, embedder and KV store).
        retriever: any LlamaIndex retriever (e.g. `VectorStoreIndex.as_retriever()`); default: kvrag's own.
        strategy, budget, picker: kvrag's repair strategy (see kvrag's docs/usage.md).
        streaming: return a `StreamingResponse` (or `AsyncStreamingResponse` from `aquery`).
        llm: only to refuse mixing: an LLM that is not kvrag's model owning the KV cache is an error.
        generation: decoding arguments (max_new_tokens, temperature, top_p, seed, stop).

    With no node retrieved, the response text is `NO_CONTEXT` and no generation runs. Each response's
    `metadata["kvrag"]` holds the answer's stats.
    """

    def __init__(
        self,
        engine: KVRAG,
        retriever: Optional[BaseRetriever] = None,
        *,
        strategy: str = "target_recompute",
        budget: float = 0.05,
        picker: Optional[str] = None,
        streaming: bool = False,
        llm: Any = None,
        callback_manager: Optional[CallbackManager] = None,
        **generation: Any,
    ) -> None:
        from llama_index.query_engine.kvrag.components import KVRAGLLM, KVRAGRetriever

        if llm is not None and not (isinstance(llm, KVRAGLLM) and llm.kv is engine.kvmodel):
            raise InvalidRequestError(
                f"the query engine generates with the model that owns the KV cache; {type(llm).__name__} is not that "
                "model and its caches cannot be mixed. Pass llm=None (or KVRAGLLM(engine.kvmodel))."
            )
        self.engine = engine
        self.retriever = retriever or KVRAGRetriever(engine=engine)
        self.options = dict(strategy=strategy, budget=budget, picker=picker, **generation)
        self.streaming = streaming
        super().__init__(callback_manager=callback_manager)

    def _get_prompt_modules(self) -> dict:
        return {}

    def retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return self.retriever.retrieve(query_bundle)

    async def aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        return await self.retriever.aretrieve(query_bundle)

    def _arguments(self, nodes: Sequence[NodeWithScore]) -> dict:
        return {**self.options, "scores": scores_of([n.score for n in nodes])}

    @staticmethod
    def _record(answer: Answer, metadata: dict) -> dict:
        """Put the answer's stats in a response's metadata and send them through instrumentation."""
        metadata.update({"kvrag": answer.stats.to_dict(), "sources": [s.id for s in answer.sources]})
        dispatcher.event(KVRAGAnswerEvent(stats=metadata["kvrag"]))
        return metadata

    @dispatcher.span
    def synthesize(
        self,
        query_bundle: QueryBundle,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
    ) -> RESPONSE_TYPE:
        nodes = list(nodes) + list(additional_source_nodes or [])
        if not nodes:
            return Response(response=NO_CONTEXT, source_nodes=[], metadata={"kvrag": None})
        texts, kwargs = node_texts(nodes), self._arguments(nodes)
        if not self.streaming:
            answer = self.engine.answer(query_bundle.query_str, texts, **kwargs)
            return Response(response=answer.text, source_nodes=nodes, metadata=self._record(answer, {}))
        metadata: dict = {}

        def pieces() -> Generator[str, None, None]:
            for item in self.engine.stream_over(query_bundle.query_str, texts, **kwargs):
                if isinstance(item, str):
                    yield item
                else:
                    self._record(item, metadata)

        return StreamingResponse(response_gen=pieces(), source_nodes=nodes, metadata=metadata)

    @dispatcher.span
    async def asynthesize(
        self,
        query_bundle: QueryBundle,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
    ) -> RESPONSE_TYPE:
        nodes = list(nodes) + list(additional_source_nodes or [])
        if not nodes:
            return Response(response=NO_CONTEXT, source_nodes=[], metadata={"kvrag": None})
        texts, kwargs = node_texts(nodes), self._arguments(nodes)
        if not self.streaming:
            answer = await self.engine.aanswer(query_bundle.query_str, texts, **kwargs)
            return Response(response=answer.text, source_nodes=nodes, metadata=self._record(answer, {}))
        metadata: dict = {}

        async def pieces() -> AsyncGenerator[str, None]:
            async for item in self.engine.astream_over(query_bundle.query_str, texts, **kwargs):
                if isinstance(item, str):
                    yield item
                else:
                    self._record(item, metadata)

        return AsyncStreamingResponse(response_gen=pieces(), source_nodes=nodes, metadata=metadata)

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return self.synthesize(query_bundle, self.retrieve(query_bundle))

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await self.asynthesize(query_bundle, await self.aretrieve(query_bundle))
