"""A question a part at a time: the parts, the built-in splitter and the composition of the parts' answers.

A question that asks for several things ("What is A, and who is B?", "What is the N of each of X, Y and Z?") is
answered as parts over the same chunks: each part is its own request, planned and decoded alone over chunk KV
read once, so a model that reads one fact at a time answers each. A hop is a part whose question holds
"{answer}": the previous part's answer is put in before it is asked ("Who founded Velloria?", then "What is the
birth year of {answer}?"). This module splits and composes text only; `kvrag.run.parts.answer_parts` runs the
parts and `KVModel.answer(parts=...)` / `KVRAG.query(parts=...)` are the entry points. It never touches a model.

The built-in splitter is conservative: a question it cannot split is answered whole (`split` returns None). Its
forms: two questions joined by "and"; one attribute of each of several named things; a comparison of two named
things ("Which was founded earlier, A or B?", "Which of A or B is longer?"), asked as one part a thing and decided
in code from the numbers the parts' answers give; a bridge through a person ("What is the birth year of the founder
of Velloria?"), asked as a hop ("Who is the founder of Velloria?", then "What is the birth year of {answer}?").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from kvrag.errors import InvalidRequestError

HOLE = "{answer}"  # where a hop's question takes the previous part's answer
_WH = r"(?:what|who|which|when|where|how|whose|whom)"
# "What is A, and who is B?": two whole questions joined by "and"
_JOINED = re.compile(rf"^(?P<a>{_WH}\b.+?),?\s+and\s+(?P<b>{_WH}\b.+?)\??$", re.IGNORECASE)
# "What is the N of each of X, Y and Z?" / "... of both X and Y?"
_EACH = re.compile(r"^(?P<head>.+?\bof)\s+(?:each of|both)\s+(?P<items>.+?)\??$", re.IGNORECASE)


# a comparison: "<stem>, A or B?" / "Which of A or B <rest>?"
_ALTERNATIVES = re.compile(r"^(?P<stem>(?:which|who)\b.+?),\s+(?P<a>[^,]+?),?\s+or\s+(?P<b>[^,]+?)\??$", re.IGNORECASE)
_WHICH_OF = re.compile(
    r"^which of (?P<a>.+?),?\s+(?:or|and)\s+(?P<b>.+?)\s+(?P<rest>(?:was|were|is|are|has|have)\s.+?)\??$", re.IGNORECASE
)
_ONE = r"(?:which|who)(?:\s+[a-z]+)??"  # "Which", "Who", "Which ship"
_EARLIER = {"earlier": "min", "first": "min", "sooner": "min", "later": "max", "last": "max", "more recently": "max"}
# "Which was founded earlier": asked "When was A founded?"
_WHEN = re.compile(rf"^{_ONE}\s+(?P<aux>was|were|is|are)\s+(?P<verb>[a-z]+ed|born|built|made|begun)\s+"
                   rf"(?P<cmp>{'|'.join(_EARLIER)})$", re.IGNORECASE)
_AMOUNT = {"larger": "max", "bigger": "max", "greater": "max", "higher": "max", "more": "max",
           "smaller": "min", "lower": "min", "fewer": "min", "less": "min"}
# "Which town has the larger population": asked "What is the population of A?"; "more employees": "How many
# employees does A have?"
_HAS = re.compile(rf"^{_ONE}\s+(?P<has>has|have)\s+(?:the\s+)?(?P<cmp>{'|'.join(_AMOUNT)})\s+(?P<noun>[a-z][a-z ]*)$",
                  re.IGNORECASE)
# adjective -> (what "How ... is A?" asks, which wins)
_MEASURE = {"longer": ("long", "max"), "shorter": ("long", "min"), "taller": ("tall", "max"), "older": ("old", "max"),
            "younger": ("old", "min"), "bigger": ("big", "max"), "larger": ("large", "max"),
            "smaller": ("large", "min"),
            "heavier": ("heavy", "max"), "lighter": ("heavy", "min"), "wider": ("wide", "max"),
            "deeper": ("deep", "max"), "higher": ("high", "max"), "farther": ("far", "max")}
# "Which river is longer": asked "How long is A?"
_IS = re.compile(rf"^{_ONE}\s+(?P<be>is|are|was|were)\s+(?P<cmp>{'|'.join(_MEASURE)})$", re.IGNORECASE)
# people a bridge passes through: "the founder of X", "the first captain of X"
_ROLES = ("founder", "mayor", "captain", "builder", "author", "writer", "director", "owner", "creator", "inventor",
          "designer", "architect", "president", "chair", "leader", "manager", "editor", "publisher", "composer",
          "governor", "king", "queen", "ruler", "maintainer", "head")
_BRIDGE = re.compile(
    rf"^(?P<wh>{_WH})\s+(?P<be>is|was|are|were)\s+the\s+(?P<noun>.+?)\s+of\s+"
    rf"(?P<inner>the\s+(?:[a-z]+\s+)?(?:{'|'.join(_ROLES)})\s+of\s+.+?)\??$",
    re.IGNORECASE,
)
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a question."""

    question: str  # asked as is; a hop's holds HOLE
    hop: bool = False  # the question takes the previous part's answer at HOLE
    entity: str | None = None  # a comparison's part: the thing it asks about
    wins: str | None = None  # a comparison's part: "min" or "max", the value that wins

    def asked(self, previous: str | None) -> str:
        """The part's question as asked, a hop's hole filled with the previous part's answer."""
        if not self.hop:
            return self.question
        if previous is None:
            raise InvalidRequestError(f"the part {self.question!r} is a hop, but no part comes before it")
        return self.question.replace(HOLE, previous.strip().rstrip("."))

    def asked_after(self, previous_part: Part | None, previous: str | None) -> str:
        """The part's question as asked after `previous_part` was answered `previous`: a hop takes the answer
        without the echo of the question that asked for it ("The founder of Velloria is Ilsa Morn." gives
        "Ilsa Morn")."""
        if self.hop and previous is not None and previous_part is not None:
            previous = short_answer(previous_part.question, previous)
        return self.asked(previous)


