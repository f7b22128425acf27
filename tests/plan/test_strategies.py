"""Every strategy of the study as a plan: invariants on tiny models, budget accounting, pickers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import STRATEGY_CHUNKS as CHUNKS
from tiny import STRATEGY_QUESTION as Q
from tiny import byte_tokenizer, plan_of, recomputed_tokens, tiny_model

from kvrag import STRATEGIES, InvalidRequestError, KVModel
from kvrag.cache.kv import ChunkKV
from kvrag.model.encode import stacked_kv
from kvrag.plan.probe import Probe
from kvrag.plan import need
from kvrag.plan.strategies import BUILTIN_STRATEGIES, TEMPER_T, Plan
from kvrag.model.recompute import full_prefill

STUDY = BUILTIN_STRATEGIES


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


@pytest.fixture(scope="module")
def enc(kv):
    return kv.encode(CHUNKS)


def lengths_of(kv):
    return [len(kv.layout.chunk_ids(c)) for c in CHUNKS]


def test_every_study_strategy_is_registered_and_runs(kv, enc):
    assert set(STUDY) <= set(STRATEGIES)
    for name in STUDY:
        a = kv.answer(Q, enc, strategy=name, target=4, budget=0.2, max_new_tokens=2)
        kept = {
            "full_prefill_top1": 1,
            "full_prefill_top3": 3,
            "target_only": 1,
            "top3_exact": 3,
            "top3_target_last": 3,
            "set_only": 1,  # the oracle's set of one
        }.get(name, 5)  # they drop chunks
        # one chunk or several as the signals say, and the question's names'
        if name in ("by_need", "by_need_reuse", "by_need_spread", "by_need_two", "best_few"):
            fewest = need.SEVERAL if name == "best_few" else 1
            kept = len(a.stats.order) if fewest <= len(a.stats.order) <= need.MOST_READ else -1
        assert a.stats.strategy == name and len(set(a.stats.order)) == len(a.stats.order) == kept


def test_reuse_recomputes_nothing(kv, enc):
    run = kv.prefill(Q, enc, strategy="reuse")
    assert run.prefill.recomputed_tokens == 0 and run.decision.plan.recompute == {}
    assert run.decision.plan.order == [0, 1, 2, 3, 4] and run.decision.target is None


def test_full_prefill_equals_a_plain_forward_exactly(kv, enc):
    run = kv.prefill(Q, enc, strategy="full_prefill")
    ids = kv.prompt_ids(Q, [c.token_ids.tolist() for c in enc], range(5))
    with torch.inference_mode():
        ref = kv.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert torch.equal(run.prefill.logits[-1], ref.float())


def test_reorder_puts_the_best_score_last(kv, enc):
    run = kv.prefill(Q, enc, strategy="reorder", scores=[0.3, 0.1, 0.9, 0.2, 0.5])
    assert run.decision.plan.order == [1, 3, 0, 4, 2] and run.prefill.recomputed_tokens == 0
    assert kv.prefill(Q, enc, strategy="reorder").decision.plan.order == [4, 3, 2, 1, 0]  # ranked best-first


@pytest.mark.parametrize("target", [0, 2, 4])
def test_target_recompute_puts_the_target_last_and_recomputes_it(kv, enc, target):
    run = kv.prefill(Q, enc, strategy="target_recompute", target=target)
    plan = run.decision.plan
    assert plan.order[-1] == target and list(plan.recompute) == [target]
    assert plan.recompute[target].tolist() == list(range(len(enc[target])))


@pytest.mark.parametrize("target", [0, 2, 4])
@pytest.mark.parametrize("name", ["spread", "spread_chunks"])
def test_spread_never_touches_the_target_and_keeps_the_budget(kv, enc, target, name):
    for budget in (0.05, 0.2, 0.5, 1.0):
        run = kv.prefill(Q, enc, strategy=name, target=target, budget=budget)
        assert target not in run.decision.plan.recompute
        assert run.prefill.recomputed_tokens <= run.decision.budget_tokens
        assert run.decision.plan.order == [0, 1, 2, 3, 4]
    spread = kv.prefill(Q, enc, strategy="spread", target=target, budget=0.2).decision.plan
    assert all(s.tolist() == list(range(len(s))) for s in spread.recompute.values())  # each chunk's first tokens


def test_a_long_target_is_recomputed_whole_and_the_overspend_reported(kv, enc):
    lengths = lengths_of(kv)
    a = kv.answer(Q, enc, target=4, budget=0.05, max_new_tokens=1)
    assert a.stats.recomputed_tokens == lengths[4] > a.stats.budget_tokens == int(0.05 * sum(lengths))
    assert a.stats.overspend_tokens == lengths[4] - a.stats.budget_tokens
    strict = kv.answer(Q, enc, target=4, budget=0.05, strict=True, max_new_tokens=1)
    assert strict.stats.recomputed_tokens == strict.stats.budget_tokens and strict.stats.overspend_tokens == 0
    run = kv.prefill(Q, enc, target=4, budget=0.05, strict=True)
    assert run.decision.plan.recompute[4].tolist() == list(range(strict.stats.budget_tokens))  # the target's start


def test_insert_full_kv_uses_the_full_prefill_slice_of_the_target(kv, enc):
    run = kv.prefill(Q, enc, strategy="insert_full_kv", target=1)
    order = run.decision.plan.order
    assert order[-1] == 1 and run.prefill.recomputed_tokens == 0
    ref = full_prefill(kv.model, kv.prompt_ids(Q, [c.token_ids.tolist() for c in enc], order))
    P = len(kv.prefix)
    begin = P + sum(len(enc[c]) for c in order[:-1])
    want_k, want_v = stacked_kv(ref.cache, 0, begin, begin + len(enc[1]))
    got_k, got_v = stacked_kv(run.prefill.cache, 0, begin, begin + len(enc[1]))
    assert (got_k - want_k).abs().max() < 1e-5 and (got_v - want_v).abs().max() < 1e-5
    assert run.probe.extra_token_layers == (P + sum(len(c) for c in enc)) * kv.model.config.num_hidden_layers


def test_token_select_picks_the_highest_deviation_tokens(kv):
    """Chunks carry their exact full-prefill KV except a few tokens whose layer-1 values are corrupted."""
    chunks = kv.encode(CHUNKS)
    ref = full_prefill(kv.model, kv.prompt_ids(Q, [c.token_ids.tolist() for c in chunks], range(5)))
    pos, exact = len(kv.prefix), []
    for c in chunks:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(c))
        exact.append(ChunkKV(c.token_ids, k, v, start=pos, encoder=c.encoder))
        pos += len(c)
    planted = {1: [3, 7], 3: [0], 4: [10, 11, 12]}
    for c, offsets in planted.items():
        exact[c].values[1, :, offsets] += 3.0 * torch.arange(1, len(offsets) + 1).view(1, -1, 1)
    probe = Probe(kv.model, kv.repositioner, kv.prefix, exact, kv.layout.suffix_ids(Q))
    deviation = probe.value_deviation(range(5))
    assert deviation.max() > 1.0 and sorted(deviation.topk(6).indices.tolist()) == sorted(
        sum(len(exact[i]) for i in range(c)) + o for c, offs in planted.items() for o in offs
    )
    total = sum(len(c) for c in exact)
    run = kv.prefill(Q, exact, strategy="token_select", budget=6 / total + 1e-6)
    assert {c: s.tolist() for c, s in run.decision.plan.recompute.items()} == planted
    assert run.probe.extra_token_layers == total  # one layer over every context token
    # deviation of exact KV is zero up to float error; of separately encoded chunks it is not
    clean = Probe(
        kv.model,
        kv.repositioner,
        kv.prefix,
        [ChunkKV(c.token_ids, c.keys, c.values.clone(), c.start) for c in ref_chunks(kv, ref, chunks)],
        [],
    ).value_deviation(range(5))
    assert clean.max() < 1e-8
    stale = Probe(kv.model, kv.repositioner, kv.prefix, chunks, []).value_deviation(range(5))
    assert stale[len(chunks[0]) :].max() > 1e-4 and stale[: len(chunks[0])].max() < 1e-8


def ref_chunks(kv, ref, chunks):
    pos, out = len(kv.prefix), []
    for c in chunks:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(c))
        out.append(ChunkKV(c.token_ids, k, v, start=pos))
        pos += len(c)
    return out


@pytest.mark.parametrize("loud", [0, 3])
def test_attention_select_picks_the_chunk_the_question_attends_to(kv, loud):
    """One chunk's keys are scaled up, so the question's attention concentrates on it."""
    chunks = kv.encode(CHUNKS)
    chunks[loud] = ChunkKV(
        chunks[loud].token_ids, chunks[loud].keys * 25, chunks[loud].values, chunks[loud].start, chunks[loud].encoder
    )
    probe = Probe(kv.model, kv.repositioner, kv.prefix, chunks, kv.layout.suffix_ids(Q))
    mass = probe.chunk_attention(range(5))
    assert int(mass.argmax()) == loud
    a = kv.answer(Q, chunks, strategy="attention_select", target=4, max_new_tokens=1)
    assert a.stats.picker == "attention" and a.stats.target == loud and a.stats.order[-1] == loud
    assert a.stats.target_correct == (loud == 4)
    suffix = len(kv.layout.suffix_ids(Q))
    assert a.stats.extra_token_layers == suffix * kv.model.config.num_hidden_layers
    assert kv.model.config._attn_implementation == "kvrag_sdpa"  # restored after the eager pass


def test_hybrid_spends_the_leftover_outside_the_target(kv, enc):
    lengths = lengths_of(kv)
    run = kv.prefill(Q, enc, strategy="hybrid", target=3, budget=0.5)
    plan = run.decision.plan
    assert plan.order[-1] == 3 and plan.recompute[3].numel() == lengths[3]
    assert run.prefill.recomputed_tokens == run.decision.budget_tokens
    short = kv.prefill(Q, enc, strategy="hybrid", target=4, budget=0.05)
    assert list(short.decision.plan.recompute) == [4] and short.probe.extra_token_layers == 0  # nothing left over


# -- property tests ---------------------------------------------------------------------------------------

PROBE_FREE = [
    "reuse",
    "reorder",
    "spread",
    "spread_chunks",
    "target_recompute",
    "target_in_place",
    "target_first",
    "target_spread",
    "top2_recompute",
    "tempered",
    "target_tempered",
]


@st.composite
def requests(draw):
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    n = len(lengths)
    return dict(
        lengths=lengths,
        target=draw(st.integers(0, n - 1)),
        scores=draw(st.none() | st.lists(st.floats(-1, 1), min_size=n, max_size=n)),
        budget=draw(st.floats(0.001, 1.0)),
        strict=draw(st.booleans()),
        name=draw(st.sampled_from(PROBE_FREE)),
    )


@given(requests())
@settings(max_examples=300, deadline=None)
def test_plans_are_valid_and_keep_their_budget(req):
    decision = plan_of(
        req["name"],
        req["lengths"],
        target=req["target"],
        scores=req["scores"],
        budget=req["budget"],
        strict=req["strict"],
    )
    plan = decision.plan
    assert sorted(plan.order) == list(range(len(req["lengths"])))
    recomputed = recomputed_tokens(plan, req["lengths"])
    if req["name"] in ("spread", "spread_chunks"):
        assert recomputed <= decision.budget_tokens and decision.target not in plan.recompute
    if req["name"] == "target_recompute":
        assert plan.order[-1] == decision.target
        assert recomputed == (
            min(req["lengths"][decision.target], decision.budget_tokens)
            if req["strict"]
            else req["lengths"][decision.target]
        )
    if req["name"] in ("reuse", "reorder", "tempered"):
        assert recomputed == 0
    if req["name"] == "tempered":
        assert set(plan.key_scale) == set(range(len(req["lengths"])))
    target, lengths = decision.target, req["lengths"]
    if target is None:
        return
    whole = min(lengths[target], decision.budget_tokens) if req["strict"] else lengths[target]
    if req["name"] == "target_in_place":
        assert plan.order == list(range(len(lengths))) and list(plan.recompute) == ([target] if whole else [])
    if req["name"] == "target_first":
        assert plan.order[0] == target and recomputed == whole
    if req["name"] == "target_spread":
        assert plan.order[-1] == target and recomputed - whole <= decision.budget_tokens
        assert all(s.tolist() == list(range(len(s))) for c, s in plan.recompute.items() if c != target)
    if req["name"] == "top2_recompute" and len(lengths) > 1:
        assert plan.order[-1] == target and set(plan.recompute) == set(plan.order[-2:]) - (
            {target} if not whole else set()
        )
    if req["name"] == "target_tempered":
        assert set(plan.key_scale) == set(range(len(lengths))) - {target}


# -- beyond the study's recipe ------------------------------------------------------------------------------


def test_target_in_place_and_first_keep_or_move_the_target(kv, enc):
    in_place = kv.prefill(Q, enc, strategy="target_in_place", target=2).decision.plan
    assert in_place.order == [0, 1, 2, 3, 4] and in_place.recompute[2].tolist() == list(range(len(enc[2])))
    first = kv.prefill(Q, enc, strategy="target_first", target=2).decision.plan
    assert first.order == [2, 0, 1, 3, 4] and list(first.recompute) == [2]


def test_top2_moves_the_two_best_last_and_recomputes_both(kv, enc):
    run = kv.prefill(Q, enc, strategy="top2_recompute", scores=[0.1, 0.7, 0.2, 0.9, 0.3])
    plan = run.decision.plan
    assert plan.order == [0, 2, 4, 1, 3] and run.decision.target == 3
    assert run.prefill.recomputed_tokens == len(enc[1]) + len(enc[3])


def test_target_spread_adds_the_budget_on_the_other_chunks_first_tokens(kv, enc):
    run = kv.prefill(Q, enc, strategy="target_spread", target=4, budget=0.2)
    plan, budget = run.decision.plan, run.decision.budget_tokens
    assert plan.order[-1] == 4 and run.prefill.recomputed_tokens == len(enc[4]) + budget
    assert all(
        plan.recompute[c].tolist() == list(range(len(plan.recompute[c]))) for c in range(4) if c in plan.recompute
    )


def test_tempered_scales_the_reused_keys_and_nothing_else(kv, enc):
    reuse = kv.prefill(Q, enc, strategy="reuse").prefill
    tempered = kv.prefill(Q, enc, strategy="tempered").prefill
    P, n = len(kv.prefix), sum(len(c) for c in enc)
    for a, b in zip(reuse.cache.layers, tempered.cache.layers):
        assert torch.equal(a.keys[:, :, :P], b.keys[:, :, :P]) and torch.equal(
            a.values[:, :, : P + n], b.values[:, :, : P + n]
        )
        assert torch.allclose(a.keys[:, :, P : P + n] / TEMPER_T, b.keys[:, :, P : P + n], rtol=1e-6, atol=1e-6)
    run = kv.prefill(Q, enc, strategy="target_tempered", target=1)
    assert 1 in run.decision.plan.recompute and 1 not in run.decision.plan.key_scale
    assert not torch.allclose(reuse.logits, tempered.logits)


def test_a_key_scale_of_one_is_plain_reuse(kv, enc):
    from kvrag.plan.strategies import register_strategy

    @register_strategy("unit_scale_test")
    def _unit(request):
        return Plan(order=list(range(len(request.lengths))), key_scale={c: 1.0 for c in range(len(request.lengths))})

    try:
        same = kv.prefill(Q, enc, strategy="unit_scale_test").prefill.logits
        assert torch.equal(same, kv.prefill(Q, enc, strategy="reuse").prefill.logits)
    finally:
        del STRATEGIES["unit_scale_test"]


def test_full_prefill_baselines_run_the_best_chunks_alone(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    top1 = kv.prefill(Q, enc, strategy="full_prefill_top1", scores=scores)
    ids = [c.token_ids.tolist() for c in enc]
    with torch.inference_mode():
        want = kv.model(input_ids=torch.tensor([kv.prompt_ids(Q, ids, [3])]), logits_to_keep=1).logits[0, -1]
    assert top1.decision.plan.order == [3] and torch.equal(top1.prefill.logits[-1], want.float())
    assert top1.context_tokens == len(enc[3]) == top1.prefill.recomputed_tokens
    top3 = kv.prefill(Q, enc, strategy="full_prefill_top3", scores=scores).decision.plan
    assert top3.order == [1, 3, 4]  # the three best, in the given order
    answer = kv.answer(Q, enc, strategy="full_prefill_top1", scores=scores, max_new_tokens=1)
    assert answer.stats.prompt_tokens == len(kv.prompt_ids(Q, ids, [3]))


def test_a_plan_that_leaves_chunks_out_stitches_the_rest_exactly(kv, enc):
    """Reuse over a subset order equals full prefill over that subset when the chunks' KV is exact."""
    from kvrag.plan.strategies import register_strategy

    ids = [c.token_ids.tolist() for c in enc]
    order = [4, 1]
    ref = full_prefill(kv.model, kv.prompt_ids(Q, ids, order))
    P, exact, pos = len(kv.prefix), list(enc), len(kv.prefix)
    for c in order:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(enc[c]))
        exact[c] = ChunkKV(enc[c].token_ids, k, v, start=pos, encoder=enc[c].encoder)
        pos += len(enc[c])

    @register_strategy("subset_test")
    def _subset(request):
        return Plan(order=order)

    try:
        run = kv.prefill(Q, exact, strategy="subset_test")
        assert (run.prefill.logits[-1] - ref.logits[-1]).abs().max() < 1e-4
        assert run.context_tokens == len(enc[4]) + len(enc[1]) and P == len(kv.prefix)
    finally:
        del STRATEGIES["subset_test"]


