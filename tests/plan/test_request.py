"""kvrag.plan.request: a request is checked once, where it is made, and says what was wrong and what is accepted."""

import math

import numpy as np
import pytest
import torch

from kvrag import EmptyInputError, InvalidRequestError, Request
from kvrag.plan.request import DEFAULT_BUDGET, check_options, scores_of


@pytest.mark.parametrize("budget", [0, -0.1, 1.0001, math.nan, math.inf, "0.1", True, 10**9])
def test_a_budget_outside_0_1_is_refused(budget):
    with pytest.raises(InvalidRequestError, match=r"budget must be a fraction of context tokens in \(0, 1\]"):
        Request("q", ["a"], budget=budget)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"strategy": "fast"}, "unknown strategy 'fast'"),
        ({"picker": "best"}, "unknown picker 'best'"),
        ({"target": 3}, "target 3 is not a chunk index"),
        ({"target": True}, "target True is not a chunk index"),
        ({"scores": [0.1]}, "scores has 1 entries for 2 chunks"),
        ({"scores": [0.1, math.nan]}, "scores must be finite"),
        ({"scores": ["a", "b"]}, "scores must be numbers"),
        ({"strict": "yes"}, "strict must be True or False"),
    ],
)
def test_bad_options_name_what_is_accepted(options, match):
    with pytest.raises(InvalidRequestError, match=match):
        Request("q", ["a", "b"], **options)


def test_bad_decoding_and_unknown_arguments_are_refused_by_of():
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be at least 1"):
        Request.of("q", ["a"], max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p must be in"):
        Request.of("q", ["a"], top_p=0)
    with pytest.raises(InvalidRequestError, match="unknown argument.*budgett"):
        Request.of("q", ["a"], budgett=0.1)


def test_chunks_must_be_texts_or_chunk_kv_and_not_none():
    with pytest.raises(EmptyInputError, match="no chunks given"):
        Request("q", [])
    with pytest.raises(InvalidRequestError, match="chunk 1 is a int"):
        Request("q", ["a", 5])
    with pytest.raises(InvalidRequestError, match="the question is a bytes"):
        Request(b"q", ["a"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        Request("q\udcff", ["a"])


def test_targets_and_scores_are_normalized_and_checked_once_the_chunks_are_known():
    r = Request("q", ["a", "b", "c"], target=np.int64(2), scores=[torch.tensor(0.5), 1, 2.5])
    assert r.target == 2 and type(r.target) is int and r.scores == [0.5, 1.0, 2.5]
    pending = Request("q", target=4)  # the engine's: chunks come from retrieval
    with pytest.raises(InvalidRequestError, match="target 4 is not a chunk index"):
        pending.with_chunks(["a", "b"])
    assert Request("q", target=1).with_chunks(["a", "b"], [0.2, 0.1]).scores == [0.2, 0.1]


def test_a_default_fills_only_what_the_request_left_out():
    default = {"strategy": "target_only", "picker": "likelihood", "budget": 0.2}
    assert Request("q").with_default(default).strategy == "target_only"
    mine = Request("q", strategy="reuse").with_default(default)
    assert (mine.strategy, mine.picker, mine.budget) == ("reuse", None, DEFAULT_BUDGET)
    picked = Request("q", picker="lexical").with_default(default)
    assert (picked.strategy, picked.picker, picked.budget) == ("target_only", "lexical", 0.2)
    assert Request("q").with_default(None).strategy is None  # the model's shipped default comes later
    named = Request("q", strategy="default").with_default(default)  # "default" is a name for the same
    assert (named.strategy, named.picker, named.budget) == ("target_only", "likelihood", 0.2)


def test_scores_of_is_all_or_nothing():
    assert scores_of([0.5, 1, np.float32(0.25)]) == [0.5, 1.0, 0.25]
    assert scores_of([0.5, None]) is None
    assert scores_of([True, 0.5]) is None
    assert scores_of([]) is None


def test_check_options_refuses_what_a_request_would_and_returns_the_rest():
    options = {"strategy": "reuse", "budget": 0.1, "max_new_tokens": 8, "stop": ["\n"]}
    assert check_options(**options) == options
    with pytest.raises(InvalidRequestError, match="unknown argument.*temprature"):
        check_options(temprature=0.5)
    with pytest.raises(InvalidRequestError, match="budget"):
        check_options(budget=5)
    with pytest.raises(InvalidRequestError, match="strategy"):
        check_options(strategy="no_such_strategy")
