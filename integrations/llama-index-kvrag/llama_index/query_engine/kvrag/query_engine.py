"""KVRAGQueryEngine: LlamaIndex's query interface over kvrag's engine. Translation only: no engine logic.

It checks its arguments where it is built, applies node postprocessors, turns nodes into chunk texts and kvrag's
answer into LlamaIndex responses, and reports the query, synthesis, templating and model call through LlamaIndex's
callbacks and instrumentation as the stock RetrieverQueryEngine, its synthesizer and its LLM do. Retrieval is the
retriever's; planning and generation are kvrag's.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Generator, Iterable, List, Optional, Sequence

import llama_index.core.instrumentation as instrument
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.indices.base import BaseIndex
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import ImageNode, MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.settings import Settings
from llama_index.core.vector_stores.types import MetadataFilters
from llama_index.llms.kvrag import KVRAGLLM
from llama_index.retrievers.kvrag import KVRAGRetriever

from kvrag import KVRAG, NO_CONTEXT, Answer, EmptyInputError, InvalidRequestError
from kvrag.adapters import SAMPLING_FIELDS, answered_by, check_options, check_top_k, scores_of, type_name

# The key each answered-over node's metadata gets: whether the prompt that answered held it (kept out of the text
# an LLM or an embedder sees).
READ_KEY = "kvrag_read"

__all__ = ["KVRAGAnswerEvent", "KVRAGQueryEngine", "NO_CONTEXT", "node_texts"]

dispatcher = instrument.get_dispatcher(__name__)

ARGUMENTS = (
    "retriever",
    "similarity_top_k",
    "node_postprocessors",
    "strategy",
    "picker",
    "budget",
    "strict",
    "streaming",
    "llm",
    "callback_manager",
    *SAMPLING_FIELDS,
)


class KVRAGAnswerEvent(BaseEvent):
    """Emitted after each answer with kvrag's stats (strategy, order, recomputed tokens, ttft, ...)."""

    stats: dict

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGAnswerEvent"


def node_texts(nodes: Sequence[NodeWithScore]) -> list[str]:
    """The text kvrag stores KV for: the node's content without metadata (as `KVRAGKVTransform` encodes it)."""
    texts = []
    for i, n in enumerate(nodes):
        if not isinstance(n, NodeWithScore):
            kind = type_name(n)
            raise InvalidRequestError(
                f"node {i} is a {kind}: KVRAGQueryEngine answers over LlamaIndex NodeWithScore objects (a "
                "retriever's results); wrap texts as NodeWithScore(node=TextNode(text=...), score=...)"
            )
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


def check_engine(engine: Any) -> KVRAG:
    """The kvrag engine, or an error that says what was passed instead."""
    if isinstance(engine, KVRAG):
        return engine
    if isinstance(engine, BaseRetriever):
        raise InvalidRequestError(
            f"KVRAGQueryEngine takes the kvrag engine first and the retriever second, got a {type(engine).__name__} "
            "first: KVRAGQueryEngine(engine, retriever)"
        )
    if isinstance(engine, BaseIndex):
        raise InvalidRequestError(
            f"KVRAGQueryEngine takes the kvrag engine first, got a {type(engine).__name__}: over a LlamaIndex "
            "index use KVRAGQueryEngine.from_index(index, engine)"
        )
    raise InvalidRequestError(
        f"KVRAGQueryEngine answers through a kvrag engine, got a {type(engine).__name__}: pass a kvrag.KVRAG "
        "(KVRAG.from_defaults(folder))"
    )


