"""Pickers: which chunk is the target. Separate from strategies, so every target strategy takes any picker.

- `retriever`: the highest retrieval score; with no scores, the first chunk of a list ranked best-first.
- `attention`: the chunk that receives the most of the question's attention over the reused cache.
- `likelihood`: of the retriever's best LIKELIHOOD_CANDIDATES chunks, the one behind which the model finds the
  question most likely (one batched pass of the suffix over those chunks' stored KV): the model itself reads
  "I adopted a dog" and "my neighbour has a dog" differently where an embedding may not, and the retriever
  rarely ranks the target below its first few, so the cost stays that of a few suffixes at any top-k.
- `likelihood_all`: the same over every retrieved chunk, up to the retriever's best `MOST_SCORED` (the `by_need`
  plan's picker: it reads them all anyway).
- `gap`: the retriever's best when its score leads the second best's by more than GAP, else `likelihood`'s pick:
  the model's pass is paid only where the retriever is unsure.
- `lexical`: the retriever's ranking fused with BM25 over the chunks' words (reciprocal rank).
- `fused`: the retriever's, BM25's and the likelihood ranking fused (reciprocal rank).
- `oracle`: the known target (studies), given by the caller.

Set pickers return several chunks, best first, for the set strategies (`set_recompute`, `set_only`) and
questions that need several chunks; a strategy of one target takes the first:
- `top2`, `top3`: the retriever's best two or three.
- `likelihood2`: of the retriever's best SET_CANDIDATES chunks, the two behind which the question is most likely
  (each scored alone, in the likelihood picker's one batched pass).
- `diverse2`: the retriever's best, then of the next best few the one sharing the fewest words with it, ties to
  the better score (a pair about two entities, not one entity said twice).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvrag.errors import InvalidRequestError
from kvrag.plan.probe import Probe
from kvrag.plan.strategies import best_first, scored
from kvrag.rank import bm25, bm25_scores, fuse, words

# (chunks, scores, known target, probe) -> the target, or several chunks best first (a set picker)
Picker = Callable[[int, "Sequence[float] | None", "int | None", Probe], "int | list[int]"]
# Chunks the likelihood picker scores: the retriever's best few. On the built-in study sets the retriever's
# best CANDIDATES held the target as often as all ten did for the likelihood picker (docs/study.md), at a
# third of its cost.
LIKELIHOOD_CANDIDATES = 3
SET_CANDIDATES = 4  # chunks the set pickers choose among: the retriever's best few
# The retrieval-score lead (cosine, kvrag's default embedder) above which `gap` trusts the retriever: the middle of
# the leads that picked the target most often on the built-in studies (the measurements: docs/models.md, "gap").
# Fused rank scores (hybrid retrieval) lead by far less: there `gap` is `likelihood`.
GAP = 0.07


def _retriever(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    return max(range(n), key=lambda i: (scores[i], -i)) if scores is not None else 0


def _attention(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    return int(probe.chunk_attention(list(range(n))).argmax())


def _likelihood(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    return int(probe.question_likelihood(best_first(n, scores)[:LIKELIHOOD_CANDIDATES]).argmax())


def _likelihood_all(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    return int(probe.question_likelihood(scored(n, scores)).argmax())


def _gap(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    if scores is not None and n > 1:
        first, second = best_first(n, scores)[:2]
        if scores[first] - scores[second] > GAP:
            return first
    return _likelihood(n, scores, target, probe)


def _best_first(values: Sequence[float]) -> list[int]:
    """The chunks by value, highest first (ties: the earlier chunk first)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def _bm25(probe: Probe) -> list[float]:
    return bm25_scores(bm25(probe.texts), probe.question)


def _fuse(rankings: Sequence[Sequence[float]]) -> int:
    """The chunk the rankings' reciprocal-rank fusion puts first (ties: the earlier chunk)."""
    fused = fuse(_best_first(values) for values in rankings)
    return max(range(len(rankings[0])), key=lambda i: (fused[i], -i))


def _lexical(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    dense = list(scores) if scores is not None else [float(-i) for i in range(n)]  # a ranked list: its order
    return _fuse([dense, _bm25(probe)])


def _fused(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    dense = list(scores) if scores is not None else [float(-i) for i in range(n)]
    return _fuse([dense, _bm25(probe), probe.question_likelihood().tolist()])


def _oracle(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    if target is None:
        raise InvalidRequestError("the oracle picker needs the known target: pass target=<chunk index>")
    return target


def _top(k: int) -> Picker:
    def top(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> list[int]:
        return best_first(n, scores)[:k]

    return top


def _likelihood2(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> list[int]:
    candidates = best_first(n, scores)[:SET_CANDIDATES]
    likelihood = probe.question_likelihood(candidates)
    return sorted(candidates, key=lambda c: (-float(likelihood[c]), candidates.index(c)))[:2]


def _diverse2(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> list[int]:
    ranked = best_first(n, scores)[:SET_CANDIDATES]
    if len(ranked) < 2:
        return ranked
    texts = probe.texts
    first = set(words(texts[ranked[0]]))

    def overlap(c: int) -> float:
        other = set(words(texts[c]))
        return len(first & other) / max(1, len(first | other))

    return [ranked[0], min(ranked[1:], key=lambda c: (overlap(c), ranked.index(c)))]


PICKERS: dict[str, Picker] = {
    "retriever": _retriever,
    "attention": _attention,
    "likelihood": _likelihood,
    "likelihood_all": _likelihood_all,
    "gap": _gap,
    "lexical": _lexical,
    "fused": _fused,
    "oracle": _oracle,
    "top2": _top(2),
    "top3": _top(3),
    "likelihood2": _likelihood2,
    "diverse2": _diverse2,
}
SET_PICKERS = ("top2", "top3", "likelihood2", "diverse2")


def get_picker(name: str) -> Picker:
    try:
        return PICKERS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name (a list)
        raise InvalidRequestError(f"unknown picker '{name}': use one of {', '.join(sorted(PICKERS))}") from None
