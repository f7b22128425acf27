"""One request: the question, its chunks, how to repair them and how to decode. Validated once, where it is made.

Every entry point (KVModel, the engine, the adapters, the CLI, the study, the bench) builds a `Request` and
passes it on; nothing downstream checks its arguments again. This module never touches a model.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvrag.errors import EmptyInputError, InvalidRequestError
from kvrag.model.layout import check_unicode
from kvrag.plan.pickers import get_picker
from kvrag.plan.strategies import get_strategy
from kvrag.plan.sampling import Sampling

if TYPE_CHECKING:
    from kvrag.cache.kv import ChunkKV

DEFAULT_BUDGET = 0.05  # the budget a request runs with when neither it nor its default names one
DEFAULT_STRATEGY = "default"  # the strategy name that asks for the default, as None does


@dataclass(slots=True)
class Request:
    """What to answer, over which chunks, and how.

    Made without chunks (the engine, before it retrieves), it checks everything but the chunk-dependent
    fields; `with_chunks` adds them and checks those. `strategy=None` asks for a default (`with_default`).
    """

    question: str
    chunks: list[str | ChunkKV] | None = None  # texts or ChunkKV, in the given order; None: not known yet
    # a registered strategy; None or "default": the index's tuned or the model's shipped one
    strategy: str | None = None
    picker: str | None = None  # how a target strategy picks its target; None: the strategy's or the default's
    target: int | None = None  # index of the chunk known to hold the answer (studies; reported beside the pick)
    scores: list[float] | None = None  # one retrieval score a chunk
    budget: float | None = None  # fraction of context tokens a budgeted strategy may recompute; None: default
    strict: bool = False  # never exceed the budget (a long target is recomputed in part)
    sampling: Sampling = field(default_factory=Sampling)  # decoding

    def __post_init__(self) -> None:
        if not isinstance(self.question, str):
            raise InvalidRequestError(f"the question is a {type(self.question).__name__}: give a str")
        check_unicode(self.question, "the question")
        if self.strategy == DEFAULT_STRATEGY:
            self.strategy = None  # `with_default` fills it in
        if self.strategy is not None:
            get_strategy(self.strategy)
        if self.picker is not None:
            get_picker(self.picker)
        if self.budget is not None:
            self.budget = check_budget(self.budget)
        if not isinstance(self.strict, bool):
            raise InvalidRequestError(f"strict must be True or False, got {self.strict!r}")
        if self.chunks is not None:
            self.chunks = list(self.chunks)
            self._check_chunks()  # else `with_chunks` checks the target and scores against the chunks

    @classmethod
    def of(cls, question: str, chunks: Sequence[Any] | None = None, **options: Any) -> Request:
        """A request from the keyword arguments of `KVModel.stream` (decoding ones included)."""
        decoding = {k: options.pop(k) for k in SAMPLING_FIELDS if k in options}
        unknown = sorted(set(options) - set(REQUEST_FIELDS))
        if unknown:
            raise InvalidRequestError(
                f"unknown argument(s) {', '.join(unknown)}: a request takes "
                f"{', '.join(REQUEST_FIELDS + SAMPLING_FIELDS)}"
            )
        return cls(question, None if chunks is None else list(chunks), sampling=Sampling(**decoding), **options)

    def with_chunks(self, chunks: Sequence[str | ChunkKV], scores: Sequence[float] | None = None) -> Request:
        """This request over `chunks` (with their scores), checked against them."""
        self.chunks = list(chunks)
        if scores is not None:
            self.scores = scores  # type: ignore[assignment]  # checked (and made floats) by _check_chunks
        self._check_chunks()
        return self

    def with_default(self, default: Mapping[str, Any] | None) -> Request:
        """The strategy, picker and budget of `default` where this request names none; the budget then 0.05."""
        if self.strategy is None and default:
            self.strategy = default["strategy"]
            self.picker = self.picker or default.get("picker")
            if self.budget is None:
                self.budget = default.get("budget")
        if self.budget is None:
            self.budget = DEFAULT_BUDGET
        return self

    def _check_chunks(self) -> None:
        from kvrag.cache.kv import ChunkKV  # a plain type check; kv imports torch

        n = len(self.chunks or ())
        if not n:
            raise EmptyInputError("no chunks given: pass at least one chunk (text or ChunkKV)")
        for i, chunk in enumerate(self.chunks or ()):
            if not isinstance(chunk, (str, ChunkKV)):
                raise InvalidRequestError(
                    f"chunk {i} is a {type(chunk).__name__}: give a str or a ChunkKV from encode()"
                )
        self.target = as_index(self.target, n)
        if self.scores is not None:
            self.scores = check_scores(self.scores, n)


REQUEST_FIELDS = ("strategy", "picker", "target", "scores", "budget", "strict")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "stop", "prompt_lookup")


def as_index(target: Any, n: int) -> int | None:
    """A target as a plain int in 0..n-1 (numpy and 0-d torch integers accepted), or None."""
    if target is None:
        return None
    try:
        if isinstance(target, bool):
            raise TypeError
        index = operator.index(target)
    except TypeError:
        index = -1
    if not 0 <= index < n:
        raise InvalidRequestError(f"target {target!r} is not a chunk index: use an int in 0..{n - 1}")
    return index


def check_options(**options: Any) -> dict[str, Any]:
    """Check a request's options (all but its question and chunks) where they are given, e.g. when an adapter
    is built, so a misspelt key or a bad budget fails there rather than at the first query. Returns them."""
    Request.of("(options check)", **dict(options))
    return options


def check_scores(scores: Sequence[Any], n: int) -> list[float]:
    """One finite score a chunk, as floats."""
    if isinstance(scores, (str, bytes, bytearray, Mapping)):
        raise InvalidRequestError(f"scores is a {type(scores).__name__}: give a list of numbers, one a chunk")
    try:
        scores = list(scores)
    except TypeError:
        raise InvalidRequestError(
            f"scores is a {type(scores).__name__}: give a list of numbers, one a chunk"
        ) from None
    if len(scores) != n:
        raise InvalidRequestError(f"scores has {len(scores)} entries for {n} chunks: give one score a chunk")
    try:
        if any(isinstance(s, (str, bytes, bytearray)) for s in scores):
            raise TypeError  # float("0.5") would read it: a text score is a caller's mistake
        values = [float(s) for s in scores]
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequestError(f"scores must be numbers, got {list(scores)}") from None
    if not all(math.isfinite(s) for s in values):
        raise InvalidRequestError(f"scores must be finite numbers, got {values}")
    return values


def check_budget(budget: Any) -> float:
    """A budget as a float in (0, 1]."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 < budget <= 1:
        raise InvalidRequestError(f"budget must be a fraction of context tokens in (0, 1], got {budget!r}")
    return float(budget)


def scores_of(values: Sequence[Any]) -> list[float] | None:
    """The rule every adapter follows for framework documents' scores: all of them, as floats, or none.

    A retriever that scored only some documents cannot rank them against the others, so the request then
    carries no scores (the retriever picker takes the first document as the best).
    """
    if values and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values]
    return None
