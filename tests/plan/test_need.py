"""The plan chosen by need (kvrag.plan.need): each of its three outcomes on a tiny model, exact where it says so,
and what it reports (the reason, the signals, the chunks read, the abstention on every path)."""

import pytest
import torch
from tiny import STRATEGY_CHUNKS as CHUNKS
from tiny import STRATEGY_QUESTION as Q
from tiny import byte_tokenizer, tiny_model

from kvrag import KVModel
from kvrag.answer import NOT_IN_DOCUMENTS, Answer
from kvrag.plan import need

SCORES = [0.1, 0.7, 0.2, 0.9, 0.3]


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


@pytest.fixture(scope="module")
def enc(kv):
    return kv.encode(CHUNKS)


def measured(kv, enc):
    """The signals by_need reads, as it reads them."""
    return kv.answer(Q, enc, strategy="by_need", scores=SCORES, max_new_tokens=1).stats.signals


def test_signals_are_the_likelihood_lift_and_margin_over_every_chunk(kv, enc):
    run = kv.prefill(Q, enc, strategy="target_only", picker="likelihood_all", scores=SCORES)
    seen = measured(kv, enc)
    assert int(seen["best"]) == run.decision.target and int(seen["retriever_best"]) == 3
    assert seen["margin"] >= 0 and set(seen) == {"best", "retriever_best", "lift", "margin", "named"}
    # every chunk is scored, in one pass, and the question alone once: a chunk past the retriever's top three counts
    probe = kv.prefill(Q, enc, strategy="by_need", scores=SCORES).probe
    assert sum("question likelihood" in w for w in probe.extra_work) == 1
    assert any("5 chunks" in w for w in probe.extra_work) and any("question alone" in w for w in probe.extra_work)


def test_one_chunk_is_exactly_that_chunk_alone(kv, enc, monkeypatch):
    monkeypatch.setattr(need, "names", lambda request: {})  # the branch alone: the names' chunks are tested below
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    monkeypatch.setattr(need, "ONE_CHUNK_MARGIN", float("-inf"))
    monkeypatch.setattr(need, "AGREE_MARGIN", float("-inf"))
    a = kv.answer(Q, enc, strategy="by_need", scores=SCORES, max_new_tokens=6)
    best = int(a.stats.signals["best"])
    b = kv.answer(Q, enc, strategy="target_only", target=best, picker="oracle", max_new_tokens=6)
    assert a.stats.order == [best] and a.token_ids == b.token_ids and not a.abstained
    assert a.stats.reason.startswith("one chunk") and a.stats.recomputed_tokens == 0


def test_several_chunks_are_exactly_full_prefill_over_them_with_the_best_last(kv, enc, monkeypatch):
    monkeypatch.setattr(need, "names", lambda request: {})
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    monkeypatch.setattr(need, "ONE_CHUNK_MARGIN", float("inf"))
    monkeypatch.setattr(need, "AGREE_MARGIN", float("inf"))
    scores = list(SCORES)
    best = int(measured(kv, enc)["best"])
    if best == 3:  # the retriever must disagree with the model for several chunks to be read
        scores[3], scores[1] = scores[1], scores[3]
        scores[best] = 0.0
        scores[(best + 1) % 5] = 0.95
    run = kv.prefill(Q, enc, strategy="by_need", scores=scores)
    order = run.decision.plan.order
    assert len(order) == need.SEVERAL and order[-1] == best and sorted(order[:-1]) == order[:-1]
    ids = [c.token_ids.tolist() for c in enc]
    with torch.inference_mode():
        want = kv.model(input_ids=torch.tensor([kv.prompt_ids(Q, ids, order)]), logits_to_keep=1).logits[0, -1]
    assert (run.prefill.logits[-1] - want.float()).abs().max() < 1e-4
    assert run.decision.plan.reason.startswith(f"{need.SEVERAL} chunks")



