"""KVRAGRunnable: kvrag's answers as a LangChain runnable.

Translation only: a question goes to the engine's retrieve-and-answer calls (`query`, `stream`, `aquery`,
`astream`); a `{"question", "documents"}` dict goes to `KVRAG.answer` over exactly those documents' text.
Strategies, budgets, KV loading and generation stay in kvrag; this module never looks inside an answer
beyond `Answer.to_dict()`.
"""

from __future__ import annotations

from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Union

from kvrag import KVRAG, Answer, EmptyInputError, InvalidRequestError
from kvrag.request import scores_of
from langchain_core.documents import Document
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.runnables.utils import AddableDict, ConfigurableFieldSpec
from pydantic import ConfigDict, Field
from typing_extensions import NotRequired, TypedDict

# Fields a call may override through `config["configurable"]`, under these ids.
CONFIGURABLE = ("strategy", "budget", "top_k")


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
    options: dict[str, Any]  # keyword arguments of KVRAG.query / stream / answer


class KVRAGRunnable(RunnableSerializable[KVRAGInput, KVRAGOutput]):
    """Answer questions with a kvrag engine, over its own retrieval or over documents you pass.

    Input:
        - a question (`str`): the engine retrieves `top_k` chunks (with `filters`, `bm25`) and answers.
        - `{"question": str, "documents": [Document, ...]}`: the engine answers over exactly those documents'
          `page_content`, in the given order, with `metadata["score"]` as their scores when every document has
          one. Documents from `KVRAGRetriever` find their KV in the engine's store; text from any other
          retriever is encoded once (and stored), which shows in `stats["chunks_encoded"]`. An empty
          `documents` list raises `kvrag.EmptyInputError`. Without `documents` the engine retrieves.

    Output: the answer text, or with `return_dict=True`
    `{"answer": text, "finish_reason": ..., "sources": [{"id", "text", "score", "metadata"}], "stats": {...}}`
    (`kvrag.Answer.to_dict()`). `stream`/`astream` yield the text pieces as the engine decodes them; with
    `return_dict=True` they yield `{"answer": piece}` chunks and then one
    `{"finish_reason", "sources", "stats"}` chunk, so the chunks added up equal `invoke`'s dict.

    `strategy`, `budget` and `top_k` are configurable per call:
    `runnable.with_config(configurable={"strategy": "reuse", "budget": 0.1, "top_k": 3})`.

    Args:
        engine: the kvrag engine.
        strategy: a registered kvrag strategy (`kvrag.STRATEGIES`).
        budget: fraction of context tokens a budgeted strategy may recompute, in (0, 1].
        top_k: chunks to retrieve for a question input.
        filters: metadata filters for retrieval (`{"key": value}` or `{"key": [values]}`).
        bm25: fuse dense and BM25 rankings in retrieval.
        picker: how a target strategy picks its target ("retriever", "attention", "oracle"); None: kvrag's default.
        max_new_tokens: generation limit.
        generation_kwargs: further decoding arguments of `KVModel.stream` (`temperature`, `top_p`, `seed`, `stop`).
        return_dict: return the answer with its sources and stats instead of the text alone.

    Errors are kvrag's own (`kvrag.KVRAGError`): `EmptyInputError` for an empty question, an empty index
    or no documents, `InvalidRequestError` for an unknown strategy or a bad budget or top_k.

    Example:
        >>> from langchain_core.runnables import RunnablePassthrough
        >>> retriever = KVRAGRetriever(engine=rag, k=3)
        >>> chain = {"question": RunnablePassthrough(), "documents": retriever} | KVRAGRunnable(engine=rag)
        >>> chain.invoke("How many ships does Velloria's harbour hold?")
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: KVRAG
    strategy: str = Field(default="target_recompute", description="the kvrag strategy that repairs the stitched KV")
    budget: float = Field(default=0.05, description="fraction of context tokens a budgeted strategy may recompute")
    top_k: int = Field(default=5, description="chunks to retrieve for a question")
    filters: dict[str, Any] | None = Field(default=None, description="metadata filters for retrieval")
    bm25: bool = Field(default=False, description="fuse dense and BM25 rankings in retrieval")
    picker: str | None = Field(default=None, description="how a target strategy picks its target")
    max_new_tokens: int = Field(default=256, description="generation limit")
    generation_kwargs: dict[str, Any] = Field(default_factory=dict, description="temperature, top_p, seed, stop")
    return_dict: bool = Field(default=False, description="return answer, sources and stats instead of the text")

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

    def _request(self, value: Any, config: RunnableConfig | None) -> _Request:
        configurable = (config or {}).get("configurable") or {}
        chosen = {name: configurable.get(name, getattr(self, name)) for name in CONFIGURABLE}
        options: dict[str, Any] = {
            "strategy": chosen["strategy"],
            "budget": chosen["budget"],
            "picker": self.picker,
            "max_new_tokens": self.max_new_tokens,
            **self.generation_kwargs,
        }
        retrieval = {"top_k": chosen["top_k"], "filters": self.filters, "bm25": self.bm25}
        if isinstance(value, str):
            return _Request(value, None, None, {**options, **retrieval})
        if not isinstance(value, Mapping) or not isinstance(value.get("question"), str):
            raise InvalidRequestError(
                f"KVRAGRunnable takes a question (str) or a dict {{'question': str, 'documents': [Document, ...]}}, "
                f"got {_describe(value)}: to feed a retriever, compose "
                "{'question': RunnablePassthrough(), 'documents': retriever} | runnable"
            )
        question = value["question"]
        if "documents" not in value:
            return _Request(question, None, None, {**options, **retrieval})
        documents = value["documents"]
        if not documents:
            raise EmptyInputError(
                f"no documents to answer {question!r} over: the retriever found nothing (ingest documents or loosen "
                "its filters), or pass a question alone to let the kvrag engine retrieve"
            )
        texts, raw_scores = [], []
        for i, doc in enumerate(documents):
            if isinstance(doc, Document):
                texts.append(doc.page_content)
                raw_scores.append(doc.metadata.get("score"))
            elif isinstance(doc, str):
                texts.append(doc)
                raw_scores.append(None)
            else:
                raise InvalidRequestError(f"documents[{i}] is a {type(doc).__name__}: pass LangChain Documents or str")
        return _Request(question, texts, scores_of(raw_scores), options)

    def _output(self, answer: Answer) -> KVRAGOutput:
        if not self.return_dict:
            return answer.text
        d = answer.to_dict()
        return {"answer": d["text"], "finish_reason": d["finish_reason"], "sources": d["sources"], "stats": d["stats"]}

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

    def _items(self, request: _Request) -> Iterator[str | Answer]:
        if request.texts is None:
            return self.engine.stream(request.question, **request.options)
        return self.engine.stream_over(request.question, request.texts, scores=request.scores, **request.options)

    def _aitems(self, request: _Request) -> AsyncIterator[str | Answer]:
        if request.texts is None:
            return self.engine.astream(request.question, **request.options)
        return self.engine.astream_over(request.question, request.texts, scores=request.scores, **request.options)

    def _answer(self, value: Any, config: RunnableConfig) -> KVRAGOutput:
        request = self._request(value, config)
        if request.texts is None:
            return self._output(self.engine.query(request.question, **request.options))
        return self._output(
            self.engine.answer(request.question, request.texts, scores=request.scores, **request.options)
        )

    async def _aanswer(self, value: Any, config: RunnableConfig) -> KVRAGOutput:
        request = self._request(value, config)
        if request.texts is None:
            return self._output(await self.engine.aquery(request.question, **request.options))
        return self._output(
            await self.engine.aanswer(request.question, request.texts, scores=request.scores, **request.options)
        )

    def _stream(self, inputs: Iterator[Any], config: RunnableConfig) -> Iterator[Any]:
        request = self._request(next(inputs), config)
        # closing: an abandoned stream releases the engine's generator at once
        with closing(self._items(request)) as items:  # type: ignore[type-var]
            yield from self._shape(items)

    async def _astream(self, inputs: AsyncIterator[Any], config: RunnableConfig) -> AsyncIterator[Any]:
        request = self._request(await anext(inputs), config)
        async with aclosing(self._aitems(request)) as items:  # type: ignore[type-var]
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
