"""kvrag.plan.pickers: which chunk is the target, by score, the model's own reading, words, or the known target."""

import pytest
import torch
from tiny import STRATEGY_CHUNKS as CHUNKS
from tiny import STRATEGY_QUESTION as Q
from tiny import byte_tokenizer, tiny_model

from kvrag import InvalidRequestError, KVModel
from kvrag.cache.chunks import ChunkSource
from kvrag.plan.pickers import GAP, LIKELIHOOD_CANDIDATES
from kvrag.plan.probe import Probe


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


@pytest.fixture(scope="module")
def enc(kv):
    return kv.encode(CHUNKS)


def test_pickers_and_their_errors(kv, enc):
    assert kv.answer(Q, enc, scores=[0, 0, 0, 0, 1.0], max_new_tokens=1).stats.picker == "retriever"
    a = kv.answer(Q, enc, picker="retriever", scores=[0, 1.0, 0, 0, 0], target=4, max_new_tokens=1)
    assert a.stats.target == 1 and a.stats.target_given == 4 and a.stats.target_correct is False
    assert kv.answer(Q, enc, target=2, max_new_tokens=1).stats.picker == "oracle"
    with pytest.raises(
        InvalidRequestError,
        match="unknown picker 'best': use one of attention, diverse2, fused, gap, lexical, likelihood, likelihood2, "
        "likelihood_all, oracle, retriever, top2, top3",
    ):
        kv.answer(Q, enc, picker="best", max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="oracle picker needs the known target"):
        kv.answer(Q, enc, picker="oracle", max_new_tokens=1)
    with pytest.raises(InvalidRequestError, match="target 9 is not a chunk index"):
        kv.answer(Q, enc, strategy="spread", target=9, max_new_tokens=1)
    for budget in (0, -0.1, 1.01, float("nan")):
        with pytest.raises(InvalidRequestError, match=r"budget must be a fraction of context tokens in \(0, 1\]"):
            kv.answer(Q, enc, strategy="token_select", budget=budget, max_new_tokens=1)


def test_the_likelihood_picker_scores_each_chunk_as_a_plain_forward_would(kv, enc):
    probe = kv.prefill(Q, enc, strategy="target_recompute", picker="likelihood").probe
    got = probe.question_likelihood()
    suffix = kv.layout.suffix_ids(Q)
    for c, chunk in enumerate(enc):
        ids = kv.layout.prefix_ids + chunk.token_ids.tolist() + suffix
        with torch.inference_mode():
            logits = kv.model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[-len(suffix) : -1], -1)
        want = logp.gather(-1, torch.tensor(suffix[1:]).view(-1, 1)).mean()
        assert abs(float(got[c]) - float(want)) < 1e-4
    layers = kv.model.config.num_hidden_layers
    scores = [0.3, 0.1, 0.5, 0.9, 0.2]  # the retriever's best three: chunks 3, 2 and 0
    run = kv.prefill(Q, enc, strategy="target_recompute", picker="likelihood", scores=scores)
    assert LIKELIHOOD_CANDIDATES == 3
    assert run.decision.target == max((3, 2, 0), key=lambda c: float(got[c])) and run.decision.picker == "likelihood"
    assert run.probe.extra_token_layers == 3 * len(suffix) * layers  # the candidates' suffixes, not all five


def test_question_likelihood_over_candidates_scores_them_alone_and_reads_only_their_kv():
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    chunks = ChunkSource(kv).chunks(CHUNKS)
    suffix = kv.layout.suffix_ids(Q)
    with kv.lock:
        every = Probe.of(kv, ChunkSource(kv).chunks(CHUNKS), suffix, Q).question_likelihood()
        probe = Probe.of(kv, chunks, suffix, Q)
        got = probe.question_likelihood([4, 1])
    assert chunks.encoded == 2  # only the candidates' KV was read
    assert torch.allclose(got[[1, 4]], every[[1, 4]], atol=1e-5)
    assert got[[0, 2, 3]].tolist() == [float("-inf")] * 3
    assert probe.extra_token_layers == 2 * len(suffix) * kv.model.config.num_hidden_layers
    with pytest.raises(ValueError, match="not all chunk indices in 0..4"):
        probe.question_likelihood([5])


