"""kvrag.plan.planner: a valid request becomes a checked plan (picker, strategy, the rules every plan keeps)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import plan_of, recomputed_tokens

from kvrag import InvalidRequestError
from kvrag.plan.planner import check_plan, default_picker, make_plan
from kvrag.plan.request import Request
from kvrag.plan.strategies import Plan, PlanRequest, get_strategy

ANY_NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**12), 10**12))


def test_a_plan_with_bad_offsets_is_refused():
    with pytest.raises(InvalidRequestError, match="outside chunk 0"):
        check_plan(
            get_strategy("reuse")
            .build(PlanRequest([3], None, 0.5))
            .__class__(order=[0], recompute={0: torch.tensor([3])}),
            [3],
            "x",
        )
    with pytest.raises(InvalidRequestError, match="at most once"):
        check_plan(get_strategy("reuse").build(PlanRequest([3, 2], None, 0.5)).__class__(order=[0, 0]), [3, 2], "x")
    with pytest.raises(InvalidRequestError, match="not in its order"):
        check_plan(Plan(order=[1], recompute={0: torch.tensor([0])}), [3, 2], "x")
    with pytest.raises(InvalidRequestError, match="positive factor"):
        check_plan(Plan(order=[0, 1], key_scale={1: 0.0}), [3, 2], "x")


def test_the_picker_is_the_strategys_then_the_callers_then_the_oracle_when_the_target_is_known():
    assert default_picker(get_strategy("attention_select"), "retriever", 2) == "attention"
    assert default_picker(get_strategy("target_recompute"), "lexical", 2) == "lexical"
    assert default_picker(get_strategy("target_recompute"), None, 2) == "oracle"
    assert default_picker(get_strategy("target_recompute"), None, None) == "retriever"


def test_the_retriever_picks_the_best_score_and_the_plan_moves_it_last():
    request = Request("q", ["a", "b", "c"], strategy="target_recompute", scores=[0.1, 0.9, 0.3]).with_default(None)
    decision = make_plan(request, [4, 5, 6], None)
    assert decision.picker == "retriever" and decision.target == 1
    assert decision.plan.order == [0, 2, 1] and decision.plan.recompute[1].tolist() == [0, 1, 2, 3, 4]
    assert decision.budget_tokens == int(0.05 * 15)


def test_a_strategy_that_needs_no_target_reports_no_picker():
    decision = plan_of("reuse", [3, 3], target=1)
    assert decision.picker is None and decision.target is None and decision.plan.order == [0, 1]


@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    target=st.one_of(st.none(), st.integers(-3, 10), st.floats(allow_nan=True), st.booleans()),
    budget=st.one_of(ANY_NUMBER, st.none(), st.text(max_size=3), st.booleans()),
    scores=st.one_of(st.none(), st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=9)),
    name=st.sampled_from(["reuse", "reorder", "spread", "spread_chunks", "target_recompute"]),
    strict=st.booleans(),
)
@settings(max_examples=400, deadline=None)
def test_any_plan_request_is_a_valid_plan_within_budget_or_a_clear_error(lengths, target, budget, scores, name, strict):
    try:
        decision = plan_of(name, lengths, target=target, scores=scores, budget=budget, strict=strict)
    except InvalidRequestError as err:
        assert any(w in str(err) for w in ("budget must be", "target", "scores")), err
        return
    plan = decision.plan
    assert sorted(plan.order) == list(range(len(lengths)))
    for c, offsets in plan.recompute.items():
        assert 0 <= c < len(lengths) and all(0 <= int(o) < lengths[c] for o in offsets)
    assert decision.budget_tokens == math.floor(float(0.05 if budget is None else budget) * sum(lengths))
    if name in ("spread", "spread_chunks") or strict:
        assert recomputed_tokens(plan, lengths) <= max(decision.budget_tokens, 0) or name == "target_recompute"
