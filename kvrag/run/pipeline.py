"""One request from chunks to an Answer: plan, execute, decode, and the stats built once from all three.

The seam: `plan` decides (picker, strategy, probe) and `job_of` turns the decision into an executor's
`Job`; the executor (`kvrag.run.executor`) prefills and decodes. This module holds no model state of its own:
KVModel and the engine call it with a `Request` that is already valid and carries its default (they apply it,
once); it runs what it is handed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from kvrag import cpu
from kvrag.answer import NOT_IN_DOCUMENTS, Answer, AnswerStats, Source, says_not_in_documents
from kvrag.cache.chunks import Chunks
from kvrag.errors import ContextOverflowError, EmptyInputError
from kvrag.model.recompute import Prefill, full_prefill
from kvrag.model.runtime import ModelRuntime
from kvrag.plan.planner import Decision, make_plan
from kvrag.plan.probe import Probe
from kvrag.plan.request import Request
from kvrag.plan.sampling import Sampling
from kvrag.run.executor import Executor, HFExecutor, Job
from kvrag.run.generate import Detokenizer
from kvrag.timing import Phases, phase

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class Prefilled:
    """A request's prefill, ready to decode, with what was decided and what it cost."""

    prefill: Prefill  # logits and cache
    decision: Decision  # the plan that was run, the picker and the picked target
    probe: Probe  # what measuring cost (extra_token_layers, extra_work)
    chunks: Chunks  # the request's chunks (their store hits, encoding count and time)
    context_tokens: int  # chunk tokens in the prompt

    @property
    def encoded(self) -> int:
        return self.chunks.encoded

    @property
    def encode_s(self) -> float:
        return self.chunks.encode_s


def plan(kvmodel: ModelRuntime, request: Request, chunks: Chunks, probe: Probe) -> Decision:
    """The checked plan of a request (its strategy and picker run here, measuring through `probe`)."""
    return make_plan(request, chunks.lengths, probe)