@pytest.mark.parametrize("name", ["by_need_reuse", "by_need_spread", "by_need_two"])
def test_the_variants_of_several_chunks_recompute_what_they_say(kv, enc, monkeypatch, name):
    monkeypatch.setattr(need, "names", lambda request: {})
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    monkeypatch.setattr(need, "ONE_CHUNK_MARGIN", float("inf"))
    monkeypatch.setattr(need, "AGREE_MARGIN", float("inf"))
    monkeypatch.setattr(need, "SPREAD_TOKENS", 3)
    best = int(measured(kv, enc)["best"])
    scores = [0.0 if c == best else s for c, s in enumerate(SCORES)]  # the retriever disagrees with the model
    plan = kv.prefill(Q, enc, strategy=name, scores=scores).decision.plan
    exact = kv.prefill(Q, enc, strategy="by_need", scores=scores).decision.plan
    assert plan.order[-1] == best and plan.reason.startswith(f"{len(plan.order)} chunks")
    recomputed = {c: t.tolist() for c, t in plan.recompute.items()}
    kept = plan.order[0]  # the first chunk, encoded alone, is in place: never recomputed
    if name == "by_need_two":
        assert len(plan.order) == 2 and plan.order[0] in exact.order
        assert recomputed == {best: list(range(len(enc[best])))}
    else:
        assert plan.order == exact.order and len(plan.order) == need.SEVERAL
        first = {"by_need_reuse": 0, "by_need_spread": 3}[name]
        others = {c: list(range(first)) for c in plan.order[1:-1]} if first else {}
        assert recomputed == {best: list(range(len(enc[best]))), **others} and kept not in recomputed


TWO_THINGS = "When is the archive open, and what is in the harbour ledger?"


def test_every_name_of_the_question_is_read_and_the_plan_stays_exact(kv, enc, monkeypatch):
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    monkeypatch.setattr(need, "ONE_CHUNK_MARGIN", float("-inf"))
    monkeypatch.setattr(need, "AGREE_MARGIN", float("-inf"))
    run = kv.prefill(TWO_THINGS, CHUNKS, strategy="by_need", scores=SCORES)
    plan, best = run.decision.plan, run.decision.target
    # "archive" is chunk 4's word alone, "harbour" and "ledger" chunk 1's: a one-chunk plan reads both of them
    assert {1, 4} <= set(plan.order) and plan.order[-1] == best and len(plan.order) <= need.MOST_READ
    assert plan.signals["named"] == len(plan.order) - 1 and "names" in plan.reason
    ids = [kv.layout.chunk_ids(c) for c in CHUNKS]
    with torch.inference_mode():
        want = kv.model(input_ids=torch.tensor([kv.prompt_ids(TWO_THINGS, ids, plan.order)]), logits_to_keep=1)
    assert (run.prefill.logits[-1] - want.logits[0, -1].float()).abs().max() < 1e-4


def test_names_are_content_words_few_chunks_hold(kv, enc):
    from types import SimpleNamespace

    def names(question, texts):
        return need.names(SimpleNamespace(probe=SimpleNamespace(question=question, texts=texts)))

    assert names(TWO_THINGS, CHUNKS) == {"archive": [4], "harbour": [1], "ledger": [1]}  # "when", "and": stop words
    # a word more than half the chunks hold tells none of them apart; one no chunk holds names nothing here
    assert names("Which station logs ships?", ["a station", "the station", "station logs", "x"]) == {"logs": [2]}
    assert need.names(SimpleNamespace(probe=None)) == {}


def test_abstaining_keeps_the_draft_and_says_so_on_every_path(kv, enc, monkeypatch):
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("inf"))
    a = kv.answer(Q, enc, strategy="by_need", scores=SCORES, max_new_tokens=6)
    best = int(a.stats.signals["best"])
    b = kv.answer(Q, enc, strategy="target_only", target=best, picker="oracle", max_new_tokens=6)
    assert a.abstained and a.text == NOT_IN_DOCUMENTS and a.draft == b.text and a.token_ids == b.token_ids
    assert a.to_dict()["abstained"] is True and a.to_dict()["draft"] == b.text
    pieces = list(kv.stream(Q, enc, strategy="by_need", scores=SCORES, max_new_tokens=6))
    assert [p for p in pieces if isinstance(p, str)] == [NOT_IN_DOCUMENTS]
    assert isinstance(pieces[-1], Answer) and pieces[-1].abstained
    # a question answered in parts abstains when every part does
    parts = kv.answer(Q, enc, strategy="by_need", scores=SCORES, parts=[Q, Q + "?"], max_new_tokens=4)
    assert parts.abstained and parts.text == NOT_IN_DOCUMENTS and all(p.abstained for p in parts.parts)


def _saying(ids):
    def decode(self, prefill, sampling):  # the executor's decode, yielding the given tokens
        yield from ids

    return decode


