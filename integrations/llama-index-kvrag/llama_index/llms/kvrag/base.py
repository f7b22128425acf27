"""KVRAGLLM: kvrag's model as a LlamaIndex chat LLM (the model's chat template, plain generation).

It translates LlamaIndex messages and prompts to `KVModel.stream_prompt` and kvrag's Answer back to LlamaIndex
responses (text, token counts, stats), through LlamaIndex's own LLM callbacks and events. It never retrieves,
stitches or plans: answering over stored chunk KV is `KVRAGQueryEngine`'s, which reports that answer through
`traced_answer` here so that tracers see one LLM call either way.
"""

from __future__ import annotations

import warnings
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from kvrag import KVRAG, Answer, InvalidRequestError, KVModel
from kvrag.adapters import DRAFT_TOKENS, SAMPLING_FIELDS, check_options, in_thread, last_answer, to_thread

dispatcher = instrument.get_dispatcher(__name__)

Answers = Iterator["str | Answer"]  # text pieces as decoded, then the final Answer


def usage_of(answer: Answer) -> Dict[str, int]:
    """Token counts under the keys LlamaIndex's TokenCountingHandler and OpenAI-style LLMs use."""
    prompt, completion = answer.stats.prompt_tokens, answer.stats.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_of(answer: Answer, text: Optional[str] = None, delta: Optional[str] = None) -> CompletionResponse:
    """An Answer as a CompletionResponse: `raw` is its documented JSON form plus `usage`."""
    usage = usage_of(answer)
    return CompletionResponse(
        text=answer.text if text is None else text,
        delta=delta,
        raw={**answer.to_dict(), "usage": usage},
        additional_kwargs=usage,
    )


def completions(items: Answers) -> CompletionResponseGen:
    """A kvrag answer stream as LlamaIndex stream chunks; the last one (empty delta) carries the token counts."""
    text = ""
    for item in items:
        if isinstance(item, str):
            text += item
            yield CompletionResponse(text=text, delta=item)
        else:
            yield completion_of(item, text=text, delta="")


async def acompletions(items: AsyncIterator[Any]) -> CompletionResponseAsyncGen:
    """`completions` of an async answer stream."""
    text = ""
    async for item in items:
        if isinstance(item, str):
            text += item
            yield CompletionResponse(text=text, delta=item)
        else:
            yield completion_of(item, text=text, delta="")


def chat_of(response: CompletionResponse) -> ChatResponse:
    """A completion as the assistant's chat message, token counts and raw kept on the response."""
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
        delta=response.delta,
        raw=response.raw,
        additional_kwargs=response.additional_kwargs,
    )


