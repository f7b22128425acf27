"""A question a part at a time: the parts, the built-in splitter and the composition of the parts' answers.

A question that asks for several things ("What is A, and who is B?", "What is the N of each of X, Y and Z?") is
answered as parts over the same chunks: each part is its own request, planned and decoded alone over chunk KV
read once, so a model that reads one fact at a time answers each. A hop is a part whose question holds
"{answer}": the previous part's answer is put in before it is asked ("Who founded Velloria?", then "What is the
birth year of {answer}?"). This module splits and composes text only; `kvrag.run.pipeline.answer_parts` runs the
parts and `KVModel.answer(parts=...)` / `KVRAG.query(parts=...)` are the entry points. It never touches a model.

The built-in splitter is conservative: a question it cannot split is answered whole (`split` returns None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from kvrag.errors import InvalidRequestError

HOLE = "{answer}"  # where a hop's question takes the previous part's answer
_WH = r"(?:what|who|which|when|where|how|whose|whom)"
# "What is A, and who is B?": two whole questions joined by "and"
_JOINED = re.compile(rf"^(?P<a>{_WH}\b.+?),?\s+and\s+(?P<b>{_WH}\b.+?)\??$", re.IGNORECASE)
# "What is the N of each of X, Y and Z?" / "... of both X and Y?"
_EACH = re.compile(r"^(?P<head>.+?\bof)\s+(?:each of|both)\s+(?P<items>.+?)\??$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a question."""

    question: str  # asked as is; a hop's holds HOLE
    hop: bool = False  # the question takes the previous part's answer at HOLE

    def asked(self, previous: str | None) -> str:
        """The part's question as asked, a hop's hole filled with the previous part's answer."""
        if not self.hop:
            return self.question
        if previous is None:
            raise InvalidRequestError(f"the part {self.question!r} is a hop, but no part comes before it")
        return self.question.replace(HOLE, previous.strip().rstrip("."))


def parts_of(parts: Sequence[str | Part]) -> list[Part]:
    """Caller-given parts as Parts (a question holding HOLE is a hop); refused when empty or malformed."""
    if isinstance(parts, str) or not isinstance(parts, Sequence) or not parts:
        raise InvalidRequestError('parts must be a non-empty list of questions (or "auto" for the built-in splitter)')
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, Part):
            out.append(part)
        elif isinstance(part, str) and part.strip():
            out.append(Part(part.strip(), hop=HOLE in part))
        else:
            raise InvalidRequestError(f"part {i} is {part!r}: give a non-empty question")
    if out[0].hop:
        raise InvalidRequestError(f"the first part {out[0].question!r} holds {HOLE}, but no part comes before it")
    return out


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _question(text: str) -> str:
    text = text.strip().rstrip("?").rstrip(",").strip()
    return _capital(text) + "?"


def _items(text: str) -> list[str]:
    """ "X, Y and Z" / "X and Y" as ["X", "Y", "Z"] (an Oxford comma too)."""
    head, sep, last = text.rpartition(" and ")
    if not sep:
        return []
    first = [s.strip() for s in head.split(",") if s.strip()]
    return [*first, last.strip()] if first and last.strip() else []


def split(question: str) -> list[Part] | None:
    """The question's parts when it is one of the common forms, else None (answer it whole).

    Forms: two questions joined by "and" ("What is A, and who is B?"); one attribute of several named things
    ("What is the N of each of X, Y and Z?", "... of both X and Y?").
    """
    text = " ".join(question.split())
    joined = _JOINED.match(text)
    if joined:
        return [Part(_question(joined["a"])), Part(_question(joined["b"]))]
    each = _EACH.match(text)
    if each:
        items = _items(each["items"])
        if len(items) >= 2:
            return [Part(_question(f"{each['head']} {item}")) for item in items]
    return None


def compose(parts: Sequence[Part], answers: Sequence[str]) -> str:
    """One reply from the parts' answers: a line each, in the parts' order (each part's question and its own
    answer stay in `Answer.parts`)."""
    if len(parts) != len(answers):
        raise ValueError(f"{len(parts)} parts and {len(answers)} answers")
    return "\n".join(" ".join(answer.split()) for answer in answers)


def resolve_parts(question: str, parts: str | Sequence[str | Part] | None) -> list[Part] | None:
    """What `parts=` asks for: None (answer whole), "auto" (the built-in splitter: None when it cannot split), or
    the caller's list of part questions."""
    if parts is None:
        return None
    if isinstance(parts, str):
        if parts != "auto":
            raise InvalidRequestError(f'parts={parts!r}: give "auto" or a list of part questions')
        return split(question)
    return parts_of(parts)