def test_a_lead_is_encoded_before_every_chunk_and_never_enters_the_prompt(kv):
    from kvrag.model.kvmodel import DEFAULT_LEAD

    led = kv.with_lead(DEFAULT_LEAD)
    chunks = led.encode(CHUNKS)
    behind = led.chunk_prefix_ids
    assert len(behind) > len(kv.prefix) and chunks[0].start == len(behind)
    with torch.inference_mode():
        ref = full_prefill(kv.model, behind + chunks[2].token_ids.tolist())
    k, v = stacked_kv(ref.cache, 0, len(behind), len(behind) + len(chunks[2]))
    assert (chunks[2].keys - k).abs().max() < 1e-5 and (chunks[2].values - v).abs().max() < 1e-5
    # every context token recomputed: full prefill of the prompt without the lead, whatever the KV believed
    from kvrag.plan.strategies import register_strategy

    @register_strategy("all_tokens_test")
    def _all(request):
        return Plan(
            order=list(range(len(request.lengths))),
            recompute={c: torch.arange(n) for c, n in enumerate(request.lengths)},
        )

    try:
        run = led.prefill(Q, chunks, strategy="all_tokens_test")
        ids = [c.token_ids.tolist() for c in chunks]
        want = full_prefill(kv.model, kv.prompt_ids(Q, ids, range(5)))
        assert (run.prefill.logits[-1] - want.logits[-1]).abs().max() < 1e-4
    finally:
        del STRATEGIES["all_tokens_test"]
    assert led.encoder_id != kv.encoder_id and led.chunk_key(chunks[0]) != kv.chunk_key(chunks[0])
    with pytest.raises(InvalidRequestError, match="encoded by another model, dtype or prompt prefix"):
        kv.prefill(Q, chunks)
    assert led.answer(Q, chunks, target=4, max_new_tokens=2).stats.recomputed_tokens == len(chunks[4])
    assert led.prefill(Q, chunks, picker="likelihood").decision.target in range(5)