def short_answer(question: str, answer: str) -> str:
    """The answer with a leading echo of its question's subject cut ("Who is the founder of Velloria?" answered
    "The founder of Velloria is Ilsa Morn." gives "Ilsa Morn"); the first line only."""
    line = answer.strip().split("\n", 1)[0].strip()
    subject = re.match(rf"^{_WH}\s+(?:is|was|are|were)\s+(?P<s>.+?)\??$", question.strip(), re.IGNORECASE)
    if subject:
        echo = re.match(rf"^{re.escape(subject['s'])}\s+(?:is|was|are|were)\s+(?P<rest>.+)$", line, re.IGNORECASE)
        if echo:
            line = echo["rest"]
    line = re.sub(r"^(?:it|he|she|they)\s+(?:is|was|are|were)\s+", "", line, flags=re.IGNORECASE)
    return line.strip().rstrip(".").strip()


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
    ("What is the N of each of X, Y and Z?", "... of both X and Y?"); a comparison of two named things; a bridge
    through a person (see the module's docstring).
    """
    text = " ".join(question.split())
    compared = _comparison(text)
    if compared is not None:
        return compared
    bridge = _BRIDGE.match(text)
    if bridge:
        inner = bridge["inner"]
        return [Part(_question(f"Who {bridge['be']} {inner}")),
                Part(f"{_capital(bridge['wh'])} {bridge['be']} the {bridge['noun']} of {HOLE}?", hop=True)]
    joined = _JOINED.match(text)
    if joined:
        return [Part(_question(joined["a"])), Part(_question(joined["b"]))]
    each = _EACH.match(text)
    if each:
        items = _items(each["items"])
        if len(items) >= 2:
            return [Part(_question(f"{each['head']} {item}")) for item in items]
    return None


def _comparison(text: str) -> list[Part] | None:
    """A comparison's parts, one a thing, or None when `text` is not one of the comparison forms."""
    which_of = _WHICH_OF.match(text)
    if which_of:
        stem, a, b = f"Which {which_of['rest']}", which_of["a"], which_of["b"]
    else:
        alternatives = _ALTERNATIVES.match(text)
        if not alternatives:
            return None
        stem, a, b = alternatives["stem"].strip(), alternatives["a"], alternatives["b"]
    when, has, is_ = _WHEN.match(stem), _HAS.match(stem), _IS.match(stem)
    if when:
        aux, verb, wins = when["aux"].lower(), when["verb"].lower(), _EARLIER[when["cmp"].lower()]
        ask = [f"When {aux} {x} {verb}?" for x in (a, b)]
    elif has:
        noun, wins = has["noun"].strip().lower(), _AMOUNT[has["cmp"].lower()]
        counted = has["cmp"].lower() in ("more", "fewer", "less")
        does = "does" if has["has"].lower() == "has" else "do"
        ask = [f"How many {noun} {does} {x} have?" if counted else f"What is the {noun} of {x}?" for x in (a, b)]
    elif is_:
        measure, wins = _MEASURE[is_["cmp"].lower()]
        ask = [f"How {measure} {is_['be'].lower()} {x}?" for x in (a, b)]
    else:
        return None
    return [Part(_capital(q), entity=x, wins=wins) for q, x in zip(ask, (a, b))]


def number_in(answer: str) -> float | None:
    """The one number an answer states ("founded in 1,732." gives 1732.0); None when it states none or several."""
    found = {float(n.replace(",", "")) for n in _NUMBER.findall(answer) if n.replace(",", "").strip("-.")}
    return found.pop() if len(found) == 1 else None


def decide(parts: Sequence[Part], answers: Sequence[str]) -> str | None:
    """A comparison decided in code: the winner with the numbers its parts' answers give ("Velloria (1732
    against 1801)."), or None when the parts are no comparison, an answer states no single number, or they tie."""
    if len(parts) != 2 or len(answers) != 2 or any(p.entity is None or p.wins is None for p in parts):
        return None
    values = [number_in(answer) for answer in answers]
    if None in values or values[0] == values[1]:
        return None
    first, second = values  # type: ignore[misc]
    wins = parts[0].wins
    if parts[0].question.lower().startswith("how old") and all(v == int(v) and 1000 <= v <= 2100 for v in values):
        wins = "min" if wins == "max" else "max"  # "How old is Velloria?" answered with its founding year
    won = 0 if (first < second) == (wins == "min") else 1
    return f"{_capital(str(parts[won].entity))} ({_num(values[won])} against {_num(values[1 - won])})."


def _num(value: float | None) -> str:
    return f"{value:g}" if value is not None and value != int(value) else f"{int(value or 0)}"


def compose(parts: Sequence[Part], answers: Sequence[str]) -> str:
    """One reply from the parts' answers (`composed`'s text)."""
    return composed(parts, answers)[0]


def composed(parts: Sequence[Part], answers: Sequence[str]) -> tuple[str, str]:
    """One reply from the parts' answers, and how it was made: "code", a comparison decided where its answers
    give the numbers (see `decide`); "hops", a chain of hops answered by the last hop's answer; else "lines", a
    line each in the parts' order (each part's question and its own answer stay in `Answer.parts`)."""
    if len(parts) != len(answers):
        raise ValueError(f"{len(parts)} parts and {len(answers)} answers")
    decided = decide(parts, answers)
    if decided is not None:
        return decided, "code"
    if len(parts) > 1 and all(p.hop for p in parts[1:]):
        return " ".join(answers[-1].split()), "hops"
    return "\n".join(" ".join(answer.split()) for answer in answers), "lines"


# what a model asked to split a question is told (`kvrag.run.parts.model_parts`); its reply is read by `parsed`
SPLIT_INSTRUCTION = (
    "List the separate questions that this question asks, one question per line, each complete on its own "
    "(name the thing it is about). If it asks only one thing, write it unchanged. Write nothing else.\n\n"
    "Question: {question}"
)
_LIST_MARK = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)]|Q\d*[:.])\s*")


