"""How to pick tokens: the decoding half of a request (`Sampling`), checked where it is made.

It is part of what a caller asks (`kvrag.plan.request.Request.sampling`); `kvrag.run.generate` decodes by it. This
module never runs a forward.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvrag import cpu
from kvrag.errors import InvalidRequestError

DRAFT_TOKENS = cpu.MAX_TOKENS - 1  # prompt-lookup drafts a greedy step may feed beside its token
# A temperature below this is greedy: logits divided by it overflow float32 (1e-40 makes every logit inf and the
# softmax nan), and any such temperature puts all the probability on the top token anyway (vLLM draws the line here).
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 1e6  # far past where sampling is uniform already; a larger one (an int of 400 digits) is refused


@dataclass(slots=True)
class Sampling:
    """How to pick tokens. temperature 0 is greedy."""

    max_new_tokens: int = 256  # upper bound on generated tokens
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW, made 0): greedy; else sample from softmax(logits / it)
    top_p: float = 1.0  # nucleus: sample only from the smallest set whose probability reaches top_p
    seed: int | None = None  # seeds a private generator: same seed, same tokens
    stop: tuple[str, ...] = field(default_factory=tuple)  # generation ends before the first of these strings
    # greedy decoding's draft tokens a step, looked up in the prompt and the answer so far (0: none); the tokens
    # are the same either way (`decode`)
    prompt_lookup: int = DRAFT_TOKENS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if self.stop is None:
            self.stop = ()
        if not isinstance(self.stop, Iterable) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = tuple(s for s in self.stop if s)
        _check_number("max_new_tokens", self.max_new_tokens, integer=True)
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
                raise InvalidRequestError(f"seed must be an int in 0..2**64 - 1, got {self.seed}")
        _check_number("prompt_lookup", self.prompt_lookup, integer=True)
        if not 0 <= self.prompt_lookup < cpu.MAX_TOKENS:
            raise InvalidRequestError(
                f"prompt_lookup must be in 0..{cpu.MAX_TOKENS - 1} draft tokens, got {self.prompt_lookup}"
            )
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0 and <= {MAX_TEMPERATURE:g} (0 is greedy), got "
                f"{self.temperature}"
            )
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # greedy, which is what such a temperature samples, without its overflow
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)  # a numpy or Fraction value too


def _check_number(name: str, value: Any, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidRequestError(f"{name} must be {'an int' if integer else 'a number'}, got {value!r}")