def test_an_abstention_is_said_at_the_first_token_with_the_draft_decoded_behind_it(kv, enc, monkeypatch):
    from kvrag.run.executor import HFExecutor

    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("inf"))
    stepped = []

    def decode(self, prefill, sampling):
        for token in kv.tokenizer("a draft of several tokens", add_special_tokens=False)["input_ids"]:
            stepped.append(token)
            yield token

    monkeypatch.setattr(HFExecutor, "decode", decode)
    stream = kv.stream(Q, enc, strategy="by_need", scores=SCORES, max_new_tokens=32)
    assert next(stream) == NOT_IN_DOCUMENTS and len(stepped) == 1
    answer = list(stream)[-1]
    assert answer.abstained and answer.draft == "a draft of several tokens" and len(stepped) > 1


@pytest.mark.parametrize("words, declined", [(NOT_IN_DOCUMENTS + " Ask me again.", True),
                                             ("The harbour. " + NOT_IN_DOCUMENTS, False)])
def test_the_models_own_decline_in_kvrags_words_is_an_abstention(kv, enc, monkeypatch, words, declined):
    from kvrag.run.executor import HFExecutor

    ids = kv.tokenizer(words, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(HFExecutor, "decode", _saying(ids))
    a = kv.answer(Q, enc, strategy="target_recompute", scores=SCORES, max_new_tokens=len(ids))
    assert a.text == words and a.abstained is declined and a.to_dict()["abstained"] is declined
    assert a.draft == (words if declined else None)  # the model's words are the answer's text too
    pieces = list(kv.stream(Q, enc, strategy="target_recompute", scores=SCORES, max_new_tokens=len(ids)))
    assert "".join(p for p in pieces if isinstance(p, str)) == words and pieces[-1].abstained is declined


def test_a_named_plan_never_abstains(kv, enc, monkeypatch):
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("inf"))  # (only the model's own words can decline there)
    a = kv.answer(Q, enc, strategy="target_recompute", scores=SCORES, max_new_tokens=4)
    assert not a.abstained and a.draft is None and a.stats.reason == "" and a.to_dict()["abstained"] is False


def test_a_lone_chunk_is_read_alone_and_its_signals_are_plain_json(kv, enc, monkeypatch):
    import json

    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    a = kv.answer(Q, enc[:1], strategy="by_need", max_new_tokens=2)
    assert a.stats.order == [0] and a.stats.signals["margin"] == 0.0
    json.dumps(a.to_dict(), allow_nan=False)


@pytest.fixture(scope="module")
def in_context(kv):
    (run,) = kv.encode_in_context([CHUNKS])
    return run


def full_prefill_logits(kv, chunk_ids, order):
    with torch.inference_mode():
        return kv.model(input_ids=torch.tensor([kv.prompt_ids(Q, chunk_ids, order)]), logits_to_keep=1).logits[0, -1]


def test_one_documents_chunks_encoded_in_context_are_read_whole_in_its_order_with_no_pass_and_no_recompute(
    kv, in_context
):
    shuffled = [2, 0, 4, 1, 3]  # retrieval's order: the plan puts them back in the document's
    given = [in_context[i] for i in shuffled]
    run = kv.prefill(Q, given, strategy="by_need", scores=[SCORES[i] for i in shuffled])
    plan = run.decision.plan
    assert [shuffled[c] for c in plan.order] == [0, 1, 2, 3, 4] and not plan.recompute
    assert plan.reason.startswith("5 chunks of one document") and run.decision.picker is None
    assert not run.probe.extra_work  # no likelihood pass was paid for it
    ids = [c.token_ids.tolist() for c in given]
    assert (run.prefill.logits[-1] - full_prefill_logits(kv, ids, plan.order).float()).abs().max() < 1e-4


def test_a_run_with_a_chunk_missing_is_planned_by_need_and_stays_exact_over_what_it_reads(kv, in_context, monkeypatch):
    monkeypatch.setattr(need, "names", lambda request: {})
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    monkeypatch.setattr(need, "ONE_CHUNK_MARGIN", float("inf"))
    monkeypatch.setattr(need, "AGREE_MARGIN", float("inf"))
    given = in_context[1:]  # the run's first chunk is not there: no chunk is where it was encoded
    run = kv.prefill(Q, given, strategy="by_need", scores=SCORES[1:])
    plan = run.decision.plan
    assert not plan.reason.startswith("4 chunks of one document") and run.decision.picker == "likelihood_all"
    assert set(plan.recompute) == set(plan.order)  # each read behind other chunks than the ones it was encoded behind
    ids = [c.token_ids.tolist() for c in given]
    assert (run.prefill.logits[-1] - full_prefill_logits(kv, ids, plan.order).float()).abs().max() < 1e-4


