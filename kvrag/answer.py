"""What an answer is: its text, why it ended, the chunks it was given and what it cost.

Plain records, built once per answer by `kvrag.run.pipeline`; `to_dict` is the documented JSON form. This
module computes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

# The answer the framework adapters give when retrieval finds nothing: no generation runs (stock LlamaIndex
# answers "Empty Response" the same way), in every call and streaming mode, with finish_reason "no_context".
NO_CONTEXT = "No context was found for the question."
# What an answer says when no retrieved chunk bears on the question (`Answer.abstained`; the model's text is kept
# in `Answer.draft`).
NOT_IN_DOCUMENTS = "The documents do not say."


def says_not_in_documents(text: str) -> bool:
    """Whether a model's answer is kvrag's decline, `NOT_IN_DOCUMENTS`, at its start: the model's own abstention
    (a prompt may ask for it where the documents are silent: `kvrag.model.layout.DECLINING_HEADER`)."""
    return text.lstrip().startswith(NOT_IN_DOCUMENTS)


@dataclass(slots=True)
class AnswerStats:
    """What one answer cost and what the strategy decided."""

    strategy: str  # registered strategy name
    picker: str | None  # the picker that chose the target; None when the strategy needs no target
    order: list[int]  # indices into the given chunks, first to last in the stitched prompt
    target: int | None  # index of the picked target, when the strategy used one
    target_given: int | None  # the known target passed by the caller, if any
    context_tokens: int  # chunk tokens in the prompt (prefix and suffix excluded)
    recomputed_tokens: int  # context tokens whose KV was computed fresh for this answer
    budget: float  # the budget asked for, as a fraction of context tokens
    budget_tokens: int  # floor(budget x context_tokens)
    overspend_tokens: int  # recomputed tokens beyond budget_tokens (a long target recomputed whole)
    extra_token_layers: int  # work outside the plan's prefill (check layer, attention pass, oracle), token x layer
    extra_work: list[str]  # what that extra work was
    prompt_tokens: int  # prefix + context + suffix
    chunks_encoded: int  # chunks given as text and encoded inside this call
    encode_s: float  # seconds spent encoding those chunks (part of ttft_s)
    ttft_s: float  # seconds from the call to the first generated token
    new_tokens: int  # generated tokens, EOS excluded
    total_s: float  # seconds from the call to the end of generation
    store_hits: int = 0  # chunks whose KV came from a store (retrieval engine)
    retrieve_s: float = 0.0  # seconds spent retrieving and loading chunk KV (retrieval engine; part of ttft_s)
    targets: list[int] | None = None  # every picked chunk, best first (a set picker's; else [target])
    reason: str = ""  # why this plan answered (a plan chosen by need says what it saw; else empty)
    signals: dict[str, float] = field(default_factory=dict)  # what was measured to choose the plan, by name

    @property
    def recomputed_fraction(self) -> float:
        return self.recomputed_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def target_correct(self) -> bool | None:
        """Whether the picked target is the known one (None when either is unknown)."""
        if self.target is None or self.target_given is None:
            return None
        return self.target == self.target_given

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recomputed_fraction": self.recomputed_fraction, "target_correct": self.target_correct}

    @classmethod
    def without_chunks(cls, strategy: str, **measured: Any) -> AnswerStats:
        """Stats of an answer over no chunks: nothing planned, reused or encoded; `measured` sets the rest."""
        fields: dict[str, Any] = dict(
            picker=None,
            order=[],
            target=None,
            target_given=None,
            context_tokens=0,
            recomputed_tokens=0,
            budget=0.0,
            budget_tokens=0,
            overspend_tokens=0,
            extra_token_layers=0,
            extra_work=[],
            prompt_tokens=0,
            chunks_encoded=0,
            encode_s=0.0,
            ttft_s=0.0,
            new_tokens=0,
            total_s=0.0,
        )
        return cls(strategy=strategy, **{**fields, **measured})

    @classmethod
    def of_prompt(cls, prompt_tokens: int, new_tokens: int, ttft_s: float, total_s: float) -> AnswerStats:
        """The stats of plain generation from a whole prompt (no chunks, nothing reused)."""
        return cls.without_chunks(
            "full_prefill",
            budget=1.0,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            ttft_s=ttft_s,
            total_s=total_s,
        )


@dataclass(slots=True)
class Source:
    """A chunk an answer was given, as the retrieval engine found it."""

    id: str  # chunk id, "<doc_id>#<n>"
    text: str
    score: float  # retrieval score (cosine similarity; fused rank score with hybrid retrieval)
    metadata: dict[str, Any] = field(default_factory=dict)
    read: bool = False  # whether a prompt that answered held this chunk (retrieved is not read)
    retrieved: bool = True  # False: given for its run, beside retrieved chunks of it (`kvrag.engine.runs`)


@dataclass(slots=True)
class Answer:
    """Generated text with its stats."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string), "length" (max_new_tokens), "no_context" (nothing retrieved)
    stats: AnswerStats
    sources: list[Source] = field(default_factory=list)  # retrieved chunks, in the order they were given
    parts: list[Answer] = field(default_factory=list)  # a question answered a part at a time: each part's Answer
    # how the parts' answers became `text`: "lines" (a line each), "code" (a comparison decided from their numbers),
    # "hops" (a chain of hops: the last hop's answer),
    # "model" (a comparison asked whole over the parts' answers: that pass's Answer is the last of `parts`)
    composed: str | None = None
    # the evidence was too weak to answer (no chunk bore on the question, or the model itself said the documents do
    # not say): `text` says so, `draft` keeps what the model wrote
    abstained: bool = False
    draft: str | None = None  # the model's own text when the answer abstained

    @classmethod
    def no_context(cls, retrieve_s: float = 0.0) -> Answer:
        """`NO_CONTEXT` with nothing generated: what an adapter answers when retrieval found no chunk."""
        stats = AnswerStats.without_chunks("none", ttft_s=retrieve_s, total_s=retrieve_s, retrieve_s=retrieve_s)
        return cls(text=NO_CONTEXT, token_ids=[], finish_reason="no_context", stats=stats)

    @property
    def read(self) -> list[Source]:
        """The sources a prompt that answered held (the rest were retrieved and not read)."""
        return [s for s in self.sources if s.read]

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON form: text, finish_reason, abstained, sources (each with `read` and `retrieved`),
        stats."""
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "abstained": self.abstained,
            **({"draft": self.draft} if self.abstained else {}),
            "sources": [asdict(s) for s in self.sources],
            "stats": self.stats.to_dict(),
            **({"parts": [p.to_dict() for p in self.parts], "composed": self.composed} if self.parts else {}),
        }


def last_answer(items: Iterable[str | Answer]) -> Answer:
    """The Answer that ends an answer stream (its text pieces are dropped)."""
    result = None
    for result in items:
        pass
    if not isinstance(result, Answer):
        raise RuntimeError("the answer stream ended without an Answer")
    return result