def parsed(reply: str, question: str, most: int = 4) -> list[Part] | None:
    """The parts a model's reply lists (one question a line, list marks dropped), or None when it lists fewer than
    two distinct questions, more than `most`, or a line that names nothing the question names (a word of four or
    more letters of the question): the question is then answered whole."""
    words = {w.lower() for w in re.findall(r"[A-Za-z]{4,}", question)}
    found: list[str] = []
    for line in reply.splitlines():
        line = _LIST_MARK.sub("", line).strip()
        if not line:
            continue
        if not line.endswith("?") or not words & {w.lower() for w in re.findall(r"[A-Za-z]{4,}", line)}:
            return None
        if line.lower() not in (f.lower() for f in found):
            found.append(line)
    if not 2 <= len(found) <= most:
        return None
    return [Part(_question(line)) for line in found]


def resolve_parts(
    question: str,
    parts: str | Sequence[str | Part] | None,
    model_split: Callable[[str], list[Part] | None] | None = None,
) -> list[Part] | None:
    """What `parts=` asks for: None (answer whole), "auto" (the built-in splitter: None when it cannot split),
    "model" (the model lists the parts: `model_split(question)`, None when its reply does not parse), or the
    caller's list of part questions."""
    if parts is None:
        return None
    if isinstance(parts, str):
        if parts == "auto":
            return split(question)
        if parts == "model" and model_split is not None:
            return model_split(question)
        raise InvalidRequestError(f'parts={parts!r}: give "auto", "model" or a list of part questions')
    return parts_of(parts)
