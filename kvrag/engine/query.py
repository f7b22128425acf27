"""Answering: retrieval, the request made and handed with its chunks to `kvrag.run.pipeline`, streaming, parts
and answers over given chunks. The KVRAG engine's half that reads (`KVRAG` takes it in as a base class)."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from kvrag.answer import Answer, Source, last_answer
from kvrag.cache.chunks import Chunks
from kvrag.engine.index import Filters, check_filters, check_top_k
from kvrag.engine.runs import WHOLE_RUNS, with_runs
from kvrag.errors import (
    BusyError,
    EmptyInputError,
    InvalidRequestError,
    NoMatchError,
)
from kvrag.model.layout import check_unicode
from kvrag.plan.defaults import default_parts, shipped_default
from kvrag.plan.parts import Part, resolve_parts
from kvrag.plan.request import Request
from kvrag.run import parts as run_parts
from kvrag.run import pipeline
from kvrag.timing import Phases


class Querying:
    """What `KVRAG` does to answer (see `kvrag.engine.rag.KVRAG` for the attributes it uses)."""

    def retrieve(
        self,
        question: str,
        *,
        top_k: int = 5,
        filters: Filters | None = None,
        bm25: bool = False,
        hybrid: bool | None = None,
        whole_runs: bool | None = None,
    ) -> list[Source]:
        """Top-k chunks for a question, best first, among those that pass `filters` (applied before top-k).

        `bm25=True` fuses the dense ranking with BM25's by reciprocal rank (`hybrid` is its deprecated name).
        `whole_runs=True` adds, where two or more retrieved chunks are of one run of a document encoded in its
        context, the rest of that run (`kvrag.engine.runs`: read whole, it costs no recomputation), in document
        order in place of its best chunk; those chunks say `retrieved=False`, scored by their dense similarity
        (under `bm25`, the least retrieved score: they rank after every retrieved chunk). None: kvrag's default,
        `kvrag.engine.runs.WHOLE_RUNS` (chosen on the held-out halves).
        """
        bm25 = _bm25_flag(bm25, hybrid)
        if not isinstance(question, str):
            raise InvalidRequestError(f"the question is a {type(question).__name__}: give a str")
        if not question.strip():
            raise EmptyInputError("the question is empty or whitespace only: ask something")
        check_top_k(top_k)
        check_unicode(question, "the question")
        filters = check_filters(filters)
        vector = self.embedder.embed([question])[0]
        with self._lock:
            if not len(self.index):
                where = f" at {self.path}" if self.path is not None else ""
                raise EmptyInputError(f"the index{where} holds no chunks: ingest documents first")
            hits = self.index.search(vector, question, top_k=top_k, filters=filters, bm25=bm25)
            if not (WHOLE_RUNS if whole_runs is None else whole_runs):
                return [Source(id=r.id, text=r.text, score=s, metadata=dict(r.metadata)) for r, s in hits]
            return self._with_runs(hits, vector, bm25)

    def _with_runs(self, hits: list[tuple[Any, float]], vector: Any, bm25: bool) -> list[Source]:
        """The retrieved (record, score) pairs as Sources, each run two or more of them share given whole
        (`kvrag.engine.runs`; a chunk encoded alone is a run of its own); the caller holds the lock."""
        known, found = self.index.records, {r.id: s for r, s in hits}
        ids = with_runs(
            list(found), lambda c: [m.id for m in self.index.run_of(known[c])], lambda c: known[c].n_tokens
        )
        least = min(found.values(), default=0.0)  # under bm25 an added chunk ranks after every retrieved one

        def score(c: str) -> float:
            if c in found:
                return found[c]
            return least if bm25 else self.index.similarity(vector, known[c])

        return [
            Source(id=c, text=known[c].text, score=score(c), metadata=dict(known[c].metadata), retrieved=c in found)
            for c in ids
        ]

    def stream(
        self,
        question: str,
        *,
        parts: str | Sequence[str] | None = None,
        started_at: float | None = None,
        phases: Phases | None = None,
        top_k: int = 5,
        filters: Filters | None = None,
        bm25: bool = False,
        hybrid: bool | None = None,
        whole_runs: bool | None = None,
        **options: Any,
    ) -> Iterator[str | Answer]:
        """Retrieve, then yield the answer's text pieces as decoded, then the final Answer (with sources).

        `options` are the request's (`KVModel.stream`: strategy, picker, budget, strict and decoding). With
        no `strategy`, the index's tuned default runs (`kvrag tune`), else the model's shipped default
        (`kvrag.plan.defaults`: target_only on the named models, target_recompute on others); a `budget` or
        `picker` left out comes with that default.

        `parts`: answer a part at a time (`KVModel.answer`'s `parts`: a list of part questions, "auto" for the
        built-in splitter or "model" for the model's own list). The chunks are retrieved once for the whole
        question and their KV read once; each part's retrieval scores are its own question's against those
        chunks, so each part picks its own target, and a hop retrieves again with the previous part's answer in
        its question. None with no strategy named: as the default says (the shipped defaults say "auto"). A
        question answered in parts is streamed as one piece, its composed text, once every part is answered (a
        comparison's or a hop's text is known only then).

        `whole_runs`: `retrieve`'s (None: kvrag's default).
        """
        t0 = started_at if started_at is not None else time.perf_counter()
        request = Request.of(question, **options)  # checked before any retrieval work
        split_parts = self._parts(question, parts, options)
        with self._admitted():
            bm25 = _bm25_flag(bm25, hybrid)
            sources = self.retrieve(question, top_k=top_k, filters=filters, bm25=bm25, whole_runs=whole_runs)
            if not sources:
                raise NoMatchError(f"no chunk matches the filters {dict(filters or {})}: loosen them")
            request.with_chunks([s.text for s in sources], [s.score for s in sources])
            given = self.source.chunks(request.chunks, self._context_keys(sources))
            if split_parts is None:
                yield from self._answer(request, sources, t0, time.perf_counter() - t0, phases, given)
                return

            def retrieve(part: str) -> run_parts.Retrieved | None:  # a hop's own retrieval
                found = self.retrieve(part, top_k=top_k, filters=filters, bm25=bm25, whole_runs=whole_runs)
                if not found:
                    return None
                texts = [s.text for s in found]
                chunks = self.source.chunks(texts, self._context_keys(found))
                return run_parts.Retrieved(texts, [s.score for s in found], chunks, found)

            yield from self._answer_parts(
                request, split_parts, sources, t0, time.perf_counter() - t0, retrieve, given=given
            )

    def _context_keys_of_texts(self, texts: Sequence[str]) -> list[str | None] | None:
        """The store key of each text that an indexed chunk encoded in its document's context holds, else None; None
        for an index with no such chunk."""
        with self._lock:
            by_text = {r.text: r.key for r in self.index.records.values() if r.after}
        return [by_text.get(t) for t in texts] if by_text else None

    def _context_keys(self, sources: Sequence[Source]) -> list[str | None]:
        """The store key of each retrieved chunk encoded in its document's context (its record's), else None."""
        with self._lock:
            records = [self.index.records.get(s.id) for s in sources]
        return [r.key if r is not None and r.after else None for r in records]

    def _with_default(self, request: Request) -> Request:
        """The one place an engine's request gets its default: the index's tuned one, else the model's shipped one."""
        return request.with_default(self.defaults or shipped_default(self.kvmodel.fingerprint.weights))

    def _parts(self, question: str, parts: Any, options: Mapping[str, Any]) -> list[Part] | None:
        """The parts a question is answered in: the caller's, else the default's when no strategy is named."""
        if parts is None and options.get("strategy") in (None, "default"):  # the default may split questions
            parts = default_parts(self.defaults or shipped_default(self.kvmodel.fingerprint.weights))
        if parts is None:
            return None
        return resolve_parts(question, parts, lambda q: run_parts.model_parts(self.kvmodel, q, self.kvmodel.stream_prompt))

    def _answer_parts(
        self,
        request: Request,
        parts: list[Part],
        sources: list[Source],
        t0: float,
        retrieve_s: float,
        retrieve: Callable[[str], run_parts.Retrieved | None] | None = None,
        given: Chunks | None = None,
    ) -> Iterator[str | Answer]:
        """The parts answered over the request's chunks, then their composed text as one piece and the Answer."""
        named = request.picker
        self._with_default(request)
        vectors = torch.as_tensor(self.embedder.embed([str(t) for t in request.chunks or []]))

        def scores_of(part: str) -> list[float]:
            return (vectors @ torch.as_tensor(self.embedder.embed([part]))[0]).tolist()

        answer = run_parts.answer_parts(
            self.kvmodel,
            request,
            parts,
            given if given is not None else self.source.chunks(request.chunks),
            self.executor,
            started_at=t0,
            scores_of=scores_of,
            retrieve=retrieve,
            sources=sources,
            retrieve_s=retrieve_s,
            named_picker=named,
        )
        mark_read(answer)
        if answer.text:
            yield answer.text
        yield answer

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[None]:
        """One of the `max_in_flight` query slots, or BusyError at once when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            raise BusyError(
                f"{self.max_in_flight} queries are already in flight, this engine's bound (max_in_flight): retry "
                "when one ends, or open the engine with a larger max_in_flight"
            )
        try:
            yield
        finally:
            self._slots.release()

    def _answer(
        self,
        request: Request,
        sources: list[Source],
        t0: float,
        retrieve_s: float,
        phases: Phases | None,
        chunks: Chunks | None = None,
    ) -> Iterator[str | Answer]:
        self._with_default(request)
        chunks = chunks if chunks is not None else self.source.chunks(request.chunks)
        for item in pipeline.stream(
            self.kvmodel,
            request,
            chunks,
            self.executor,
            started_at=t0,
            phases=phases,
            sources=sources,
            retrieve_s=retrieve_s,
        ):
            yield mark_read(item) if isinstance(item, Answer) else item

    def query(self, question: str, *, parts: str | Sequence[str] | None = None, **kwargs: Any) -> Answer:
        """Retrieve and answer; the arguments are those of `stream` (`parts` too)."""
        return last_answer(self.stream(question, parts=parts, **kwargs))

    def stream_over(
        self,
        question: str,
        chunks: Sequence[str | Source],
        *,
        scores: Sequence[float] | None = None,
        started_at: float | None = None,
        retrieve_s: float = 0.0,
        phases: Phases | None = None,
        parts: str | Sequence[str] | None = None,
        **options: Any,
    ) -> Iterator[str | Answer]:
        """`stream` over caller-given chunks (no retrieval); their KV comes from the store when stored.

        `chunks` are texts, or the `Source`s of a `retrieve` the caller ran itself (their ids, scores and
        metadata are kept; `retrieve_s` is the seconds it took, reported in the stats). `parts` as in `stream`,
        over these chunks only (a hop retrieves nothing: its question is scored against them).
        """
        t0 = started_at if started_at is not None else time.perf_counter()
        if isinstance(chunks, (str, bytes, bytearray, Mapping)) or not isinstance(chunks, Iterable):
            raise InvalidRequestError(
                f"chunks is a {type(chunks).__name__}: give a list of chunk texts (or of Sources from retrieve)"
            )
        chunks = list(chunks)
        if not chunks:
            raise EmptyInputError("no chunks given: pass at least one chunk text")
        retrieved = all(isinstance(c, Source) for c in chunks)
        texts = [c.text for c in chunks] if retrieved else list(chunks)
        if retrieved and scores is None:
            scores = [c.score for c in chunks]
        request = Request.of(question, texts, scores=scores, **options)
        split_parts = self._parts(question, parts, options)
        with self._admitted():
            # tokenized once: the keys here, the KV in the pipeline; a chunk encoded in its document's context is read
            # at its record's key (found by id for retrieved sources, by text for texts: a framework's nodes)
            keys = self._context_keys(chunks) if retrieved else self._context_keys_of_texts(texts)
            given = self.source.chunks(request.chunks, keys)
            if retrieved:
                sources = [replace(c, metadata=dict(c.metadata)) for c in chunks]
            else:
                sources = self._sources_of(request, given)
            if split_parts is not None:
                yield from self._answer_parts(request, split_parts, sources, t0, retrieve_s, given=given)
                return
            yield from self._answer(request, sources, t0, retrieve_s, phases, given)

    def _sources_of(self, request: Request, given: Chunks) -> list[Source]:
        """Sources for caller-given texts: the indexed chunk's id and metadata where the text is indexed."""
        with self._lock:
            by_key = {r.key: r for r in self.index.records.values()}
        sources = []
        for i, text in enumerate(request.chunks):
            record = by_key.get(given.key(i))
            sources.append(
                Source(
                    id=record.id if record else f"given#{i}",
                    text=str(text),
                    score=request.scores[i] if request.scores is not None else 0.0,
                    metadata=dict(record.metadata) if record else {},
                )
            )
        return sources

    def answer(self, question: str, chunks: Sequence[str | Source], **kwargs: Any) -> Answer:
        """Answer over caller-given chunk texts; the arguments are those of `stream_over`."""
        return last_answer(self.stream_over(question, chunks, **kwargs))


def mark_read(answer: Answer) -> Answer:
    """Mark each source of an answer read or only retrieved, from what its prompts held; returns the answer.

    A source is read when the prompt that answered held it: the chunks of `stats.order` (every chunk given, for a
    full prefill). An answer in parts reads what its parts read, each part marked from its own order (a hop's over
    the chunks it retrieved itself). The sources are new objects: the parts' marks never leak into one another.
    """
    for part in answer.parts:
        mark_read(part)
    if answer.parts:  # the composed answer's stats are the first part's: its parts say what was read
        held = {s.id for part in answer.parts for s in part.sources if s.read}
    else:
        held = {answer.sources[i].id for i in answer.stats.order if 0 <= i < len(answer.sources)}
    answer.sources = [replace(s, read=s.id in held) for s in answer.sources]
    return answer


def _bm25_flag(bm25: bool, hybrid: bool | None) -> bool:
    """The retrieval flag, from its deprecated name when that is given."""
    if hybrid is not None:
        warnings.warn("the retrieval flag hybrid= is renamed bm25=", DeprecationWarning, stacklevel=3)
        bm25 = hybrid
    if not isinstance(bm25, bool):
        raise InvalidRequestError(f"bm25 must be True or False, got {bm25!r}")
    return bm25
