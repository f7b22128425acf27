"""Pickers: which chunk is the target. Separate from strategies, so every target strategy takes any picker.

- `retriever`: the highest retrieval score; with no scores, the first chunk of a list ranked best-first.
- `attention`: the chunk that receives the most of the question's attention over the reused cache.
- `oracle`: the known target (studies), given by the caller.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvrag.errors import InvalidRequestError
from kvrag.probe import Probe

Picker = Callable[[int, "Sequence[float] | None", "int | None", Probe], int]


def _retriever(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    return max(range(n), key=lambda i: (scores[i], -i)) if scores is not None else 0


def _attention(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    return int(probe.chunk_attention(list(range(n))).argmax())


def _oracle(n: int, scores: Sequence[float] | None, target: int | None, probe: Probe) -> int:
    if target is None:
        raise InvalidRequestError("the oracle picker needs the known target: pass target=<chunk index>")
    return target


PICKERS: dict[str, Picker] = {"retriever": _retriever, "attention": _attention, "oracle": _oracle}


def get_picker(name: str) -> Picker:
    try:
        return PICKERS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown picker '{name}': use one of {', '.join(sorted(PICKERS))}") from None
