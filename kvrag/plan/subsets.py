"""Strategies over a subset of the retrieved chunks: full prefill over the retriever's top k (the baselines a user
would run instead), the top three with the target last, and a picked set of chunks (for questions that need
several). Registered into `kvrag.plan.strategies`' registry when that module loads."""

from __future__ import annotations

import torch

from kvrag.plan.strategies import Plan, PlanRequest, by_score, register_strategy, target_of


def _top_k_full_prefill(request: PlanRequest, k: int) -> Plan:
    keep = set(by_score(request)[:k])
    return Plan(order=[i for i in range(len(request.lengths)) if i in keep], full_prefill=True)


@register_strategy(
    "full_prefill_top1",
    budgeted=False,
    reads_kv=False,
    description="baseline: full prefill over the best-scored chunk alone, nothing reused",
)
def _full_prefill_top1(request: PlanRequest) -> Plan:
    return _top_k_full_prefill(request, 1)


@register_strategy(
    "full_prefill_top3",
    budgeted=False,
    reads_kv=False,
    description="baseline: full prefill over the three best-scored chunks (in the given order), nothing reused",
)
def _full_prefill_top3(request: PlanRequest) -> Plan:
    return _top_k_full_prefill(request, 3)


@register_strategy(
    "top3_exact",
    budgeted=False,
    description="the three best-scored chunks (in the given order), the first's stored KV as is and the other two "
    "recomputed: exactly full_prefill_top3, at the cost of two chunks and the suffix",
)
def _top3_exact(request: PlanRequest) -> Plan:
    plan = _top_k_full_prefill(request, 3)
    # The first kept chunk's KV, encoded right behind the prefix, is its full-prefill KV; computing the rest over it
    # is that prefill's own arithmetic.
    return Plan(order=plan.order, recompute={c: torch.arange(request.lengths[c]) for c in plan.order[1:]})


@register_strategy(
    "top3_target_last",
    budgeted=False,
    needs_target=True,
    description="the picked target and the two best-scored other chunks, the target moved next to the question; the "
    "first chunk's stored KV as is and the other two recomputed: exactly full prefill over those three in that order",
)
def _top3_target_last(request: PlanRequest) -> Plan:
    target = target_of(request)
    others = set([i for i in by_score(request) if i != target][:2])
    order = [*(i for i in range(len(request.lengths)) if i in others), target]
    return Plan(order=order, recompute={c: torch.arange(request.lengths[c]) for c in order[1:]})


# -- questions that need several chunks ---------------------------------------------------------------------


def _targets(request: PlanRequest) -> list[int]:
    """The picked set, in the given order (a set's chunks keep the order the retriever's list gave them)."""
    return sorted(request.targets or [target_of(request)])


@register_strategy(
    "set_recompute",
    budgeted=False,
    needs_target=True,
    description="move the picked set (a set picker's chunks) next to the question and recompute it against the "
    "reused rest: target_recompute for several chunks",
)
def _set_recompute(request: PlanRequest) -> Plan:
    picked = _targets(request)
    rest = [i for i in range(len(request.lengths)) if i not in picked]
    return Plan(order=[*rest, *picked], recompute={c: torch.arange(request.lengths[c]) for c in picked})


@register_strategy(
    "set_only",
    budgeted=False,
    needs_target=True,
    description="the picked set alone, the first chunk's stored KV as is and the others recomputed: exactly a full "
    "prefill over the set, at the cost of all but one of its chunks and the suffix",
)
def _set_only(request: PlanRequest) -> Plan:
    picked = _targets(request)
    return Plan(order=picked, recompute={c: torch.arange(request.lengths[c]) for c in picked[1:]})