class KVRAGQueryEngine(BaseQueryEngine):
    """Answers with kvrag's model over the stored KV of the retrieved nodes.

    Args:
        engine: the kvrag engine (its model, embedder and KV store).
        retriever: any LlamaIndex retriever (e.g. `index.as_retriever()`); default: kvrag's own index, which then
            must hold chunks (`engine.ingest`); for nodes indexed by LlamaIndex use `from_index`.
        similarity_top_k: how many nodes kvrag's own retriever returns (default 5); set it on a retriever you pass.
        node_postprocessors: applied to the retrieved nodes in order, as in RetrieverQueryEngine.
        strategy, budget, picker, strict: kvrag's repair strategy (kvrag's docs/usage.md); strategy None runs the
            index's tuned default, else the model's shipped one.
        streaming: return a `StreamingResponse` (an `AsyncStreamingResponse` from `aquery`).
        llm: a `KVRAGLLM` over `engine.kvmodel`, whose decoding arguments become the defaults; any other LLM is
            refused (caches of two models never mix).
        callback_manager: LlamaIndex callbacks (default `Settings.callback_manager`): query, retrieve (kvrag's
            own retriever), synthesize, templating and llm events.
        generation: decoding arguments (max_new_tokens, temperature, top_p, seed, stop, prompt_lookup).

    Each response's `metadata["kvrag"]` holds the answer's stats, `metadata["read"]` the ids of the chunks the
    answering prompt held (the other sources were only retrieved), `metadata["plan"]` and `["reason"]` the plan
    that ran and why, `metadata["abstained"]` whether it abstained; each source node's metadata `kvrag_read` says
    whether it was read (all filled when a stream ends: the nodes are then replaced by marked copies). With no node
    retrieved the response text is `kvrag.NO_CONTEXT` and no generation runs, in every mode. The LLM events show
    the prompt over the nodes in retrieval order, as full prefill reads it; the stats' `order` is the one the
    strategy stitched.

    Raises:
        InvalidRequestError: an argument is wrong (which, and what is accepted, in the message).
        EmptyInputError: no retriever is given and the engine's own index holds no chunks.
    """

    def __init__(
        self,
        engine: KVRAG,
        retriever: Optional[BaseRetriever] = None,
        *,
        similarity_top_k: Optional[int] = None,
        node_postprocessors: Optional[Sequence[BaseNodePostprocessor]] = None,
        strategy: Optional[str] = None,
        budget: Optional[float] = None,
        picker: Optional[str] = None,
        strict: bool = False,
        streaming: bool = False,
        llm: Optional[KVRAGLLM] = None,
        callback_manager: Optional[CallbackManager] = None,
        **generation: Any,
    ) -> None:
        self.engine = check_engine(engine)
        unknown = sorted(set(generation) - set(SAMPLING_FIELDS))
        if unknown:
            raise InvalidRequestError(
                f"unknown argument(s) {', '.join(unknown)} for KVRAGQueryEngine: it takes {', '.join(ARGUMENTS)}"
            )
        if llm is not None and not (isinstance(llm, KVRAGLLM) and llm.kvmodel is engine.kvmodel):
            raise InvalidRequestError(
                f"the query engine generates with the model that owns the KV cache; {type(llm).__name__} is not that "
                "model and its caches cannot be mixed. Pass llm=None (or KVRAGLLM(engine.kvmodel)), or build the "
                "engine on the LLM's model: KVRAG.from_defaults(path, model=llm.kvmodel)."
            )
        generation = {**(llm.sampling() if llm is not None else {}), **generation}
        self.options = check_options(strategy=strategy, budget=budget, picker=picker, strict=strict, **generation)
        callback_manager = callback_manager or Settings.callback_manager
        self.retriever = self._retriever(retriever, similarity_top_k, callback_manager)
        self.node_postprocessors = list(node_postprocessors or [])
        for p in self.node_postprocessors:
            if not isinstance(p, BaseNodePostprocessor):
                raise InvalidRequestError(
                    f"node_postprocessors holds a {type(p).__name__}: give LlamaIndex BaseNodePostprocessor objects"
                )
            p.callback_manager = callback_manager
        # The LLM that LlamaIndex's callbacks and events report kvrag's answers through.
        self._llm = llm or KVRAGLLM(engine.kvmodel, **generation)
        self._llm.callback_manager = callback_manager
        self.streaming = bool(streaming)
        super().__init__(callback_manager=callback_manager)

    def _retriever(
        self, retriever: Optional[BaseRetriever], top_k: Optional[int], callback_manager: CallbackManager
    ) -> BaseRetriever:
        if retriever is not None:
            if not isinstance(retriever, BaseRetriever):
                raise InvalidRequestError(
                    f"retriever is a {type(retriever).__name__}: give a LlamaIndex retriever (index.as_retriever())"
                )
            if top_k is not None:
                raise InvalidRequestError(
                    "similarity_top_k configures kvrag's own retriever, and a retriever was given: set it there "
                    "(index.as_retriever(similarity_top_k=...)) or use KVRAGQueryEngine.from_index(index, engine, "
                    "similarity_top_k=...)"
                )
            return retriever
        if not len(self.engine.index):
            raise EmptyInputError(
                "the kvrag engine's own index holds no chunks (KV stored by KVRAGKVTransform is not indexed by "
                "kvrag): answer over your LlamaIndex index with KVRAGQueryEngine.from_index(index, engine) or "
                "KVRAGQueryEngine(engine, retriever=index.as_retriever()), or ingest with engine.ingest(...)"
            )
        return KVRAGRetriever(
            self.engine, similarity_top_k=5 if top_k is None else top_k, callback_manager=callback_manager
        )

    @classmethod
    def from_index(
        cls,
        index: BaseIndex,
        engine: KVRAG,
        *,
        similarity_top_k: int = 5,
        filters: Optional[MetadataFilters] = None,
        **kwargs: Any,
    ) -> KVRAGQueryEngine:
        """A query engine over a LlamaIndex index's retriever: the index is the one store of record for nodes, and
        kvrag's store only holds their KV (e.g. written by `KVRAGKVTransform` in the ingestion pipeline).

        Args:
            index: a LlamaIndex index whose `as_retriever` takes `similarity_top_k` (a VectorStoreIndex).
            engine: the kvrag engine whose store holds the nodes' KV.
            similarity_top_k, filters: passed to `index.as_retriever`.
            kwargs: the other arguments of `KVRAGQueryEngine`.
        """
        if not isinstance(index, BaseIndex):
            raise InvalidRequestError(
                f"from_index takes a LlamaIndex index first, got a {type(index).__name__}: "
                "KVRAGQueryEngine.from_index(index, engine)"
            )
        check_engine(engine)
        retriever_args: dict = {"similarity_top_k": check_top_k(similarity_top_k)}
        if filters is not None:
            retriever_args["filters"] = filters
        retriever = index.as_retriever(**retriever_args)
        if kwargs.get("callback_manager") is not None:
            retriever.callback_manager = kwargs["callback_manager"]
        return cls(engine, retriever, **kwargs)

    def _get_prompt_modules(self) -> dict:
        return {}

    def _get_prompts(self) -> dict:
        """kvrag's question-answering prompt as a LlamaIndex template: the header before the chunks (part of every
        stored chunk's prefix), `{context_str}`, then the question template with `{query_str}`."""
        layout = self.engine.kvmodel.layout
        tail = layout.question_template.replace("{question}", "{query_str}")
        return {"text_qa_template": PromptTemplate(layout.header + "{context_str}" + tail)}

    def _update_prompts(self, prompts: dict) -> None:
        """Take a new `text_qa_template`: the text after `{context_str}` becomes the model's question template
        (every engine on this model asks with it); the text before it must stay as it is, since every stored
        chunk's KV was computed behind it."""
        template = prompts.get("text_qa_template")
        if template is None:
            return
        text = template.get_template() if hasattr(template, "get_template") else str(template)
        if (
            text.count("{context_str}") != 1
            or text.count("{query_str}") != 1
            or text.index("{query_str}") < text.index("{context_str}")
        ):
            raise InvalidRequestError(
                "kvrag's text_qa_template needs {context_str} once, then {query_str} once after it (the chunks "
                f"come before the question), got {text!r}"
            )
        layout = self.engine.kvmodel.layout
        header, _, tail = text.partition("{context_str}")
        if header != layout.header:
            raise InvalidRequestError(
                "the text before {context_str} is part of every stored chunk's prefix and cannot change on a "
                f"built index (it is {layout.header!r}): change only what follows the chunks, or build a KVModel "
                "with layout=PromptLayout(tokenizer, header=...) and re-ingest"
            )
        layout.question_template = tail.replace("{query_str}", "{question}")

    # -- retrieval --------------------------------------------------------------------------------------

    def retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        nodes = self.retriever.retrieve(query_bundle)
        for p in self.node_postprocessors:
            nodes = p.postprocess_nodes(nodes, query_bundle=query_bundle)
        return nodes

    async def aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        nodes = await self.retriever.aretrieve(query_bundle)
        for p in self.node_postprocessors:
            nodes = await p.apostprocess_nodes(nodes, query_bundle=query_bundle)
        return nodes

    # -- synthesis --------------------------------------------------------------------------------------

    def _prompt(self, question: str, texts: Sequence[str]) -> str:
        """The prompt over the texts in retrieval order (the LLM events' prompt), after the templating event."""
        kv = self.engine.kvmodel
        layout = kv.layout
        with self.callback_manager.event(
            CBEventType.TEMPLATING,
            payload={
                EventPayload.TEMPLATE: layout.header + "{context}" + layout.question_template,
                EventPayload.TEMPLATE_VARS: {"context": "\n\n".join(t.strip() for t in texts), "question": question},
                EventPayload.SYSTEM_PROMPT: layout.system_prompt,
                EventPayload.QUERY_WRAPPER_PROMPT: None,
            },
        ):
            pass
        ids = kv.prompt_ids(question, [kv.chunk_ids(i, t) for i, t in enumerate(texts)], range(len(texts)))
        return kv.tokenizer.decode(ids)

    def _record(self, answer: dict, metadata: dict, nodes: List[NodeWithScore] | None = None) -> dict:
        """Put an answer's stats, the chunks it read and its plan (from `Answer.to_dict()`) in a response's metadata,
        send the stats as an event, and replace each answered-over node by a copy marked read or not."""
        metadata.update({"kvrag": answer["stats"], "sources": [s["id"] for s in answer["sources"]]})
        metadata.update(answered_by(answer))
        given = answer["sources"]  # the nodes answered over, in order (additional source nodes follow them)
        if nodes is not None and len(nodes) >= len(given):
            nodes[: len(given)] = [_marked(n, bool(s.get("read"))) for n, s in zip(nodes, given)]
        dispatcher.event(KVRAGAnswerEvent(stats=metadata["kvrag"]))
        return metadata

    def _no_context(self, asynchronous: bool) -> RESPONSE_TYPE:
        """`kvrag.NO_CONTEXT`, in the response type this engine gives, with no generation."""
        answer = Answer.no_context()
        metadata = self._record(answer.to_dict(), {})
        if not self.streaming:
            return Response(response=answer.text, source_nodes=[], metadata=metadata)
        if asynchronous:

            async def agen() -> AsyncGenerator[str, None]:
                yield answer.text

            return AsyncStreamingResponse(response_gen=agen(), source_nodes=[], metadata=metadata)
        return StreamingResponse(response_gen=(t for t in [answer.text]), source_nodes=[], metadata=metadata)

    def _pieces(
        self, chunks: Iterable[CompletionResponse], metadata: dict, nodes: List[NodeWithScore]
    ) -> Generator[str, None, None]:
        for r in chunks:
            if r.raw is not None:  # the last chunk: the answer, with its stats
                self._record(r.raw, metadata, nodes)
            if r.delta:
                yield r.delta

    def _request(self, question: str, nodes: List[NodeWithScore]) -> tuple[list[str], str, dict]:
        """The nodes' texts, the prompt the LLM events show, and the request's options with the nodes' scores."""
        texts = node_texts(nodes)
        return texts, self._prompt(question, texts), {**self.options, "scores": scores_of([n.score for n in nodes])}

    def _respond(self, question: str, nodes: List[NodeWithScore]) -> RESPONSE_TYPE:
        if not nodes:
            return self._no_context(asynchronous=False)
        texts, prompt, options = self._request(question, nodes)

        def answers() -> Any:
            return self.engine.stream_over(question, texts, **options)

        if not self.streaming:
            done = self._llm.traced_answer(prompt, answers, False, **self.options)
            return Response(response=done.text, source_nodes=nodes, metadata=self._record(done.raw, {}, nodes))
        metadata: dict = {}
        chunks = self._llm.traced_answer(prompt, answers, True, **self.options)
        return StreamingResponse(
            response_gen=self._pieces(chunks, metadata, nodes), source_nodes=nodes, metadata=metadata
        )

    async def _arespond(self, question: str, nodes: List[NodeWithScore]) -> RESPONSE_TYPE:
        if not nodes:
            return self._no_context(asynchronous=True)
        texts, prompt, options = self._request(question, nodes)

        def answers() -> Any:
            return self.engine.astream_over(question, texts, **options)

        if not self.streaming:
            done = await self._llm.atraced_answer(prompt, answers, False, **self.options)
            return Response(response=done.text, source_nodes=nodes, metadata=self._record(done.raw, {}, nodes))
        metadata: dict = {}
        chunks = await self._llm.atraced_answer(prompt, answers, True, **self.options)

        async def pieces() -> AsyncGenerator[str, None]:
            async for r in chunks:
                if r.raw is not None:
                    self._record(r.raw, metadata, nodes)
                if r.delta:
                    yield r.delta

        return AsyncStreamingResponse(response_gen=pieces(), source_nodes=nodes, metadata=metadata)

    @dispatcher.span
    def synthesize(
        self,
        query_bundle: QueryBundle,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query_bundle))
        with self.callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as event:
            response = self._respond(query_bundle.query_str, list(nodes))
            # additional source nodes are listed as sources, not answered over (as stock LlamaIndex does)
            response.source_nodes.extend(additional_source_nodes or [])
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query_bundle, response=response))
        return response

    @dispatcher.span
    async def asynthesize(
        self,
        query_bundle: QueryBundle,
        nodes: List[NodeWithScore],
        additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
    ) -> RESPONSE_TYPE:
        dispatcher.event(SynthesizeStartEvent(query=query_bundle))
        with self.callback_manager.event(
            CBEventType.SYNTHESIZE, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as event:
            response = await self._arespond(query_bundle.query_str, list(nodes))
            # additional source nodes are listed as sources, not answered over (as stock LlamaIndex does)
            response.source_nodes.extend(additional_source_nodes or [])
            event.on_end(payload={EventPayload.RESPONSE: response})
        dispatcher.event(SynthesizeEndEvent(query=query_bundle, response=response))
        return response

    # -- queries ----------------------------------------------------------------------------------------

    @dispatcher.span
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        with self.callback_manager.event(
            CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as query_event:
            response = self.synthesize(query_bundle, self.retrieve(query_bundle))
            query_event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    @dispatcher.span
    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        with self.callback_manager.event(
            CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as query_event:
            response = await self.asynthesize(query_bundle, await self.aretrieve(query_bundle))
            query_event.on_end(payload={EventPayload.RESPONSE: response})
        return response


def _marked(node: NodeWithScore, read: bool) -> NodeWithScore:
    """A copy of a node whose metadata says whether the answering prompt held it (the stored node is untouched)."""
    inner = node.node.model_copy(
        update={
            "metadata": {**node.node.metadata, READ_KEY: read},
            "excluded_llm_metadata_keys": [*node.node.excluded_llm_metadata_keys, READ_KEY],
            "excluded_embed_metadata_keys": [*node.node.excluded_embed_metadata_keys, READ_KEY],
        }
    )
    return NodeWithScore(node=inner, score=node.score)
