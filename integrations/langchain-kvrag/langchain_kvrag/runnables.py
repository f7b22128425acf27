"""KVRAGRunnable: kvrag's answers as a LangChain runnable.

Translation only: a question goes to the engine's retrieval (`KVRAG.retrieve`) and its answer over what it
found (`KVRAG.stream_over`); a `{"question", "documents"}` dict goes to `stream_over` over exactly those
documents' text. Strategies, budgets, KV loading and generation stay in kvrag; this module never looks inside
an answer beyond `Answer.to_dict()`, and reports the generation to LangChain's callbacks (`callbacks.py`).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence, Union

from kvrag import KVRAG, NO_CONTEXT, Answer, EmptyInputError, InvalidRequestError, KVModel, Request, Source
from kvrag.adapters import answered_by, check_filters, check_options, check_top_k, last_answer, scores_of, type_name
from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.runnables.utils import AddableDict, ConfigurableFieldSpec
from pydantic import ConfigDict, Field
from typing_extensions import NotRequired, TypedDict

from langchain_kvrag._arguments import OpenedFromIndex, refuse_unknown
from langchain_kvrag.callbacks import AsyncGenerationRun, GenerationRun, ModelCall

# Fields a call may override through `config["configurable"]`, under these ids.
CONFIGURABLE = ("strategy", "budget", "top_k")
GENERATION_KEYS = ("temperature", "top_p", "seed", "stop")  # generation_kwargs beside max_new_tokens
INPUT_KEYS = ("question", "documents", "context")  # a dict input; `context` is the LCEL name for documents


class QuestionWithDocuments(TypedDict):
    """The dict input: a question and the documents to answer over (omit `documents` to retrieve)."""

    question: str
    documents: NotRequired[list[Document]]


KVRAGInput = Union[str, QuestionWithDocuments]
KVRAGOutput = Union[str, dict[str, Any]]


@dataclass(slots=True)
class _Request:
    """One call, translated to the engine's arguments."""

    question: str
    texts: list[str] | None  # chunk texts to answer over; None: the engine retrieves
    scores: list[float] | None  # one retrieval score a text, when every document carried one
    retrieval: dict[str, Any]  # top_k, filters, bm25 of KVRAG.retrieve (when texts is None)
    options: dict[str, Any]  # the request's options (KVRAG.stream_over)


