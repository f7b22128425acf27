"""Ranking rules shared by retrieval and the pickers: the words of a text, BM25 over texts, and reciprocal-rank
fusion of rankings. The engine's hybrid retrieval and the lexical pickers both read them here; this module never
embeds, retrieves or runs a model."""

from __future__ import annotations

import functools
import re
from typing import Any, Hashable, Iterable, Sequence, TypeVar

RRF_K = 60  # reciprocal-rank fusion's constant: a ranking's entry at rank r (0 first) adds 1 / (RRF_K + r + 1)

Key = TypeVar("Key", bound=Hashable)


def words(text: str) -> list[str]:
    """The lower-cased word tokens of a text (what BM25 and word overlap read)."""
    return re.findall(r"\w+", text.lower())


@functools.cache
def _stop_words() -> frozenset[str]:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS  # imported once, when first needed

    return frozenset(ENGLISH_STOP_WORDS)


def content_words(text: str) -> list[str]:
    """The words of a text that carry its content: three letters or more and not an English stop word
    (scikit-learn's list), in order, each once."""
    stop = _stop_words()
    return list(dict.fromkeys(w for w in words(text) if len(w) >= 3 and w not in stop))


def bm25(texts: Iterable[str]) -> Any:
    """A BM25 (Okapi) index over the texts' words; a text with no word is one placeholder word."""
    from rank_bm25 import BM25Okapi

    return BM25Okapi([words(t) or ["<empty>"] for t in texts])


def bm25_scores(index: Any, question: str) -> list[float]:
    """Each indexed text's BM25 score for the question, in the index's order."""
    return [float(s) for s in index.get_scores(words(question))]


def fuse(rankings: Iterable[Sequence[Key]]) -> dict[Key, float]:
    """Reciprocal-rank fusion: each key's sum over the rankings (best first) that hold it of 1 / (RRF_K + rank + 1);
    keys in the order they first appear."""
    fused: dict[Key, float] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking):
            fused[key] = fused.get(key, 0.0) + 1.0 / (RRF_K + rank + 1)
    return fused
