"""From a request to a checked plan: validate the arguments, run the picker, run the strategy, check its plan.

The planner owns the rules every plan must keep (the order is a permutation, S holds real offsets once
each); it never runs a forward itself (measurements go through the probe).
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvrag.errors import InvalidRequestError
from kvrag.pickers import get_picker
from kvrag.probe import Probe
from kvrag.strategies import Plan, PlanRequest, Strategy


@dataclass(slots=True)
class Decision:
    """A checked plan and how the target was chosen."""

    plan: Plan
    picker: str | None  # the picker that chose the target; None when the strategy needs no target
    target: int | None  # the picked target
    budget_tokens: int  # floor(budget x context tokens)


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


def check_request(
    n: int, *, target: Any, scores: Sequence[float] | None, budget: Any, picker: str | None = None
) -> tuple[int | None, list[float] | None, float]:
    """Refuse arguments that cannot describe these n chunks, saying what is accepted; return them normalized."""
    if picker is not None:
        get_picker(picker)
    if scores is not None:
        if len(scores) != n:
            raise InvalidRequestError(f"scores has {len(scores)} entries for {n} chunks: give one score a chunk")
        scores = [float(s) for s in scores]
        if not all(math.isfinite(s) for s in scores):
            raise InvalidRequestError(f"scores must be finite numbers, got {scores}")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 < float(budget) <= 1:
        raise InvalidRequestError(f"budget must be a fraction of context tokens in (0, 1], got {budget!r}")
    return as_index(target, n), scores, float(budget)


def default_picker(strategy: Strategy, picker: str | None, target: int | None) -> str:
    """The strategy's own picker, else the caller's, else the oracle when the target is known, else the retriever."""
    return strategy.picker or picker or ("oracle" if target is not None else "retriever")


def make_plan(
    strategy: Strategy,
    lengths: Sequence[int],
    probe: Probe,
    *,
    picker: str | None = None,
    target: int | None = None,
    scores: Sequence[float] | None = None,
    budget: float = 0.05,
    strict: bool = False,
) -> Decision:
    """Pick the target (when the strategy needs one), build the plan and check it."""
    n = len(lengths)
    target, scores, budget = check_request(n, target=target, scores=scores, budget=budget, picker=picker)
    picker_name = default_picker(strategy, picker, target)
    pick = get_picker(picker_name)
    picked = pick(n, scores, target, probe) if strategy.needs_target else None
    request = PlanRequest(
        lengths=list(lengths),
        target=picked,
        budget=budget,
        scores=list(scores) if scores is not None else None,
        strict=strict,
        probe=probe,
    )
    plan = check_plan(strategy.build(request), lengths, strategy.name)
    return Decision(plan, picker_name if strategy.needs_target else None, picked, request.budget_tokens)


def check_plan(plan: Plan, lengths: Sequence[int], name: str) -> Plan:
    """A plan whose order is a permutation and whose S holds each in-range offset once, sorted."""
    n = len(lengths)
    order = [operator.index(c) for c in plan.order]
    if not order or len(set(order)) != len(order) or not all(0 <= c < n for c in order):
        raise InvalidRequestError(
            f"strategy '{name}' returned order {plan.order}: give each chunk of 0..{n - 1} at most once, "
            "at least one (a chunk left out is dropped from the prompt)"
        )
    plan.order = order
    for c, offsets in list(plan.recompute.items()):
        if c not in order:
            raise InvalidRequestError(f"strategy '{name}' recomputes chunk {c}, which is not in its order {order}")
        offsets = torch.unique(torch.as_tensor(offsets, dtype=torch.long))  # sorted, once each
        if offsets.numel() and (offsets[0] < 0 or offsets[-1] >= lengths[c]):
            raise InvalidRequestError(f"strategy '{name}' recomputes offsets outside chunk {c} (length {lengths[c]})")
        if offsets.numel():
            plan.recompute[c] = offsets
        else:
            del plan.recompute[c]
    for c, kv in plan.replace.items():
        if not 0 <= c < n or len(kv) != lengths[c]:
            raise InvalidRequestError(f"strategy '{name}' replaces chunk {c} with KV of the wrong length")
    for c, scale in plan.key_scale.items():
        if c not in order or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise InvalidRequestError(
                f"strategy '{name}' scales chunk {c}'s keys by {scale!r}: give chunks of its order a positive factor"
            )
    return plan