def test_top3_exact_is_exactly_full_prefill_over_the_three_best_chunks(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    exact = kv.prefill(Q, enc, strategy="top3_exact", scores=scores)
    top3 = kv.prefill(Q, enc, strategy="full_prefill_top3", scores=scores)
    assert exact.decision.plan.order == top3.decision.plan.order == [1, 3, 4]
    assert exact.prefill.recomputed_tokens == len(enc[3]) + len(enc[4])  # the first chunk's KV is reused as is
    assert (exact.prefill.logits[-1] - top3.prefill.logits[-1]).abs().max() < 1e-4
    a = kv.answer(Q, enc, strategy="top3_exact", scores=scores, max_new_tokens=6)
    b = kv.answer(Q, enc, strategy="full_prefill_top3", scores=scores, max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.stats.context_tokens == len(enc[1]) + len(enc[3]) + len(enc[4])


def test_top3_target_last_is_exactly_full_prefill_over_the_two_best_others_then_the_target(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    run = kv.prefill(Q, enc, strategy="top3_target_last", target=0, scores=scores)
    assert run.decision.plan.order == [1, 3, 0] and run.prefill.recomputed_tokens == len(enc[3]) + len(enc[0])
    ids = [c.token_ids.tolist() for c in enc]
    with torch.inference_mode():
        want = kv.model(input_ids=torch.tensor([kv.prompt_ids(Q, ids, [1, 3, 0])]), logits_to_keep=1).logits[0, -1]
    assert (run.prefill.logits[-1] - want.float()).abs().max() < 1e-4
    assert kv.prefill(Q, enc, strategy="top3_target_last", target=3, scores=scores).decision.plan.order == [1, 4, 3]


def test_target_only_is_exactly_full_prefill_over_that_chunk_at_the_cost_of_the_suffix(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    only = kv.prefill(Q, enc, strategy="target_only", scores=scores)
    top1 = kv.prefill(Q, enc, strategy="full_prefill_top1", scores=scores)
    assert only.decision.plan.order == top1.decision.plan.order == [3] and only.prefill.recomputed_tokens == 0
    assert (only.prefill.logits[-1] - top1.prefill.logits[-1]).abs().max() < 1e-4
    a = kv.answer(Q, enc, strategy="target_only", scores=scores, max_new_tokens=6)
    b = kv.answer(Q, enc, strategy="full_prefill_top1", scores=scores, max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.stats.context_tokens == len(enc[3])


def test_set_only_is_exactly_full_prefill_over_the_picked_set_in_the_given_order(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    run = kv.prefill(Q, enc, strategy="set_only", picker="top2", scores=scores)
    assert run.decision.targets == [3, 1] and run.decision.plan.order == [1, 3]
    assert run.prefill.recomputed_tokens == len(enc[3])  # the first chunk's stored KV is its full-prefill KV
    ids = [c.token_ids.tolist() for c in enc]
    with torch.inference_mode():
        want = kv.model(input_ids=torch.tensor([kv.prompt_ids(Q, ids, [1, 3])]), logits_to_keep=1).logits[0, -1]
    assert (run.prefill.logits[-1] - want.float()).abs().max() < 1e-4
    a = kv.answer(Q, enc, strategy="set_only", picker="top2", scores=scores, max_new_tokens=6)
    assert a.stats.targets == [3, 1] and a.stats.context_tokens == len(enc[1]) + len(enc[3])


def test_set_recompute_moves_the_set_last_and_recomputes_it(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    run = kv.prefill(Q, enc, strategy="set_recompute", picker="top3", scores=scores)
    plan = run.decision.plan
    assert plan.order == [0, 2, 1, 3, 4] and sorted(plan.recompute) == [1, 3, 4]
    assert run.prefill.recomputed_tokens == len(enc[1]) + len(enc[3]) + len(enc[4])
    one = kv.prefill(Q, enc, strategy="set_recompute", target=2)  # the oracle's set of one: target_recompute
    tr = kv.prefill(Q, enc, strategy="target_recompute", target=2)
    assert one.decision.plan.order == tr.decision.plan.order and torch.equal(one.prefill.logits, tr.prefill.logits)


def test_set_recompute_over_exact_kv_of_the_rest_is_full_prefill(kv, enc):
    """The set already last (its order kept): with the other chunks' KV sliced from a full prefill, recomputing the
    set gives full prefill's logits; with their stored (alone-encoded) KV it does not, so the check can fail."""
    ids = [c.token_ids.tolist() for c in enc]
    prompt = kv.prompt_ids(Q, ids, range(5))
    ref = full_prefill(kv.model, prompt)
    exact, at = [], len(kv.prefix)
    for chunk in enc:
        k, v = stacked_kv(ref.cache, 0, at, at + len(chunk))
        exact.append(ChunkKV(chunk.token_ids, k, v, start=at, encoder=chunk.encoder))
        at += len(chunk)
    scores = [0.1, 0.2, 0.3, 0.9, 0.8]
    run = kv.prefill(Q, exact, strategy="set_recompute", picker="top2", scores=scores)
    assert run.decision.plan.order == [0, 1, 2, 3, 4] and sorted(run.decision.plan.recompute) == [3, 4]
    assert (run.prefill.logits[-1] - ref.logits[-1]).abs().max() < 1e-4
    stored = kv.prefill(Q, enc, strategy="set_recompute", picker="top2", scores=scores)
    assert (stored.prefill.logits[-1] - ref.logits[-1]).abs().max() > 1e-3