def test_in_place_keeps_exactly_the_chunks_encoded_behind_what_precedes_them(kv, enc, in_context):
    from kvrag.plan.strategies import PlanRequest, in_place

    both = [*in_context[:3], enc[3]]  # a run's first three chunks, then one encoded alone

    def request(chunks):
        probe = kv.prefill(Q, chunks, strategy="reuse").probe
        return PlanRequest(lengths=[len(c) for c in chunks], target=None, budget=0.0, probe=probe)

    req = request(both)
    assert in_place(req, [0, 1, 2, 3]) == {0, 1, 2}
    assert in_place(req, [1, 0, 2, 3]) == set()  # chunk 0 is alone-like, but not first
    assert in_place(req, [3, 0, 1]) == {3}  # the alone chunk first; the run's chunks sit behind it
    assert need.document_order(req) is None  # the alone chunk belongs to no run
    assert need.document_order(request(in_context[:3][::-1])) == [2, 1, 0]
    assert need.document_order(request(list(enc))) is None  # chunks encoded alone are no document


def test_run_to_is_a_chunk_with_its_runs_earlier_chunks_where_all_were_given(kv, enc, in_context):
    from kvrag.plan.strategies import PlanRequest

    def request(chunks):
        probe = kv.prefill(Q, chunks, strategy="reuse").probe
        return PlanRequest(lengths=[len(c) for c in chunks], target=None, budget=0.0, probe=probe)

    req = request([in_context[2], enc[3], in_context[0], in_context[1]])
    assert need.run_to(req, 0) == [2, 3, 0]  # in the document's order, whatever the given order
    assert need.run_to(req, 3) == [2, 3] and need.run_to(req, 2) == [2]  # a run's first chunk: itself
    assert need.run_to(req, 1) == [1]  # encoded alone
    assert need.run_to(request(in_context[1:3]), 1) == [1]  # its run's first chunk was not given


@pytest.mark.parametrize("margin", [float("-inf"), float("inf")])  # the one-chunk branch, the several branch
def test_the_best_chunk_is_read_behind_its_runs_earlier_chunks_in_place_nothing_recomputed(
    kv, enc, in_context, monkeypatch, margin
):
    monkeypatch.setattr(need, "names", lambda request: {})
    monkeypatch.setattr(need, "ABSTAIN_LIFT", float("-inf"))
    monkeypatch.setattr(need, "ONE_CHUNK_MARGIN", margin)
    monkeypatch.setattr(need, "AGREE_MARGIN", margin)
    given = [*in_context[:3], *enc[3:]]  # a run's first three chunks, then two chunks encoded alone
    ids = [c.token_ids.tolist() for c in given]
    monkeypatch.setattr(need, "_target", lambda request: 2)  # the model's best: the run's third chunk
    run = kv.prefill(Q, given, strategy="by_need", scores=SCORES)
    plan = run.decision.plan
    assert plan.order == [0, 1, 2] and not plan.recompute and "with its run's 2 earlier chunks" in plan.reason
    assert (run.prefill.logits[-1] - full_prefill_logits(kv, ids, plan.order).float()).abs().max() < 1e-4
    monkeypatch.setattr(need, "_target", lambda request: 3)  # a chunk encoded alone: planned as before
    plan = kv.prefill(Q, given, strategy="by_need", scores=SCORES).decision.plan
    assert plan.order[-1] == 3 and len(plan.order) == (1 if margin < 0 else need.SEVERAL)


def test_past_most_scored_chunks_the_pass_scores_the_retrievers_best_only_and_reads_among_them(kv, enc, monkeypatch):
    from kvrag.plan import strategies

    most = strategies.MOST_SCORED
    assert strategies.scored(5, SCORES) is None and strategies.scored(most, None) is None  # every chunk, at a top-k
    assert strategies.scored(most + 8, None) == list(range(most))  # a ranked list: its first MOST_SCORED
    monkeypatch.setattr(strategies, "MOST_SCORED", 3)
    assert strategies.scored(5, SCORES) == [1, 3, 4]  # the retriever's best three, in their order
    probe = kv.prefill(Q, enc, strategy="by_need", scores=SCORES).probe
    (work,) = [w for w in probe.extra_work if "question likelihood" in w]
    assert "behind each of 3 chunks" in work  # one pass, over the three alone
    a = kv.answer(Q, enc, strategy="by_need", scores=SCORES, max_new_tokens=1)
    picked = kv.prefill(Q, enc, strategy="target_only", picker="likelihood_all", scores=SCORES).decision.target
    assert int(a.stats.signals["best"]) == picked and picked in (1, 3, 4)
