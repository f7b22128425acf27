"""kvrag's generation inside a runnable, reported to LangChain's callbacks as a chat model run.

A `KVRAGRunnable` call is a chain run; the answer it generates is its child chat model run (start with the
messages the model answered, one `on_llm_new_token` a text piece with its chunk, end with usage and kvrag's
stats), so LangSmith, `astream_events` and token counters see a model call as they do for any chat model.
Reporting only: nothing here changes what is generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvrag import Answer
from kvrag.adapters import DEFAULT_MODEL_NAME, answered_by
from langchain_core.callbacks import (
    AsyncCallbackManagerForChainRun,
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForChainRun,
)
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, LLMResult

PROVIDER = "kvrag"


@dataclass(slots=True)
class ModelCall:
    """What a generation run reports at its start."""

    messages: list[BaseMessage]  # the context (one system message of the chunk texts) and the question
    invocation_params: dict[str, Any]  # the request's options (strategy, budget, decoding)
    model_name: str  # the model's source (Hugging Face id or folder), else the embedded default's name

    @classmethod
    def of(cls, question: str, texts: Sequence[str], options: dict[str, Any], model_source: str | None) -> ModelCall:
        context = "\n\n".join(texts)
        messages: list[BaseMessage] = [SystemMessage(content=context), HumanMessage(content=question)]
        return cls(messages, {**options, "_type": "kvrag"}, model_source or DEFAULT_MODEL_NAME)

    @property
    def serialized(self) -> dict[str, Any]:
        return {"lc": 1, "type": "not_implemented", "id": ["langchain_kvrag", "KVRAGRunnable"], "name": "kvrag"}

    @property
    def metadata(self) -> dict[str, Any]:
        """LangSmith's standard model parameters, as `BaseChatModel` attaches them to its runs."""
        params = self.invocation_params
        return {
            "ls_provider": PROVIDER,
            "ls_model_name": self.model_name,
            "ls_model_type": "chat",
            "ls_temperature": params.get("temperature", 0.0),
            "ls_max_tokens": params.get("max_new_tokens"),
        }


def piece_chunk(piece: str) -> ChatGenerationChunk:
    return ChatGenerationChunk(message=AIMessageChunk(content=piece))


def result_of(answer: Answer, model_name: str) -> LLMResult:
    """The run's end: the answer as an AIMessage with usage and kvrag's stats, as a chat model reports it; its
    `response_metadata` also holds the chunks read, the plan that ran and why, and whether it abstained."""
    stats = answer.stats
    usage = UsageMetadata(
        input_tokens=stats.prompt_tokens,
        output_tokens=stats.new_tokens,
        total_tokens=stats.prompt_tokens + stats.new_tokens,
    )
    response = {
        "model_name": model_name,
        "model_provider": PROVIDER,
        "finish_reason": answer.finish_reason,
        "kvrag": stats.to_dict(),
        **answered_by(answer.to_dict()),
    }
    message = AIMessage(content=answer.text, usage_metadata=usage, response_metadata=response)
    generation = ChatGeneration(message=message, generation_info={"finish_reason": answer.finish_reason})
    token_usage = {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"]}
    return LLMResult(generations=[[generation]], llm_output={"token_usage": token_usage, "model_name": model_name})


class GenerationRun:
    """One generation as a child chat model run of the chain run `parent` (None: nothing is reported)."""

    def __init__(self, parent: CallbackManagerForChainRun | None, call: ModelCall) -> None:
        self.call, self.run, self.done = call, None, False
        if parent is not None:
            child = parent.get_child()
            child.add_metadata(call.metadata, inherit=False)
            (self.run,) = child.on_chat_model_start(
                call.serialized, [call.messages], invocation_params=call.invocation_params, name="kvrag"
            )

    def token(self, piece: str) -> None:
        if self.run is not None and piece:
            self.run.on_llm_new_token(piece, chunk=piece_chunk(piece))

    def end(self, answer: Answer) -> None:
        if self.run is not None and not self.done:
            self.run.on_llm_end(result_of(answer, self.call.model_name))
        self.done = True

    def error(self, err: BaseException) -> None:
        """The run's end by `err`; nothing once it ended (a stream closed after its last piece)."""
        if self.run is not None and not self.done:
            self.run.on_llm_error(err)
        self.done = True


class AsyncGenerationRun:
    """`GenerationRun` for async calls: the async callback manager awaits its handlers."""

    def __init__(self, call: ModelCall) -> None:
        self.call, self.done = call, False
        self.run: AsyncCallbackManagerForLLMRun | None = None

    async def start(self, parent: AsyncCallbackManagerForChainRun | None) -> AsyncGenerationRun:
        if parent is not None:
            child = parent.get_child()
            child.add_metadata(self.call.metadata, inherit=False)
            (self.run,) = await child.on_chat_model_start(
                self.call.serialized, [self.call.messages], invocation_params=self.call.invocation_params, name="kvrag"
            )
        return self

    async def token(self, piece: str) -> None:
        if self.run is not None and piece:
            await self.run.on_llm_new_token(piece, chunk=piece_chunk(piece))

    async def end(self, answer: Answer) -> None:
        if self.run is not None and not self.done:
            await self.run.on_llm_end(result_of(answer, self.call.model_name))
        self.done = True

    async def error(self, err: BaseException) -> None:
        if self.run is not None and not self.done:
            await self.run.on_llm_error(err)
        self.done = True
