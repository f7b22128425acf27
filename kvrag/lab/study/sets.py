"""The built-in study sets by name: the single-chunk sets of `kvrag.lab.study.data` and the several-chunk sets of
`kvrag.lab.study.multi`, generated lazily from a seed. It never runs a model."""

from __future__ import annotations

import random

from kvrag.errors import InvalidRequestError
from kvrag.lab.study.data import BUILTIN, DEFAULT_CHUNKS, SINGLE_MAKERS, StudyItem
from kvrag.lab.study.multi import multi


def builtin(
    name: str, *, seed: int = 0, limit: int | None = None, chunks: tuple[int, int] = DEFAULT_CHUNKS
) -> list[StudyItem]:
    """The first `limit` items of a built-in set: one of SINGLE ("api_docs", "open_qa", "dialogue") or of MULTI,
    whose questions need several chunks (kvrag.lab.study.multi).

    `chunks` is the (min, max) number of chunks a question; raise it (e.g. (16, 20)) for stronger models.
    The same question appears once per variant, next to each other, so `limit` keeps the variants paired.
    """
    if name not in BUILTIN:
        raise InvalidRequestError(f"unknown built-in study data '{name}': use one of {', '.join(BUILTIN)}")
    lo, hi = chunks
    if not 2 <= lo <= hi:
        raise InvalidRequestError(f"chunks must be a range MIN-MAX with 2 <= MIN <= MAX, got {lo}-{hi}")
    if limit is not None and limit < 1:
        raise InvalidRequestError(f"limit must be at least 1, got {limit}")
    rng = random.Random(f"{name}/{seed}")
    out = []
    for item in SINGLE_MAKERS[name](rng, chunks) if name in SINGLE_MAKERS else multi(name, rng, chunks):
        out.append(item)
        if limit is not None and len(out) >= limit:
            break
    return out
