"""A question answered a part at a time over the same chunks: each part its own request (its chunk picked, its
suffix computed fresh over the chunks' stored KV), the parts decoded side by side where the C step takes them (one
pass over the weights a token for every part still going: `kvrag.run.generate.decode_together`), a hop's part
after the part it needs, with its own retrieval; then one reply composed from the parts' answers
(`kvrag.plan.parts.composed`). The splitting and composing of text is `kvrag.plan.parts`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from kvrag import cpu
from kvrag.answer import NOT_IN_DOCUMENTS, Answer, Source, last_answer, says_not_in_documents
from kvrag.cache.chunks import Chunks, ChunkSource
from kvrag.model.runtime import ModelRuntime
from kvrag.plan.parts import SPLIT_INSTRUCTION, Part, composed, parsed
from kvrag.plan.request import Request
from kvrag.run.executor import Executor, HFExecutor
from kvrag.run.generate import Detokenizer, decode_together
from kvrag.run.pipeline import Prefilled, prefill, stats_of, stream


def model_parts(
    kvmodel: ModelRuntime,
    question: str,
    generate: Callable[..., Iterator[str | Answer]],
    max_new_tokens: int = 96,
) -> list[Part] | None:
    """The parts the model itself lists for `question` (greedy, under its chat template, no chunks), or None
    when its reply does not list two to four questions about what the question names (`kvrag.plan.parts.parsed`):
    the question is then answered whole. One short generation through `generate` (a prompt's ids and `Sampling`'s
    keywords to answer pieces: `KVModel.stream_prompt`); only as good as the model."""
    tokenizer = kvmodel.tokenizer
    message = [{"role": "user", "content": SPLIT_INSTRUCTION.format(question=question.strip())}]
    text = message[0]["content"] + "\n"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    reply = last_answer(generate(ids, max_new_tokens=max_new_tokens))
    return parsed(reply.text, question)


@dataclass(slots=True)
class Retrieved:
    """A hop's own retrieval: the chunks its question found, as a request gives them and as their KV is read."""

    texts: list[str]
    scores: list[float]
    chunks: Chunks
    sources: list[Source]


def answer_parts(
    kvmodel: ModelRuntime,
    request: Request,
    parts: Sequence[Part],
    chunks: Chunks,
    executor: Executor,
    *,
    started_at: float,
    scores_of: Callable[[str], list[float]] | None = None,
    retrieve: Callable[[str], Retrieved | None] | None = None,
    sources: Sequence[Source] = (),
    retrieve_s: float = 0.0,
    named_picker: str | None = None,
) -> Answer:
    """Each part answered as its own request over the same chunks (their KV read once, shared by every part),
    then one Answer: the parts' answers composed (`Answer.composed` says how), every part's own Answer in `parts`.

    `scores_of(question)`: the chunks' retrieval scores for one part (the engine scores each part's question
    against the retrieved chunks); without it a part whose request names no picker and no default picker is
    picked by the model's likelihood of the part behind each chunk: one question's scores would give every
    part the same chunk. `retrieve(question)`: a hop's own retrieval, run with the previous part's answer in
    its question (chunks it shares with the first retrieval come from the store); None keeps the given chunks.
    A comparison whose answers state no single number each is decided by one short pass of the model over the
    parts' questions and answers. `request` carries its default already (the entry point applied it);
    `named_picker` is the picker the caller named before that.
    """
    named = named_picker  # the caller's; else the default's where each part has its own scores
    answers: list[Answer] = []
    read = {s.id: s for s in sources}
    previous: str | None = None
    waited = time.perf_counter() - started_at  # before the first part's own clock starts (retrieval)
    hop_retrieve_s = 0.0

    def request_of(question: str) -> Request:
        scores = scores_of(question) if scores_of is not None else request.scores
        picker = named or (request.picker if scores_of is not None else "likelihood")
        return replace(request, question=question, scores=scores, picker=picker)

    together = None
    if not any(p.hop for p in parts) and isinstance(executor, HFExecutor):
        subs = [request_of(p.asked_after(None, None)) for p in parts]
        together = _together(kvmodel, subs, chunks, executor, sources)
    answers.extend(together or ())
    for i, part in enumerate(parts if together is None else ()):
        question = part.asked_after(parts[i - 1] if i else None, previous)
        sub = request_of(question)
        given, given_sources = chunks, list(sources)
        found = None
        if part.hop and retrieve is not None:
            t0 = time.perf_counter()
            found = retrieve(question)
            hop_retrieve_s += time.perf_counter() - t0
        if found is not None:
            sub = replace(sub, chunks=list(found.texts), scores=list(found.scores))
            given, given_sources = found.chunks, found.sources
            read.update((s.id, s) for s in found.sources)
        one = last_answer(stream(kvmodel, sub, given, executor, started_at=time.perf_counter(), sources=given_sources))
        answers.append(one)
        previous = one.text
    text, how = composed(parts, [a.text for a in answers])
    if how == "lines" and all(p.entity is not None for p in parts):  # a comparison the numbers did not decide
        judged = _judge(kvmodel, request, parts, answers, executor)
        answers.append(judged)
        text, how = judged.text, "model"
    if all(a.abstained for a in answers):
        text = NOT_IN_DOCUMENTS
    first = answers[0].stats
    stats = replace(
        first,
        ttft_s=waited + first.ttft_s,  # the first part's first token: what a streaming reader sees first
        new_tokens=sum(a.stats.new_tokens for a in answers),
        recomputed_tokens=sum(a.stats.recomputed_tokens for a in answers),
        extra_token_layers=sum(a.stats.extra_token_layers for a in answers),
        extra_work=[w for a in answers for w in a.stats.extra_work],
        total_s=time.perf_counter() - started_at,
        retrieve_s=retrieve_s + first.retrieve_s + hop_retrieve_s,
        overspend_tokens=sum(a.stats.overspend_tokens for a in answers),
    )
    return Answer(
        text=text,
        token_ids=[t for a in answers for t in a.token_ids],
        finish_reason=answers[-1].finish_reason,
        stats=stats,
        sources=list(read.values()),
        parts=answers,
        composed=how,
        abstained=all(a.abstained for a in answers),  # every part's documents were silent
    )