def log_plan(request: Request, decision: Decision) -> None:
    """The plan chosen and why, at INFO under `kvrag.run.pipeline` (`kvrag -v` shows it)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    plan_ = decision.plan
    recomputed = "all (full prefill)" if plan_.full_prefill else sum(len(s) for s in plan_.recompute.values())
    logger.info(
        "plan: strategy %s, picker %s, target %s, order %s, recomputed tokens %s, budget %s tokens%s",
        request.strategy,
        decision.picker,
        decision.target,
        list(plan_.order),
        recomputed,
        decision.budget_tokens,
        f"; {plan_.reason}" if plan_.reason else "",
    )


def reused(decision: Decision) -> list[int]:
    """The chunks whose stored KV the plan reads, in stitched order (none for a full prefill)."""
    plan_ = decision.plan
    return [] if plan_.full_prefill else [c for c in plan_.order if c not in plan_.replace]


def job_of(
    decision: Decision,
    chunks: Chunks,
    suffix_ids: Sequence[int],
    *,
    room: int,
    logits_to_keep: int,
    reads_store: bool = False,
) -> Job:
    """The executor's job: the plan's chunks in stitched order, their KV read only where the plan reuses it.

    `reads_store`: the executor reads stored KV itself, so a reused chunk the store holds is not read here.
    """
    plan_ = decision.plan
    ids = [chunks.ids[c] for c in plan_.order]
    if plan_.full_prefill:
        return Job(ids, [], list(suffix_ids), full_prefill=True, room=room, logits_to_keep=logits_to_keep)
    kept = reused(decision)
    stored = dict(zip(kept, chunks.stored(kept) if reads_store else chunks.kv(kept)))
    at = {c: j for j, c in enumerate(plan_.order)}
    return Job(
        ids,
        [plan_.replace.get(c) or stored[c] for c in plan_.order],
        list(suffix_ids),
        recompute={at[c]: s for c, s in plan_.recompute.items()},
        key_scale={at[c]: f for c, f in plan_.key_scale.items()},
        room=room,
        logits_to_keep=logits_to_keep,
    )


def prefill(
    kvmodel: ModelRuntime,
    request: Request,
    chunks: Chunks,
    executor: Executor,
    *,
    room: int = 0,
    logits_to_keep: int = 1,
    phases: Phases | None = None,
    pooled: bool = False,
    probe: type[Probe] = Probe,
) -> Prefilled:
    """Plan the request and run its prefill (under the model's lock, taken here once).

    `room`: tokens that will be decoded after the prompt (they must fit the context too). `probe` is the
    class that measures for the picker and the strategy (the study passes one that keeps what it measured).
    `pooled`: see `HFExecutor`.
    """
    suffix = kvmodel.layout.suffix_ids(request.question)
    check_fits(kvmodel, chunks, suffix, room)
    with chunks.deferring():  # misses encoded under the lock are stored once it is released
        with phase(phases, "plan"):  # outside the lock: a measurement takes it, reading the chunk KV it needs
            measure = probe.of(kvmodel, chunks, suffix, request.question)
            decision = plan(kvmodel, request, chunks, measure)
        log_plan(request, decision)
        passed = _picked_pass(kvmodel, executor, decision, measure, room) if logits_to_keep == 1 else None
        if passed is not None:  # the picker's pass over the winner was this prompt's prefill: no second forward
            passed.prompt_ids = kvmodel.prompt_of([chunks.ids[decision.plan.order[0]]], suffix)
            return Prefilled(passed, decision, measure, chunks, len(chunks.ids[decision.plan.order[0]]))
        if not executor.reads_store:
            with phase(phases, "store load"):  # outside the lock: a slow store holds up this request only
                chunks.prefetch(reused(decision))
        with kvmodel.lock:
            with phase(phases, "store load"):  # the KV the plan reuses and nothing read yet: store, else encode
                # the cache keeps the room decoding needs (a compiled step reads whole blocks of slots)
                job = job_of(
                    decision,
                    chunks,
                    suffix,
                    room=cpu.decode_room(kvmodel.model, room),
                    logits_to_keep=logits_to_keep,
                    reads_store=executor.reads_store,
                )
            out = executor.prefill(job, phases=phases, pooled=pooled)
    if out.prompt_ids is None:  # what decoding's prompt-lookup drafts are looked up in
        out.prompt_ids = kvmodel.prompt_of(job.chunk_ids, job.suffix_ids)
    return Prefilled(out, decision, measure, chunks, job.context_tokens)


def _picked_pass(kvmodel: ModelRuntime, executor: Executor, decision: Decision, measure: Probe, room: int) -> Prefill | None:
    """The prefill of a plan of one chunk's stored KV as is (`target_only`), when the question-likelihood picker's
    pass already ran the suffix behind that chunk (`Probe.suffix_pass`), for an in-process executor; else None."""
    plan_ = decision.plan
    if (
        not isinstance(executor, HFExecutor)
        or plan_.full_prefill
        or len(plan_.order) != 1
        or plan_.recompute
        or plan_.replace
        or plan_.key_scale
        or plan_.order[0] not in measure.suffix_rows
    ):
        return None  # decided before the model's lock: a plan that needs the store reads it while others compute
    with kvmodel.lock:
        passed = measure.suffix_pass(plan_.order[0], cpu.decode_room(kvmodel.model, room))
    measure.suffix_rows = {}  # the other rows' caches are not needed any more
    return passed


def check_fits(kvmodel: ModelRuntime, chunks: Chunks, suffix: Sequence[int], max_new_tokens: int) -> None:
    """Refuse a prompt that, with the tokens to decode, would not fit the model's context."""
    total = len(kvmodel.prefix) + sum(chunks.lengths) + len(suffix)
    if total + max_new_tokens > kvmodel.max_positions:
        raise ContextOverflowError(
            f"the stitched prompt has {total} tokens and max_new_tokens is {max_new_tokens}: "
            f"{total + max_new_tokens} > the model's {kvmodel.max_positions}-token context. Pass fewer or "
            "shorter chunks, a shorter question, or lower max_new_tokens."
        )


def stream(
    kvmodel: ModelRuntime,
    request: Request,
    chunks: Chunks,
    executor: Executor,
    *,
    started_at: float,
    phases: Phases | None = None,
    sources: Sequence[Source] = (),
    retrieve_s: float = 0.0,
) -> Iterator[str | Answer]:
    """Prefill, then yield the answer's text pieces as they become final, then the Answer with its stats.

    `retrieve_s`: seconds the caller spent retrieving before this call (the store reads are added to it).
    """
    run = prefill(kvmodel, request, chunks, executor, room=request.sampling.max_new_tokens, phases=phases, pooled=True)

    def stats(tokens: list[int], ttft: float, total: float) -> AnswerStats:
        return stats_of(request, run, tokens, ttft, total, retrieve_s + chunks.load_s)

    yield from decode_answer(
        kvmodel,
        executor,
        run.prefill,
        request.sampling,
        started_at,
        stats,
        phases,
        sources,
        abstain=run.decision.plan.abstain,
    )


def stream_prompt(
    kvmodel: ModelRuntime, executor: Executor, prompt: str | Sequence[int], **sampling: Any
) -> Iterator[str | Answer]:
    """Plain generation from a whole prompt (text, tokenized as is, or ids): full prefill, no chunks, no plan.

    The keyword arguments are `Sampling`'s (max_new_tokens, temperature, top_p, seed, stop, prompt_lookup).
    """
    t0 = time.perf_counter()
    decoding = Sampling(**sampling)
    ids = (
        list(kvmodel.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, str)
        else list(prompt)
    )
    if not ids:
        raise EmptyInputError("the prompt is empty: give it text")
    if len(ids) + decoding.max_new_tokens > kvmodel.max_positions:
        raise ContextOverflowError(
            f"the prompt has {len(ids)} tokens and max_new_tokens is {decoding.max_new_tokens}: "
            f"{len(ids) + decoding.max_new_tokens} > the model's {kvmodel.max_positions}-token context"
        )
    with kvmodel.lock:
        out = full_prefill(kvmodel.model, ids)
    out.prompt_ids = ids

    def stats(tokens: list[int], ttft: float, total: float) -> AnswerStats:
        return AnswerStats.of_prompt(len(ids), len(tokens), ttft, total)

    yield from decode_answer(kvmodel, executor, out, decoding, t0, stats)


def stats_of(
    request: Request, run: Prefilled, tokens: list[int], ttft: float, total: float, retrieve_s: float
) -> AnswerStats:
    """What one answer cost and what was decided, from the request, its prefill and the decode timings."""
    decision, recomputed = run.decision, run.prefill.recomputed_tokens
    return AnswerStats(
        strategy=str(request.strategy),
        picker=decision.picker,
        order=list(decision.plan.order),
        target=decision.target,
        targets=decision.targets,
        target_given=request.target,
        context_tokens=run.context_tokens,
        recomputed_tokens=recomputed,
        budget=decision.budget,
        budget_tokens=decision.budget_tokens,
        overspend_tokens=0 if decision.plan.full_prefill else max(0, recomputed - decision.budget_tokens),
        extra_token_layers=run.probe.extra_token_layers,
        extra_work=list(run.probe.extra_work),
        prompt_tokens=run.prefill.next_position,
        chunks_encoded=run.chunks.encoded,
        encode_s=run.chunks.encode_s,
        ttft_s=ttft,
        new_tokens=len(tokens),
        total_s=total,
        store_hits=run.chunks.store_hits,
        retrieve_s=retrieve_s,
        reason=decision.plan.reason,
        signals=dict(decision.plan.signals),
    )


def decode_answer(
    kvmodel: ModelRuntime,
    executor: Executor,
    prefill: Prefill,
    sampling: Sampling,
    started_at: float,
    make_stats: Callable[[list[int], float, float], AnswerStats],
    phases: Phases | None = None,
    sources: Sequence[Source] = (),
    *,
    abstain: bool = False,
) -> Iterator[str | Answer]:
    """Decode after a prefill: text pieces as they become final (stop strings honoured), then the Answer.

    `abstain`: the plan found no chunk that bears on the question; the decoded text is kept as the Answer's draft,
    and its text (the one piece yielded, as soon as the first token is: the draft is decoded behind it) says the
    documents do not say.
    """
    prefilled = time.perf_counter()
    detok = Detokenizer(kvmodel.tokenizer, sampling.stop)
    tokens: list[int] = []
    ttft = 0.0
    finish = "length"
    steps = executor.decode(prefill, sampling)
    try:
        for token in steps:
            if not ttft:
                now = time.perf_counter()
                ttft = now - started_at
                if phases is not None:
                    phases.add("first token", now - prefilled)
                if abstain:  # what the reader gets is known now: the draft goes on behind it
                    yield NOT_IN_DOCUMENTS
            if token in kvmodel.eos_ids:
                finish = "eos"
                break
            tokens.append(token)
            piece = detok.push(token)
            if piece and not abstain:
                yield piece
            if detok.stopped:
                finish = "stop"
                break
    finally:
        steps.close()  # type: ignore[attr-defined]  # a generator: closing ends its forwards at once
        executor.release(prefill)  # the cache dies with this call: its buffers serve the next
    tail = detok.finish()
    if tail and not abstain:
        yield tail
    if abstain and not ttft:  # no token came (a decode that ended at once): said once all the same
        yield NOT_IN_DOCUMENTS
    said = abstain or says_not_in_documents(detok.text)  # the plan declined, or the model did in kvrag's words
    yield Answer(
        text=NOT_IN_DOCUMENTS if abstain else detok.text,
        token_ids=tokens,
        finish_reason=finish,
        stats=make_stats(tokens, ttft, time.perf_counter() - started_at),
        sources=list(sources),
        abstained=said,
        draft=detok.text if said else None,
    )
