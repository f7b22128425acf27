"""The plan chosen by what a question needs: one chunk where one stands out, several where none does,
and "the documents do not say" where no retrieved chunk bears on the question.

The signals that choose the plan read how the model and the retriever see the chunks, never how the question is worded:
- the retriever's ranking of every retrieved chunk;
- the model's likelihood of the question behind each retrieved chunk's stored KV (one batched pass of the suffix,
  every chunk up to the retriever's best `MOST_SCORED`: `Probe.question_likelihood`), against its likelihood
  behind no chunk (`Probe.question_alone`). The best chunk's **lift** says how much any chunk bears on the
  question; its **margin** over the second best says whether one chunk stands out.

The plan: the chunks are one document's, encoded in its context (`KVRAG(encoding="document")`), all of one run ->
read them whole in the document's order (exactly its full prefill, nothing recomputed, nothing measured); else no
lift -> abstain (the one-chunk answer is decoded as a draft, the answer says the documents do not say); the model's
best chunk a later chunk of a run whose earlier chunks retrieval gave too (`kvrag.engine.runs`) -> that chunk behind
them in the document's order (in place: exactly the run's full prefill up to it, nothing recomputed, the document's
start that says what the chunk is about read with it); the model's best chunk leads the rest clearly -> that chunk
alone (exactly a full prefill over it, at the cost of the suffix: its pass was the likelihood pass; a chunk encoded
behind its document's earlier chunks is recomputed); else -> the best chunks by either ranking, stitched with the
model's best next to the question and every chunk not already in place recomputed (exactly a full prefill over those
chunks in that order). Whichever plan it reads, every name the question shares with the retrieved chunks is read: a
word of the question that one or a few retrieved chunks hold (what tells one document from its neighbours, whatever
the wording) pulls in the model's best chunk holding it, so a question about two things reads both. The thresholds
are chosen on held-out sources (docs/study.md).
`by_need_reuse` is the same plan with only the best of several chunks recomputed, `by_need_spread` with the others'
first SPREAD_TOKENS tokens recomputed too, `by_need_two` with two chunks read exactly: fewer tokens through the model,
measured beside the default in docs/study.md (not the default: by_need_reuse tied it on the choose half and lost an
item on the judge half, by_need_spread tied it there and lost two; by_need_two lost an item on the choose half).
"""

from __future__ import annotations

import torch

from kvrag.plan.strategies import Plan, PlanRequest, by_score, exact_over, register_strategy, scored, sits_after
from kvrag.rank import content_words, words
from kvrag.plan.strategies import target_of as _target

# The thresholds, in mean log-probability a question token, were chosen on the held-out choose half (kvrag.lab.heldout,
# docs/study.md) and judged on the other half. Below ABSTAIN_LIFT (best chunk against no chunk) no chunk bears on
# the question; above AGREE_MARGIN (the best chunk against the second, where the retriever's best is the model's
# too) or ONE_CHUNK_MARGIN (where it is not) one chunk stands out enough to be read alone.
ABSTAIN_LIFT = 0.1
AGREE_MARGIN = 0.75
ONE_CHUNK_MARGIN = 0.75
SEVERAL = 3  # chunks read where the signals disagree
SPREAD_TOKENS = 16  # by_need_spread: the first tokens recomputed of each chunk read beside the best
MOST_READ = 4  # chunks read at most once the question's names are covered
NAME_SHARE = 2  # a name is held by at most one in NAME_SHARE retrieved chunks (at least one chunk)


def signals(request: PlanRequest) -> dict[str, float]:
    """The measurements the plan is chosen on (the probe measures each once)."""
    probe = request.probe
    if probe is None:
        raise ValueError("by_need measures the question behind each chunk: it needs the request's probe")
    likelihood = _likelihood(request)
    ranked = sorted(range(len(request.lengths)), key=lambda c: (-float(likelihood[c]), c))
    best = ranked[0]
    return {
        "best": float(best),
        "retriever_best": float(by_score(request)[0]),
        "lift": float(likelihood[best]) - probe.question_alone(),
        # 0 for a lone chunk: nothing to stand out from (finite, so the signals stay plain JSON)
        "margin": float(likelihood[best] - likelihood[ranked[1]]) if len(ranked) > 1 else 0.0,
        "named": 0.0,  # chunks read for the question's names alone (set by the plan)
    }


