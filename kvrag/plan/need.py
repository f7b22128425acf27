"""The plan chosen by what a question needs: one chunk where one stands out, several where none does,
and "the documents do not say" where no retrieved chunk bears on the question.

The signals read how the model and the retriever see the chunks, never the question's words:
- the retriever's ranking of every retrieved chunk;
- the model's likelihood of the question behind each retrieved chunk's stored KV (one batched pass of the suffix,
  every chunk: `Probe.question_likelihood`), against its likelihood behind no chunk (`Probe.question_alone`). The
  best chunk's **lift** says how much any chunk bears on the question; its **margin** over the second best says
  whether one chunk stands out.

The plan: no lift -> abstain (the one-chunk answer is decoded as a draft, the answer says the documents do not
say); the model's best chunk leads the rest clearly -> that chunk alone (exactly a full prefill over it, at the cost
of the suffix: its pass was the likelihood pass); else -> the best chunks by either ranking, stitched with the
model's best next to the question and all but the first recomputed (exactly a full prefill over those chunks in
that order). The thresholds are chosen on held-out sources (docs/study.md).
"""

from __future__ import annotations

import torch

from kvrag.plan.strategies import Plan, PlanRequest, by_score, register_strategy
from kvrag.plan.strategies import target_of as _target

# The thresholds, in mean log-probability a question token, were chosen on the held-out choose half (kvrag.lab.heldout,
# docs/study.md) and judged on the other half. Below ABSTAIN_LIFT (best chunk against no chunk) no chunk bears on
# the question; above AGREE_MARGIN (the best chunk against the second, where the retriever's best is the model's
# too) or ONE_CHUNK_MARGIN (where it is not) one chunk stands out enough to be read alone.
ABSTAIN_LIFT = 0.1
AGREE_MARGIN = 0.75
ONE_CHUNK_MARGIN = 0.75
SEVERAL = 3  # chunks read where the signals disagree


def signals(request: PlanRequest) -> dict[str, float]:
    """The measurements the plan is chosen on (the probe measures each once)."""
    probe = request.probe
    if probe is None:
        raise ValueError("by_need measures the question behind each chunk: it needs the request's probe")
    likelihood = probe.question_likelihood()
    ranked = sorted(range(len(request.lengths)), key=lambda c: (-float(likelihood[c]), c))
    best = ranked[0]
    return {
        "best": float(best),
        "retriever_best": float(by_score(request)[0]),
        "lift": float(likelihood[best]) - probe.question_alone(),
        # 0 for a lone chunk: nothing to stand out from (finite, so the signals stay plain JSON)
        "margin": float(likelihood[best] - likelihood[ranked[1]]) if len(ranked) > 1 else 0.0,
    }


def several(request: PlanRequest, best: int, likelihood: torch.Tensor, k: int = SEVERAL) -> list[int]:
    """The best `k` chunks by the model's and the retriever's rankings taken in turn, in the given order with
    `best` moved last."""
    by_model = sorted(range(len(request.lengths)), key=lambda c: (-float(likelihood[c]), c))
    chosen: list[int] = []
    for pair in zip(by_model, by_score(request)):
        for c in pair:
            if c not in chosen and len(chosen) < k:
                chosen.append(c)
    return [c for c in sorted(chosen) if c != best] + [best]


def _exact_over(order: list[int], request: PlanRequest) -> dict[int, torch.Tensor]:
    """What makes a plan over `order` exactly a full prefill over it: every chunk but the first recomputed (the
    first chunk's stored KV, encoded right behind the prefix, is its full-prefill KV)."""
    return {c: torch.arange(request.lengths[c]) for c in order[1:]}


@register_strategy(
    "best_few",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description=f"the {SEVERAL} best chunks by the model's likelihood of the question and the retriever's score taken "
    "in turn, the model's best next to the question: exactly a full prefill over them (by_need's plan of several)",
)
def _best_few(request: PlanRequest) -> Plan:
    assert request.probe is not None  # likelihood_all measured through it
    order = several(request, _target(request), request.probe.question_likelihood())
    return Plan(order=order, recompute=_exact_over(order, request))


@register_strategy(
    "by_need",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description="by what the question needs: the model's best chunk alone where it stands out, else the best few "
    "stitched with it last (exact over them), and 'the documents do not say' where no chunk bears on it",
)
def _by_need(request: PlanRequest) -> Plan:
    best = _target(request)
    seen = signals(request)
    lift, margin = seen["lift"], seen["margin"]
    if lift < ABSTAIN_LIFT:
        reason = f"no chunk bears on the question (lift {lift:.2f} < {ABSTAIN_LIFT})"
        return Plan(order=[best], abstain=True, reason=reason, signals=seen)
    agree = int(seen["retriever_best"]) == best
    if len(request.lengths) == 1 or margin > (AGREE_MARGIN if agree else ONE_CHUNK_MARGIN):
        why = " and the retriever's" if agree else ""
        return Plan(order=[best], reason=f"one chunk: the model's best{why}, by a margin of {margin:.2f}", signals=seen)
    plan = _best_few(request)
    plan.reason = f"{len(plan.order)} chunks: no chunk stands out (the model's best leads by {margin:.2f})"
    plan.signals = seen
    return plan