class KVRAGLLM(CustomLLM):
    """kvrag's model as a LlamaIndex chat LLM (`Settings.llm`, `index.as_query_engine(llm=...)`, chat engines).

    Chat messages are rendered with the model's chat template; a completion prompt with `formatted=False` is
    sent as one user turn of that template, one with `formatted=True` as it is. Generation is plain full
    prefill (no chunk reuse): use `KVRAGQueryEngine` to answer over stored node KV.

    Args:
        kvmodel: the kvrag model (`KVModel.from_pretrained()`, or a KVRAG engine's `engine.kvmodel`).
        max_new_tokens, temperature, top_p, seed, stop, prompt_lookup: decoding, checked here as a kvrag request
            checks them.
        kwargs: LlamaIndex LLM fields (callback_manager, system_prompt, messages_to_prompt, ...).

    Responses carry `prompt_tokens`, `completion_tokens` and `total_tokens` in `additional_kwargs` and
    `raw["usage"]`, and kvrag's answer (text, finish_reason, stats) in `raw`.

    Raises:
        InvalidRequestError: `kvmodel` is not a KVModel (a KVRAG engine: pass `engine.kvmodel`), or a decoding
            argument is out of range.
    """

    max_new_tokens: int = Field(default=256, description="upper bound on generated tokens")
    temperature: float = Field(default=0.0, description="0 is greedy")
    top_p: float = Field(default=1.0, description="nucleus sampling mass, in (0, 1]")
    seed: Optional[int] = Field(default=None, description="seeds sampling: same seed, same tokens")
    stop: List[str] = Field(default_factory=list, description="generation ends before the first of these strings")
    prompt_lookup: int = Field(
        default=DRAFT_TOKENS,
        description="greedy decoding's prompt-lookup draft tokens a step at most (0: none); the same tokens either way",
    )
    _kvmodel: KVModel = PrivateAttr()

    def __init__(self, kvmodel: KVModel, **kwargs: Any) -> None:
        if not isinstance(kvmodel, KVModel):
            hint = (
                "pass the engine's model, KVRAGLLM(engine.kvmodel)"
                if isinstance(kvmodel, KVRAG)
                else "load one with kvrag.KVModel.from_pretrained()"
            )
            raise InvalidRequestError(f"KVRAGLLM takes a kvrag KVModel, got a {type(kvmodel).__name__}: {hint}")
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        check_options(**{k: kwargs[k] for k in SAMPLING_FIELDS if k in kwargs})  # kvrag's error, before pydantic's
        own_messages = kwargs.get("messages_to_prompt") is None
        own_completion = kwargs.get("completion_to_prompt") is None
        super().__init__(**kwargs)
        self._kvmodel = kvmodel
        # LlamaIndex's generic renderers write "user: ..." lines; this model has its own chat template.
        if own_messages:
            self.messages_to_prompt = self._render_messages
        if own_completion:
            self.completion_to_prompt = self._render_completion

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGLLM"

    @property
    def kvmodel(self) -> KVModel:
        """The kvrag model this LLM generates with."""
        return self._kvmodel

    @property
    def kv(self) -> KVModel:
        """Deprecated name of `kvmodel`."""
        warnings.warn("KVRAGLLM.kv is renamed KVRAGLLM.kvmodel", DeprecationWarning, stacklevel=2)
        return self._kvmodel

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._kvmodel.max_positions,
            num_output=self.max_new_tokens,
            model_name=self._kvmodel.fingerprint.architecture,
            is_chat_model=True,
        )

    # -- rendering and options ---------------------------------------------------------------------------

    def _render_messages(self, messages: Sequence[ChatMessage]) -> str:
        return self._kvmodel.layout.chat_prompt([{"role": m.role.value, "content": m.content or ""} for m in messages])

    def _render_completion(self, prompt: str) -> str:
        messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
        return self._render_messages(self._extend_messages(messages))

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        return self.messages_to_prompt(messages)

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def sampling(self, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """This LLM's decoding arguments with per-call `overrides`, checked; an unknown key is an error."""
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
        if unknown:
            raise InvalidRequestError(
                f"unknown argument(s) {', '.join(unknown)} for KVRAGLLM: it takes {', '.join(SAMPLING_FIELDS)}"
            )
        options = {k: getattr(self, k) for k in SAMPLING_FIELDS}
        options.update(overrides)
        return check_options(**options)

    def _answers(self, prompt: str, kwargs: Dict[str, Any]) -> Callable[[], Answers]:
        options = self.sampling(kwargs)  # checked now, not when the stream is first read
        return lambda: self._kvmodel.stream_prompt(prompt, **options)

    # -- completion --------------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        answers = self._answers(self._completion_prompt(prompt, formatted), kwargs)
        return completion_of(last_answer(answers()))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return completions(self._answers(self._completion_prompt(prompt, formatted), kwargs)())

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        answers = self._answers(self._completion_prompt(prompt, formatted), kwargs)
        return completion_of(await to_thread(lambda: last_answer(answers())))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return acompletions(in_thread(self._answers(self._completion_prompt(prompt, formatted), kwargs)))

    # -- chat (the model's chat template; one LLM event a call, not a chat event around a completion one) ---

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return chat_of(completion_of(last_answer(self._answers(self._chat_prompt(messages), kwargs)())))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        pieces = completions(self._answers(self._chat_prompt(messages), kwargs)())
        return (chat_of(r) for r in pieces)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        answers = self._answers(self._chat_prompt(messages), kwargs)
        return chat_of(completion_of(await to_thread(lambda: last_answer(answers()))))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        pieces = acompletions(in_thread(self._answers(self._chat_prompt(messages), kwargs)))

        async def gen() -> ChatResponseAsyncGen:
            async for r in pieces:
                yield chat_of(r)

        return gen()

    # -- an answer generated elsewhere, reported as this LLM's call --------------------------------------

    @dispatcher.span
    @llm_completion_callback()
    def traced_answer(
        self, prompt: str, answers: Callable[[], Answers], streaming: bool, **options: Any
    ) -> CompletionResponse | CompletionResponseGen:
        """Report an answer that kvrag generates elsewhere (over stitched chunk KV) as this LLM's completion.

        Args:
            prompt: what the LLM events show as the prompt.
            answers: starts the answer stream (text pieces, then the Answer).
            streaming: return the stream chunks instead of the final response.
            options: the request's options, shown as the call's additional arguments.

        The LLM callback and start, in-progress and end events are LlamaIndex's own (`llm_completion_callback`).
        """
        return completions(answers()) if streaming else completion_of(last_answer(answers()))

    @dispatcher.span
    @llm_completion_callback()
    async def atraced_answer(
        self, prompt: str, answers: Callable[[], AsyncIterator[Any]], streaming: bool, **options: Any
    ) -> CompletionResponse | CompletionResponseAsyncGen:
        """`traced_answer` over an async answer stream."""
        if streaming:
            return acompletions(answers())
        final = None
        async for item in answers():
            final = item
        if not isinstance(final, Answer):
            raise RuntimeError("the answer stream ended without an Answer")
        return completion_of(final)