def _together(
    kvmodel: ModelRuntime, subs: Sequence[Request], chunks: Chunks, executor: HFExecutor, sources: Sequence[Source]
) -> list[Answer] | None:
    """The parts' answers, each part prefilled on its own cache, then all decoded side by side
    (`decode_together`: one pass over the weights a token for every part still going). Each part's tokens are
    those it gets answered alone; its first token is timed when its prefill's logits are out (the first token is
    picked from them). None where the C step does not take the model (each part is then answered alone)."""
    runs: list[tuple[Prefilled, float, float]] = []  # prefill, when it started, when its logits were out
    sampling = subs[0].sampling
    if any(sub.sampling != sampling for sub in subs) or len(subs) > cpu.MAX_TOKENS:
        return None
    with kvmodel.lock:  # made once a model, and it restacks the model's weights
        fast = cpu.decoder_of(kvmodel.model)
    if fast is None or fast.native is None or not fast.use_native:
        return None  # decided before any prefill: the parts are then answered one after the other
    try:
        for sub in subs:
            started = time.perf_counter()
            run = prefill(kvmodel, sub, chunks, executor, room=sampling.max_new_tokens)
            runs.append((run, started, time.perf_counter()))
        detoks = [Detokenizer(kvmodel.tokenizer, sampling.stop) for _ in subs]

        def stopped(i: int, token: int) -> bool:
            detoks[i].push(token)
            return detoks[i].stopped

        prefills = [(run.prefill.cache, run.prefill.logits[-1], run.prefill.next_position) for run, _, _ in runs]
        decoded = decode_together(kvmodel.model, prefills, sampling, kvmodel.eos_ids, kvmodel.lock, stopped)
    finally:
        for run, _, _ in runs:
            executor.release(run.prefill)
    if decoded is None:
        return None
    done = time.perf_counter()
    answers = []
    for sub, (run, started, out), detok, one in zip(subs, runs, detoks, decoded):
        detok.finish()
        stats = stats_of(sub, run, one.tokens, out - started, done - started, run.chunks.load_s)
        abstain = run.decision.plan.abstain  # the part's draft is kept; its text says the documents do not say
        said = abstain or says_not_in_documents(detok.text)  # or the model said so itself
        answers.append(Answer(text=NOT_IN_DOCUMENTS if abstain else detok.text, token_ids=one.tokens,
                              finish_reason=one.finish, stats=stats, sources=list(sources), abstained=said,
                              draft=detok.text if said else None))
    return answers


def _judge(kvmodel: ModelRuntime, request: Request, parts: Sequence[Part], answers: Sequence[Answer],
           executor: Executor) -> Answer:
    """A comparison the parts' answers could not decide in code, asked whole over those answers alone: one short
    prompt (the parts' questions and answers as its one chunk, encoded here and never stored)."""
    facts = "\n".join(f"{p.question} {' '.join(a.text.split())}" for p, a in zip(parts, answers))
    sub = replace(request, chunks=[facts], scores=None, strategy="full_prefill", picker=None, target=None)
    fresh = ChunkSource(kvmodel).chunks([facts])
    return last_answer(stream(kvmodel, sub, fresh, executor, started_at=time.perf_counter()))
