"""From a valid request to a checked plan: run the picker, run the strategy, check its plan.

The planning side of the seam (`kvrag.run.executor` is the other). The planner owns the rules every plan must
keep (each chunk at most once in the order, S holds real offsets once each); it never validates a request
(`kvrag.plan.request` does, once) and never runs a forward itself (measurements go through the probe).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from kvrag.errors import InvalidRequestError
from kvrag.plan.pickers import get_picker
from kvrag.plan.probe import Probe
from kvrag.plan.request import DEFAULT_BUDGET, Request
from kvrag.plan.strategies import Plan, PlanRequest, Strategy, get_strategy


@dataclass(slots=True)
class Decision:
    """A checked plan and how the target was chosen."""

    plan: Plan
    picker: str | None  # the picker that chose the target; None when the strategy needs no target
    target: int | None  # the picked target (of a set picker's several chunks, the best)
    budget_tokens: int  # floor(budget x context tokens)
    targets: list[int] | None = None  # every picked chunk, best first (one for a picker of one target)
    budget: float = 0.0  # the fraction of context tokens the plan may recompute (the request's, else the default)


def default_picker(strategy: Strategy, picker: str | None, target: int | None) -> str:
    """The strategy's own picker, else the caller's, else the oracle when the target is known, else the retriever."""
    return strategy.picker or picker or ("oracle" if target is not None else "retriever")


def make_plan(request: Request, lengths: Sequence[int], probe: Probe | None) -> Decision:
    """Pick the target (when the strategy needs one), build the plan and check it.

    `request` is valid (`kvrag.plan.request` checked it where it was made) and names its strategy and budget
    (`Request.with_default`); `lengths` are its chunks' token counts.
    """
    if request.strategy is None:
        raise InvalidRequestError(
            "the request names no strategy: its entry point applies a default first (Request.with_default)"
        )
    strategy = get_strategy(request.strategy)
    budget = request.budget if request.budget is not None else DEFAULT_BUDGET
    picker_name = default_picker(strategy, request.picker, request.target)
    picked, targets = None, None
    if strategy.before_pick is not None:  # a plan that needs no target where it applies: no picker runs for it
        early = strategy.before_pick(
            PlanRequest(
                lengths=list(lengths),
                target=None,
                budget=budget,
                scores=list(request.scores) if request.scores is not None else None,
                strict=request.strict,
                probe=probe,
            )
        )
        if early is not None:
            plan = check_plan(early, lengths, strategy.name)
            return Decision(plan, None, None, int(budget * sum(lengths) + 1e-9), None, float(budget))
    if strategy.needs_target:
        chosen = get_picker(picker_name)(len(lengths), request.scores, request.target, probe)  # type: ignore[arg-type]
        targets = [operator.index(c) for c in chosen] if isinstance(chosen, (list, tuple)) else [chosen]
        if not targets or len(set(targets)) != len(targets) or not all(0 <= c < len(lengths) for c in targets):
            raise InvalidRequestError(f"picker '{picker_name}' chose {chosen}: give chunks of 0..{len(lengths) - 1}")
        picked = targets[0]
    plan_request = PlanRequest(
        lengths=list(lengths),
        target=picked,
        targets=targets,
        budget=budget,
        scores=list(request.scores) if request.scores is not None else None,
        strict=request.strict,
        probe=probe,
    )
    plan = check_plan(strategy.build(plan_request), lengths, strategy.name)
    return Decision(
        plan, picker_name if strategy.needs_target else None, picked, plan_request.budget_tokens, targets, float(budget)
    )


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