def _likelihood(request: PlanRequest) -> torch.Tensor:
    """The question's likelihood behind each retrieved chunk (the retriever's best MOST_SCORED at most; the others
    -inf), measured once a request."""
    if request.probe is None:
        raise ValueError("by_need measures the question behind each chunk: it needs the request's probe")
    return request.probe.question_likelihood(scored(len(request.lengths), request.scores))


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


def names(request: PlanRequest) -> dict[str, list[int]]:
    """The question's names among the retrieved chunks, each with the chunks that hold it: its content words
    (`kvrag.rank.content_words`) that at least one and at most max(1, n / NAME_SHARE) of the n chunks hold (a
    document cut into several chunks names its subject in several). {} where the probe has no texts."""
    probe = request.probe
    try:
        texts = probe.texts if probe is not None else []
    except ValueError:  # chunk KV given without texts: nothing to read words from
        return {}
    held = [set(words(t)) for t in texts]
    most = max(1, len(held) // NAME_SHARE)
    found: dict[str, list[int]] = {}
    for word in content_words(probe.question) if probe is not None else []:
        chunks = [c for c, ws in enumerate(held) if word in ws]
        if 1 <= len(chunks) <= most:
            found[word] = chunks
    return found


def covering(request: PlanRequest, order: list[int], likelihood: torch.Tensor) -> list[int]:
    """`order` with, for each of the question's names no chunk of it holds, the model's best chunk holding it put
    before the last chunk (at most MOST_READ chunks in all; the last stays next to the question)."""
    read = list(order)
    for chunks in names(request).values():
        if len(read) >= MOST_READ or any(c in read for c in chunks):
            continue
        read.insert(len(read) - 1, max(chunks, key=lambda c: (float(likelihood[c]), -c)))
    return sorted(read[:-1]) + read[-1:]


def document_order(request: PlanRequest) -> list[int] | None:
    """The chunks in the one order in which each is in place (`kvrag.plan.strategies.in_place`): one document's
    chunks encoded in its context, all there, read as encoded; None where the chunks are not that (encoded alone, or
    not all of a run)."""
    probe = request.probe
    if probe is None or len(request.lengths) < 2:
        return None
    kvs, prefix = probe.chunks, len(probe.prefix)
    if not any(kv.behind for kv in kvs):
        return None
    left, order, before = set(range(len(kvs))), [], []
    while left:
        nxt = [c for c in sorted(left) if sits_after(kvs[c], prefix, before)]
        if not nxt:
            return None
        order.append(nxt[0])
        left.discard(nxt[0])
        before += kvs[nxt[0]].token_ids.tolist()
    return order


@register_strategy(
    "best_few",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description=f"the {SEVERAL} best chunks by the model's likelihood of the question and the retriever's score taken "
    "in turn, the model's best next to the question: exactly a full prefill over them (by_need's plan of several)",
)
def _best_few(request: PlanRequest) -> Plan:
    order, _ = _several(request, _target(request))
    return Plan(order=order, recompute=exact_over(request, order))


def _several(request: PlanRequest, best: int, k: int = SEVERAL) -> tuple[list[int], int]:
    """best_few's order (the best `k`), and how many chunks in it are there for the question's names alone."""
    assert request.probe is not None  # likelihood_all measured through it
    likelihood = _likelihood(request)
    base = several(request, best, likelihood, k)
    order = covering(request, base, likelihood)
    return order, len(order) - len(base)


def run_to(request: PlanRequest, chunk: int) -> list[int]:
    """`chunk` with the chunks before it in its run, in document order, where all of them were given (a run
    retrieval gave whole, `kvrag.engine.runs`): read so, each is in place and nothing is recomputed. [chunk] where
    it was encoded alone, begins its run, or an earlier chunk of its run was not given."""
    probe = request.probe
    if probe is None or len(request.lengths) < 2:
        return [chunk]
    kvs, prefix = probe.chunks, len(probe.prefix)
    if not kvs[chunk].behind:  # encoded alone, or its run's first chunk
        return [chunk]
    for first in range(len(kvs)):
        if not sits_after(kvs[first], prefix, []):
            continue
        run, before = [first], kvs[first].token_ids.tolist()
        while run[-1] != chunk:
            nxt = next((c for c in range(len(kvs)) if c not in run and sits_after(kvs[c], prefix, before)), None)
            if nxt is None:
                break
            run.append(nxt)
            before += kvs[nxt].token_ids.tolist()
        if run[-1] == chunk:
            return run
    return [chunk]


def whole_document(request: PlanRequest) -> Plan | None:
    """The chunks read whole in their document's order where they are one document's encoded in its context, all of
    one run (`document_order`): exactly its full prefill, nothing recomputed and nothing measured; else None."""
    whole = document_order(request)
    if whole is None:
        return None
    reason = f"{len(whole)} chunks of one document, each in its context: read whole in its order"
    return Plan(order=whole, reason=reason, signals={"document": float(len(whole))})


@register_strategy(
    "by_need",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description="by what the question needs: one document's chunks encoded in its context read whole in its order; "
    "else the model's best chunk behind its run's earlier chunks where retrieval gave them (in place), alone where it "
    "stands out, else the best few stitched with it last (exact over them), and 'the documents do not say' where no "
    "chunk bears on it",
    before_pick=whole_document,
)
def _by_need(request: PlanRequest) -> Plan:
    return _decided(request, several="exact")


@register_strategy(
    "by_need_reuse",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description="by_need, but where it reads several chunks only the best, next to the question, is recomputed (the "
    "others reused re-positioned, the study's recipe over the best few): fewer tokens through the model",
    before_pick=whole_document,
)
def _by_need_reuse(request: PlanRequest) -> Plan:
    return _decided(request, several="reuse")


@register_strategy(
    "by_need_spread",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description=f"by_need, but where it reads several chunks the best, next to the question, is recomputed and the "
    f"others only their first {SPREAD_TOKENS} tokens (EPIC-style: where a chunk encoded apart is most wrong)",
    before_pick=whole_document,
)
def _by_need_spread(request: PlanRequest) -> Plan:
    return _decided(request, several="spread")


@register_strategy(
    "by_need_two",
    needs_target=True,
    picker="likelihood_all",
    budgeted=False,
    description="by_need, but where it reads several chunks it reads two (the best by either ranking beside the "
    "model's best), exactly their full prefill",
    before_pick=whole_document,
)
def _by_need_two(request: PlanRequest) -> Plan:
    return _decided(request, several="exact", k=2)


def _decided(request: PlanRequest, *, several: str, k: int = SEVERAL) -> Plan:
    """by_need's plan. Where it reads several chunks (the best `k`): "exact", exactly their full prefill; "reuse",
    only the best (last, next to the question) recomputed; "spread", the best recomputed and every other chunk not
    in place its first SPREAD_TOKENS tokens."""
    best = _target(request)
    seen = signals(request)
    lift, margin = seen["lift"], seen["margin"]
    if lift < ABSTAIN_LIFT:
        reason = f"no chunk bears on the question (lift {lift:.2f} < {ABSTAIN_LIFT})"
        return Plan(order=[best], recompute=exact_over(request, [best]), abstain=True, reason=reason, signals=seen)
    run = run_to(request, best)
    if len(run) > 1:
        named = [c for c in covering(request, run, _likelihood(request)) if c not in run]
        order = run[:-1] + named + run[-1:]  # the run's earlier chunks stay in place
        seen["named"] = float(len(named))
        reason = f"{len(order)} chunks: the model's best with its run's {len(run) - 1} earlier chunks, in place"
        return Plan(order=order, recompute=exact_over(request, order), reason=reason, signals=seen)
    agree = int(seen["retriever_best"]) == best
    if len(request.lengths) == 1 or margin > (AGREE_MARGIN if agree else ONE_CHUNK_MARGIN):
        why = " and the retriever's" if agree else ""
        reason = f"one chunk: the model's best{why}, by a margin of {margin:.2f}"
        order = covering(request, [best], _likelihood(request))
        seen["named"] = float(len(order) - 1)
        if len(order) == 1:
            return Plan(order=order, recompute=exact_over(request, order), reason=reason, signals=seen)
        reason = f"{len(order)} chunks: {reason}, and those holding the question's other names"
        return Plan(order=order, recompute=exact_over(request, order), reason=reason, signals=seen)
    order, named = _several(request, best, k)
    seen["named"] = float(named)
    reason = f"{len(order)} chunks: no chunk stands out (the model's best leads by {margin:.2f})"
    recompute = exact_over(request, order)
    if several != "exact":
        first = 0 if several == "reuse" else SPREAD_TOKENS
        recompute = {c: tokens if c == best else tokens[:first] for c, tokens in recompute.items()}
        recompute = {c: tokens for c, tokens in recompute.items() if len(tokens)}
    return Plan(order=order, recompute=recompute, reason=reason, signals=seen)