def test_the_lexical_picker_fuses_the_question_words_with_the_scores(kv, enc):
    # dense scores tie chunks 2 and 4; only chunk 4 shares the question's words ("archive", "open")
    run = kv.prefill(Q, enc, strategy="target_recompute", picker="lexical", scores=[0.1, 0.1, 0.5, 0.1, 0.5])
    assert run.decision.target == 4
    fused = kv.prefill(Q, enc, strategy="target_recompute", picker="fused", scores=[0.1, 0.1, 0.5, 0.1, 0.5])
    assert fused.decision.target in range(5) and fused.probe.extra_token_layers > 0


def test_the_retriever_without_scores_takes_the_first_of_a_ranked_list():
    from kvrag.plan.pickers import get_picker

    assert get_picker("retriever")(3, None, None, None) == 0
    assert get_picker("retriever")(3, [0.2, 0.9, 0.9], None, None) == 1  # ties go to the earlier chunk
    assert get_picker("oracle")(3, None, 2, None) == 2


def test_set_pickers_choose_several_chunks_best_first(kv, enc):
    scores = [0.1, 0.7, 0.2, 0.9, 0.3]
    for picker, want in (("top2", [3, 1]), ("top3", [3, 1, 4])):
        run = kv.prefill(Q, enc, strategy="set_recompute", picker=picker, scores=scores)
        assert run.decision.targets == want and run.decision.target == want[0]
    likely = kv.prefill(Q, enc, strategy="set_recompute", picker="likelihood2", scores=scores)
    measured = likely.probe.question_likelihood([3, 1, 4, 2])  # the retriever's best SET_CANDIDATES
    assert likely.decision.targets == sorted([3, 1, 4, 2], key=lambda c: -float(measured[c]))[:2]
    # a picker of one target leaves a set of one
    assert kv.prefill(Q, enc, strategy="set_recompute", scores=scores).decision.targets == [3]


def test_the_diverse_picker_pairs_the_best_with_the_least_overlapping_of_the_next(kv):
    texts = [
        "The lighthouse of Karsa was built in 1872.",
        "The lighthouse of Karsa was built by Mira Holt.",  # the same entity again: skipped
        "Velloria's harbour holds forty ships.",
        "The lighthouse of Karsa stands on a cliff.",
    ]
    run = kv.prefill("When was the lighthouse built and how many ships?", texts, strategy="set_recompute",
                     picker="diverse2", scores=[0.9, 0.8, 0.5, 0.6])
    assert run.decision.targets == [0, 2]


def test_the_gap_picker_pays_the_likelihood_pass_only_where_the_retriever_is_unsure(kv, enc):
    clear = [0.1, 0.1 + GAP + 0.01, 0.05, 0.0, 0.02]  # chunk 1 leads by more than GAP
    sure = kv.answer(Q, enc, strategy="target_only", picker="gap", scores=clear, max_new_tokens=1)
    assert sure.stats.target == 1 and sure.stats.extra_work == []  # the retriever's pick, no pass
    close = [0.1, 0.1 + GAP - 0.01, 0.05, 0.0, 0.02]
    unsure = kv.answer(Q, enc, strategy="target_only", picker="gap", scores=close, max_new_tokens=1)
    likely = kv.answer(Q, enc, strategy="target_only", picker="likelihood", scores=close, max_new_tokens=1)
    assert unsure.stats.target == likely.stats.target and unsure.stats.extra_work == likely.stats.extra_work != []
    assert unsure.token_ids == likely.token_ids
    ranked = kv.answer(Q, enc, strategy="target_only", picker="gap", max_new_tokens=1)  # no scores: the likelihood
    assert ranked.stats.extra_work != []
