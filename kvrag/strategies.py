"""Repair strategies as plans: where each chunk goes (the order) and which context tokens are recomputed (S).

A strategy only decides; `kvrag.recompute` carries the plan out. Strategies live in a registry, so a
user adds one with `@register_strategy("name")` without touching the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvrag.errors import InvalidRequestError


@dataclass(slots=True)
class PlanRequest:
    """What a strategy may look at."""

    lengths: list[int]  # token count of each chunk, in the given order
    target: int | None  # index of the picked target (strategies that need one always get one)
    budget: float  # fraction of context tokens that may be recomputed


@dataclass(slots=True)
class Plan:
    """A strategy's decision."""

    order: list[int]  # chunk indices, first to last in the stitched sequence
    recompute: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk index -> sorted offsets in S
    full_prefill: bool = False  # run one plain forward over the whole prompt instead (the reference)

    def recomputed_tokens(self, lengths: list[int]) -> int:
        if self.full_prefill:
            return sum(lengths)
        return sum(int(s.numel()) for s in self.recompute.values())


@dataclass(frozen=True, slots=True)
class Strategy:
    """A named plan builder."""

    name: str
    build: Callable[[PlanRequest], Plan]  # the plan for one request
    needs_target: bool  # whether a picker must choose a target first
    description: str  # one line, shown in errors and the CLI


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(
    name: str, *, needs_target: bool = False, description: str = ""
) -> Callable[[Callable[[PlanRequest], Plan]], Callable[[PlanRequest], Plan]]:
    """Register a plan builder under `name` (replacing any earlier one of that name).

    Example:
        >>> @register_strategy("first_chunk_recompute", description="recompute the first chunk")
        ... def first_chunk(request):
        ...     return Plan(order=list(range(len(request.lengths))),
        ...                 recompute={0: torch.arange(request.lengths[0])})
    """

    def add(build: Callable[[PlanRequest], Plan]) -> Callable[[PlanRequest], Plan]:
        STRATEGIES[name] = Strategy(name, build, needs_target, description or (build.__doc__ or "").strip())
        return build

    return add


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`, or an error listing what is accepted."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise InvalidRequestError(f"unknown strategy '{name}': use one of {', '.join(sorted(STRATEGIES))}") from None


@register_strategy("full_prefill", description="the reference: every token computed, nothing reused")
def _full_prefill(request: PlanRequest) -> Plan:
    return Plan(order=list(range(len(request.lengths))), full_prefill=True)


@register_strategy("reuse", description="stitch the stored KV in the given order, recompute nothing")
def _reuse(request: PlanRequest) -> Plan:
    return Plan(order=list(range(len(request.lengths))))


@register_strategy(
    "target_recompute", needs_target=True,
    description="move the picked target next to the question and recompute it against the reused cache",
)
def _target_recompute(request: PlanRequest) -> Plan:
    target = request.target
    assert target is not None
    order = [i for i in range(len(request.lengths)) if i != target] + [target]
    return Plan(order=order, recompute={target: torch.arange(request.lengths[target])})