class KVRAGRunnable(OpenedFromIndex, RunnableSerializable[KVRAGInput, KVRAGOutput]):
    """Answer questions with a kvrag engine, over its own retrieval or over documents you pass.

    Input:
        - a question (`str`): the engine retrieves `top_k` chunks (with `filters`, `bm25`) and answers.
        - `{"question": str, "documents": [Document, ...]}` (or `"context"`, LCEL's usual name): the engine
          answers over exactly those documents' `page_content`, in the given order, with `metadata["score"]` as
          their scores when every document has one. Documents from `KVRAGRetriever` find their KV in the
          engine's store; text from any other retriever is encoded once (and stored), which shows in
          `stats["chunks_encoded"]`. A `top_k` set on the runnable or per call caps them (the first `top_k`).
          Without `documents` the engine retrieves. Other keys are refused.
        - nothing retrieved (filters that match nothing, or an empty `documents` list): the answer is
          `kvrag.NO_CONTEXT` with `finish_reason` "no_context" and nothing is generated, in every mode.

    Output: the answer text, or with `return_dict=True`
    `{"answer": text, "finish_reason": ..., "sources": [{"id", "text", "score", "metadata", "read"}], "stats": {...},
    "read": [ids], "plan": ..., "reason": ..., "abstained": bool}` (`kvrag.Answer.to_dict()`; `read` lists the
    chunks the answering prompt held, the other sources were only retrieved; `plan` and `reason` are the plan that
    ran and why). `stream`/`astream` yield the text pieces as the engine decodes them; with `return_dict=True` they
    yield `{"answer": piece}` chunks and then one chunk with the other keys, so the chunks added up equal
    `invoke`'s dict.

    Callbacks: each call is a chain run, and its generation a child chat model run ("kvrag"): started with the
    context and the question, one `on_llm_new_token` a piece, ended with `usage_metadata` and kvrag's stats in
    `response_metadata` (with `read`, `plan`, `reason` and `abstained`, as in the dict output), so tracers,
    `astream_events` (`on_chat_model_stream`) and token counters see it.

    `strategy`, `budget` and `top_k` are configurable per call:
    `runnable.with_config(configurable={"strategy": "reuse", "budget": 0.1, "top_k": 3})`.

    Serialization: `dumps` records the configuration and the engine's folder (`index`); `loads` and pickling
    reopen the engine from it with `KVRAG.load`. An engine without a folder cannot be rebuilt from a
    description: build it with a path (`KVRAG.from_defaults(path)`) to serialize the runnable.

    Args:
        engine: the kvrag engine; or give `index`.
        index: an index folder to open the engine from (`KVRAG.load(index)`); set from `engine.path`.
        strategy: a registered kvrag strategy (`kvrag.STRATEGIES`); None: the index's tuned default, else
            the model's shipped one.
        budget: fraction of context tokens a budgeted strategy may recompute, in (0, 1]; None: the default's.
        top_k: chunks to retrieve for a question input (and, when set, the most documents answered over).
        filters: metadata filters for retrieval (`{"key": value}` or `{"key": [values]}`).
        bm25: fuse dense and BM25 rankings in retrieval.
        picker: how a target strategy picks its target ("retriever", "attention", "oracle"); None: kvrag's default.
        max_new_tokens: generation limit.
        generation_kwargs: further decoding arguments (`temperature`, `top_p`, `seed`, `stop`).
        return_dict: return the answer with its sources and stats instead of the text alone.

    Errors are kvrag's own (`kvrag.KVRAGError`), raised when the runnable is built for its arguments and at
    the call for its input: `EmptyInputError` for an empty question or an empty index, `InvalidRequestError`
    for an unknown argument, strategy, input key or a bad budget, top_k or filter.

    Example:
        >>> from langchain_core.runnables import RunnablePassthrough
        >>> retriever = KVRAGRetriever(engine=rag, k=3)
        >>> chain = {"question": RunnablePassthrough(), "documents": retriever} | KVRAGRunnable(engine=rag)
        >>> chain.invoke("How many ships does Velloria's harbour hold?")
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVRAG | None = Field(default=None, exclude=True, description="the kvrag engine")
    index: str | None = Field(default=None, description="the index folder the engine is opened from")
    strategy: str | None = Field(default=None, description="the kvrag strategy that repairs the stitched KV")
    budget: float | None = Field(default=None, description="fraction of context tokens a strategy may recompute")
    top_k: int = Field(default=5, description="chunks to retrieve for a question")
    filters: dict[str, Any] | None = Field(default=None, description="metadata filters for retrieval")
    bm25: bool = Field(default=False, description="fuse dense and BM25 rankings in retrieval")
    picker: str | None = Field(default=None, description="how a target strategy picks its target")
    max_new_tokens: int = Field(default=256, description="generation limit")
    generation_kwargs: dict[str, Any] = Field(default_factory=dict, description="temperature, top_p, seed, stop")
    return_dict: bool = Field(default=False, description="return answer, sources and stats instead of the text")

    def __init__(self, **kwargs: Any) -> None:
        # Checked before pydantic sees them, so a mistake is kvrag's error (pydantic would wrap it).
        refuse_unknown(type(self), RunnableSerializable, kwargs)
        engine, index = kwargs.get("engine"), kwargs.get("index")
        if engine is None and index is None:
            raise InvalidRequestError("KVRAGRunnable needs engine= (a kvrag.KVRAG) or index= (an index folder)")
        if engine is not None and not isinstance(engine, KVRAG):
            hint = ": for a model alone use langchain_kvrag.ChatKVRAG" if isinstance(engine, KVModel) else ""
            raise InvalidRequestError(f"engine is a {type(engine).__name__}, not a kvrag.KVRAG{hint}")
        if engine is None:
            kwargs["engine"] = KVRAG.load(index)
        elif index is None and engine.path is not None:
            kwargs["index"] = str(engine.path)
        generation = kwargs.get("generation_kwargs") or {}
        if not isinstance(generation, Mapping) or set(generation) - set(GENERATION_KEYS):
            extra = sorted(set(generation) - set(GENERATION_KEYS)) if isinstance(generation, Mapping) else generation
            raise InvalidRequestError(
                f"generation_kwargs {extra!r} is not understood: it takes {', '.join(GENERATION_KEYS)} "
                "(max_new_tokens is its own argument)"
            )
        kwargs["filters"] = check_filters(kwargs.get("filters"))
        super().__init__(**kwargs)
        check_options(**self._options(self.strategy, self.budget))
        check_top_k(self.top_k)

    # -- serialization ----------------------------------------------------------------------------------

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_kvrag", "runnables"]


    @property
    def config_specs(self) -> list[ConfigurableFieldSpec]:
        # Built as `configurable_fields(strategy=ConfigurableField(id="strategy"), ...)` would build them, so
        # wrapping this runnable in that call too gives equal specs rather than conflicting ones.
        fields = type(self).model_fields
        return [
            ConfigurableFieldSpec(
                id=name,
                annotation=fields[name].annotation,
                description=fields[name].description,
                default=getattr(self, name),
            )
            for name in CONFIGURABLE
        ]

    # -- translation ------------------------------------------------------------------------------------

    def _options(self, strategy: str | None, budget: float | None) -> dict[str, Any]:
        return {
            "strategy": strategy,
            "budget": budget,
            "picker": self.picker,
            "max_new_tokens": self.max_new_tokens,
            **self.generation_kwargs,
        }

    def _request(self, value: Any, config: RunnableConfig | None) -> _Request:
        configurable = (config or {}).get("configurable") or {}
        chosen = {name: configurable.get(name, getattr(self, name)) for name in CONFIGURABLE}
        options = self._options(chosen["strategy"], chosen["budget"])
        top_k = check_top_k(chosen["top_k"])
        retrieval = {"top_k": top_k, "filters": self.filters, "bm25": self.bm25}
        if isinstance(value, str):
            return _Request(value, None, None, retrieval, options)
        if isinstance(value, PromptValue):
            raise InvalidRequestError(
                f"KVRAGRunnable got a {type(value).__name__}, a whole prompt: send a prompt to "
                "langchain_kvrag.ChatKVRAG (a chat model), or give this runnable {'question': str, 'documents': [...]} "
                "so kvrag lays out the context and reuses its KV"
            )
        if not isinstance(value, Mapping) or not isinstance(value.get("question"), str):
            raise InvalidRequestError(
                f"KVRAGRunnable takes a question (str) or a dict {{'question': str, 'documents': [Document, ...]}}, "
                f"got {_describe(value)}: to feed a retriever, compose "
                "{'question': RunnablePassthrough(), 'documents': retriever} | runnable"
            )
        unknown = sorted(set(map(str, value)) - set(INPUT_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"unknown input key(s) {', '.join(unknown)}: the dict input takes 'question' and 'documents' (or "
                "'context', its LCEL name)"
            )
        if "documents" in value and "context" in value:
            raise InvalidRequestError("the input has both 'documents' and 'context': give the documents once")
        key = "documents" if "documents" in value else "context" if "context" in value else None
        question = value["question"]
        if key is None:
            return _Request(question, None, None, retrieval, options)
        documents = value[key]
        if isinstance(documents, (str, Document)) or not isinstance(documents, Sequence):
            raise InvalidRequestError(
                f"{key} is a {type(documents).__name__}: pass a list of Documents (or of str), e.g. [Document(...)]"
            )
        if "top_k" in configurable or "top_k" in self.model_fields_set:
            documents = documents[:top_k]
        texts, raw_scores = [], []
        for i, doc in enumerate(documents):
            if isinstance(doc, Document):
                texts.append(doc.page_content)
                raw_scores.append(doc.metadata.get("score"))
            elif isinstance(doc, str):
                texts.append(doc)
                raw_scores.append(None)
            else:
                kind = type_name(doc)
                raise InvalidRequestError(
                    f"{key}[{i}] is a {kind}: pass langchain_core.documents.Document objects (a retriever's "
                    "results) or str"
                )
        return _Request(question, texts, scores_of(raw_scores), retrieval, options)

    def _call(self, request: _Request) -> tuple[float, Sequence[str | Source], float]:
        """The chunks to answer over: the given texts, else the engine's retrieval (timed)."""
        t0 = time.perf_counter()
        if not request.question.strip():
            raise EmptyInputError("the question is empty or whitespace only: ask something")
        Request.of(request.question, **request.options)  # a bad option fails before any retrieval work
        if request.texts is not None:
            return t0, request.texts, 0.0
        sources = self.engine.retrieve(request.question, **request.retrieval)
        return t0, sources, time.perf_counter() - t0

    def _output(self, answer: Answer) -> KVRAGOutput:
        if not self.return_dict:
            return answer.text
        d = answer.to_dict()
        return {
            "answer": d["text"],
            "finish_reason": d["finish_reason"],
            "sources": d["sources"],
            "stats": d["stats"],
            **answered_by(d),
        }

    def _chunks(self, item: str | Answer, streamed: bool) -> list[Any]:
        """What one item of the engine's stream becomes on the LangChain stream."""
        if isinstance(item, str):
            return [AddableDict(answer=item) if self.return_dict else item] if item else []
        if not self.return_dict:
            return [] if streamed else [""]  # an empty answer still streams one (empty) chunk
        final = self._output(item)
        text = final.pop("answer")  # type: ignore[union-attr]
        return [AddableDict(final if streamed else {"answer": text, **final})]

    # -- the engine calls -------------------------------------------------------------------------------

    def _items(self, request: _Request, run_manager: CallbackManagerForChainRun | None) -> Iterator[str | Answer]:
        t0, chunks, retrieve_s = self._call(request)
        if not chunks:
            yield NO_CONTEXT
            yield Answer.no_context(retrieve_s)
            return
        run = GenerationRun(run_manager, self._model_call(request, chunks))
        stream = self.engine.stream_over(
            request.question, chunks, scores=request.scores, started_at=t0, retrieve_s=retrieve_s, **request.options
        )
        try:
            with closing(stream):  # an abandoned stream releases the engine's generator at once
                for item in stream:
                    if isinstance(item, str):
                        run.token(item)
                    else:
                        run.end(item)
                    yield item
        except BaseException as err:  # a stream closed early ends its model run too (GeneratorExit)
            run.error(err)
            raise

    async def _aitems(
        self, request: _Request, run_manager: AsyncCallbackManagerForChainRun | None
    ) -> AsyncIterator[str | Answer]:
        t0, chunks, retrieve_s = await asyncio.to_thread(self._call, request)  # the loop stays free
        if not chunks:
            yield NO_CONTEXT
            yield Answer.no_context(retrieve_s)
            return
        run = await AsyncGenerationRun(self._model_call(request, chunks)).start(run_manager)
        stream = self.engine.astream_over(
            request.question, chunks, scores=request.scores, started_at=t0, retrieve_s=retrieve_s, **request.options
        )
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    if isinstance(item, str):
                        await run.token(item)
                    else:
                        await run.end(item)
                    yield item
        except BaseException as err:  # closed early or cancelled: the model run ends too
            await run.error(err)
            raise

    def _model_call(self, request: _Request, chunks: Sequence[str | Source]) -> ModelCall:
        texts = [c.text if isinstance(c, Source) else c for c in chunks]
        return ModelCall.of(request.question, texts, request.options, self.engine.model_source)

    def _answer(
        self, value: Any, config: RunnableConfig, run_manager: CallbackManagerForChainRun | None = None
    ) -> KVRAGOutput:
        return self._output(last_answer(self._items(self._request(value, config), run_manager)))

    async def _aanswer(
        self, value: Any, config: RunnableConfig, run_manager: AsyncCallbackManagerForChainRun | None = None
    ) -> KVRAGOutput:
        answer = None
        async for answer in self._aitems(self._request(value, config), run_manager):
            pass
        return self._output(answer)  # type: ignore[arg-type]

    def _stream(
        self, inputs: Iterator[Any], config: RunnableConfig, run_manager: CallbackManagerForChainRun | None = None
    ) -> Iterator[Any]:
        request = self._request(next(inputs), config)
        with closing(self._items(request, run_manager)) as items:
            yield from self._shape(items)

    async def _astream(
        self,
        inputs: AsyncIterator[Any],
        config: RunnableConfig,
        run_manager: AsyncCallbackManagerForChainRun | None = None,
    ) -> AsyncIterator[Any]:
        request = self._request(await anext(inputs), config)
        async with aclosing(self._aitems(request, run_manager)) as items:  # type: ignore[type-var]
            async for chunk in self._ashape(items):
                yield chunk

    def _shape(self, items: Iterable[str | Answer]) -> Iterator[Any]:
        streamed = False
        for item in items:
            for chunk in self._chunks(item, streamed):
                streamed = True
                yield chunk

    async def _ashape(self, items: AsyncIterator[str | Answer]) -> AsyncIterator[Any]:
        streamed = False
        async for item in items:
            for chunk in self._chunks(item, streamed):
                streamed = True
                yield chunk

    # -- Runnable ---------------------------------------------------------------------------------------

    def invoke(self, input: KVRAGInput, config: RunnableConfig | None = None, **kwargs: Any) -> KVRAGOutput:
        return self._call_with_config(self._answer, input, config, **kwargs)

    async def ainvoke(self, input: KVRAGInput, config: RunnableConfig | None = None, **kwargs: Any) -> KVRAGOutput:
        return await self._acall_with_config(self._aanswer, input, config, **kwargs)

    def stream(self, input: KVRAGInput, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        yield from self._transform_stream_with_config(iter([input]), self._stream, config, **kwargs)

    async def astream(
        self, input: KVRAGInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        async def single() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(single(), self._astream, config, **kwargs):
            yield chunk



def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, list) and value and all(isinstance(v, Document) for v in value):
        return "a list of Documents (a retriever's output without the question)"
    return f"a {type(value).__name__}"
