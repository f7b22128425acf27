"""Controlled synthetic worlds for studies: invented entities, so no model knows the answers from memory.

This module owns two seeded, deterministic generators, `encyclopedia` (articles about invented towns,
rivers, people, ships and companies) and `dialogue` (a multi-session chat whose facts are updated over
time), and the records they return. It is plain Python over built-in word lists: it never touches a
model, the network or the disk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from kvrag.errors import InvalidRequestError

from kvrag.lab.words import (  # noqa: F401 - the word lists the generators draw from
    ONSETS,
    PLACE_ENDS,
    NAME_ENDS,
    RIVER_ENDS,
    GIVEN,
    GOODS,
    JOBS,
    WORK_ADJ,
    WORK_NOUN,
    FILLER,
    ANIMALS,
    RELATIONS,
    PETS,
    SMALL_TALK,
)


@dataclass(slots=True)
class Article:
    """One encyclopedia article about one invented entity."""

    id: str  # stable id, e.g. "a07"
    title: str  # the entity's name
    text: str  # prose stating the entity's facts


@dataclass(slots=True)
class Session:
    """One session of a user-assistant conversation."""

    id: str  # stable id in time order, e.g. "s03"
    text: str  # the transcript, "User: ..." and "Assistant: ..." lines under a session header


@dataclass(slots=True)
class Question:
    """A question answerable from exactly one target text."""

    id: str  # stable id, e.g. "q012"
    question: str  # the question as a user would ask it
    answers: list[str]  # accepted answer strings; each appears in the target text
    target: str  # id of the article or session that holds the answer
    family: str  # question kind for per-family reports, e.g. "town/founder" or "user-update"


class _Fresh:
    """Draws values that no earlier value contains or is contained in (case-insensitive), so no answer occurs
    by accident in another text; with `starts`, also no two values of that set begin with the same three
    letters (a small model mixes up Nimwick and Nimvane)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[str]()

    def __call__(self, make: Callable[[random.Random], str], starts: set[str] | None = None) -> str:
        for _ in range(500):
            value = make(self.rng)
            low = value.lower()
            start = low.removeprefix("the ")[:3]
            if not any(low in u or u in low for u in self.used) and (starts is None or start not in starts):
                self.used.add(low)
                if starts is not None:
                    starts.add(start)
                return value
        raise InvalidRequestError("the built-in word lists ran out of distinct values: ask for fewer entities")


def _place(ends: list[str]) -> Callable[[random.Random], str]:
    return lambda r: r.choice(ONSETS) + r.choice(ends)


def _person(r: random.Random) -> str:
    return f"{r.choice(GIVEN)} {r.choice(ONSETS)}{r.choice(NAME_ENDS)}"


def _pick(pool: list[str]) -> Callable[[random.Random], str]:
    return lambda r: r.choice(pool)


def _number(lo: int, hi: int, commas: bool = False) -> Callable[[random.Random], str]:
    return lambda r: f"{r.randint(lo, hi):,}" if commas else str(r.randint(lo, hi))


_YEAR = _number(1500, 1899)
_SHIP_ENDS = ["ia", "ona", "ette", "ander"]
# kind -> (name maker, closing line, facts). A fact is (attribute, value maker, noun, shape, wh-word): it is
# stated as "The {noun} {name} is {shape}." and asked as "{wh} is the {noun} {name}?", so a small model's
# natural answer ("The founder of Velloria is") runs straight into the stated value.
_Fact = tuple[str, Callable[[random.Random], str], str, str, str]
_KINDS: dict[str, tuple[Callable[[random.Random], str], str, list[_Fact]]] = {
    "town": (
        _place(PLACE_ENDS),
        "{N} remains a small town.",
        [
            ("province", _place(["shire", "land", "march"]), "province of", "{v}", "What"),
            ("founded", _YEAR, "founding year of", "{v}", "What"),
            ("founder", _person, "founder of", "{v}", "Who"),
            ("population", _number(2000, 90000, True), "population of", "{v}", "What"),
            ("known_for", _pick(GOODS), "best-known product of", "{v}", "What"),
            ("mayor", _person, "mayor of", "{v}", "Who"),
        ],
    ),
    "river": (
        lambda r: "the " + r.choice(ONSETS) + r.choice(RIVER_ENDS),
        "{N} is a long river of the region.",
        [
            ("length", _number(40, 990), "length of", "{v} kilometres", "What"),
            ("source", _place(["peak", "crag", "fell"]), "source of", "Mount {v}", "What"),
            ("mouth", _place(["water", "pool", "lough"]), "mouth of", "Lake {v}", "What"),
            ("known_for", _pick(GOODS), "best-known product of", "{v}", "What"),
            ("town", _place(PLACE_ENDS), "largest town on", "{v}", "What"),
        ],
    ),
    "person": (
        _person,
        "{N} is remembered in many books.",
        [
            ("born_year", _YEAR, "birth year of", "{v}", "What"),
            ("birthplace", _place(PLACE_ENDS), "birthplace of", "the town of {v}", "What"),
            ("job", _pick(JOBS), "profession of", "{v}", "What"),
            ("work", lambda r: f"{r.choice(WORK_ADJ)} {r.choice(WORK_NOUN)}", "best-known book of", "{v}", "What"),
            ("spouse", _person, "spouse of", "{v}", "Who"),
            ("teacher", _person, "teacher of", "{v}", "Who"),
        ],
    ),
    "ship": (
        lambda r: "the " + r.choice(ONSETS) + r.choice(_SHIP_ENDS),
        "{N} was a trading ship.",
        [
            ("launched", _YEAR, "launch year of", "{v}", "What"),
            ("captain", _person, "first captain of", "{v}", "Who"),
            ("port", _place(["haven", "port", "quay"]), "home port of", "{v}", "What"),
            ("cargo", _pick(GOODS), "main cargo of", "{v}", "What"),
            ("builder", _person, "builder of", "{v}", "Who"),
        ],
    ),
    "company": (
        lambda r: r.choice(ONSETS) + r.choice(NAME_ENDS) + " " + r.choice(["Works", "Trading", "Mills"]),
        "{N} is still an active company.",
        [
            ("founder", _person, "founder of", "{v}", "Who"),
            ("founded", _YEAR, "founding year of", "{v}", "What"),
            ("city", _place(PLACE_ENDS), "home city of", "{v}", "What"),
            ("product", _pick(GOODS), "main product of", "{v}", "What"),
            ("staff", _number(100, 9000, True), "number of employees of", "{v}", "What"),
        ],
    ),
}


def encyclopedia(seed: int = 0, entities: int = 40) -> tuple[list[Article], list[Question]]:
    """Articles about invented entities of five kinds (several of each) and one question per stated fact.

    Every answer string is unique in the world: it appears in its target article and in no other.
    """
    if isinstance(entities, bool) or not isinstance(entities, int) or entities < 1:
        raise InvalidRequestError(f"entities must be an int of at least 1, got {entities!r}")
    rng = random.Random(seed)
    fresh = _Fresh(rng)
    kinds = list(_KINDS)
    articles: list[Article] = []
    questions: list[Question] = []
    starts: set[str] = set()
    for i in range(entities):
        kind = kinds[i % len(kinds)]
        make_title, closing, facts = _KINDS[kind]
        name = fresh(make_title, starts)
        cap = name[0].upper() + name[1:]
        chosen = rng.sample(facts, rng.randint(4, min(6, len(facts))))
        lines = []
        for attribute, make, noun, shape, wh in chosen:
            value = fresh(make)
            lines.append(f"The {noun} {name} is {shape.format(v=value)}.")
            questions.append(
                Question(
                    f"q{len(questions):03d}", f"{wh} is the {noun} {name}?", [value], f"a{i:02d}", f"{kind}/{attribute}"
                )
            )
        lines = rng.sample(lines, len(lines)) + [f.format(n=name) for f in rng.sample(FILLER, 3)]
        lines.append(closing.format(n=name, N=cap))  # last: a small model copies a document's first sentence
        articles.append(Article(f"a{i:02d}", cap, " ".join(lines)))
    return articles, questions


# slot -> (first statement, update) as the user says them; {W} is "I" or "My cousin Ilsa", {s} and {ve} verb
# endings, {v} the value, {o} the previous value, {a} the pet's animal
_SLOTS = {
    "city": ("{W} live{s} in {v}.", "{W} moved from {o} to {v}."),
    "job": ("{W} work{s} as a {v}.", "{W} changed jobs and work{s} as a {v} now."),
    "pet": ("{W} ha{ve} a {a} called {v}.", ""),
}
_USER = "user"  # the speaker; everyone else is "<relation> <given name>"
_MAKERS = {"city": _place(PLACE_ENDS), "job": _pick(JOBS), "pet": _pick(PETS)}
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


def _slot_noun(who: str, slot: str, animal: str, owner: str) -> str:
    """How a slot is named in the assistant's notes and the questions ("the home city of the user", "the job
    of your cousin Ilsa"); owner is "your" in a note and "my" in a question."""
    noun = {"city": "home city", "job": "job", "pet": animal}[slot]
    if who == _USER:
        return f"the name of the user's {noun}" if slot == "pet" else f"the {noun} of the user"
    return f"the name of {owner} {who}'s {noun}" if slot == "pet" else f"the {noun} of {owner} {who}"


def dialogue(seed: int = 0, sessions: int = 12) -> tuple[list[Session], list[Question]]:
    """A multi-session chat stating facts about the user and four people they mention, some updated later.

    Each question asks for a fact's latest value; its target is the last session that states that fact.
    Other sessions state the same kinds of fact about other people, or older values (hard distractors).
    """
    if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
        raise InvalidRequestError(f"sessions must be an int of at least 1, got {sessions!r}")
    rng = random.Random(seed)
    fresh, starts = _Fresh(rng), set[str]()
    people = [_USER] + [f"{rel} {fresh(_pick(GIVEN))}" for rel in rng.sample(RELATIONS, 4)]
    said: list[tuple[int, str]] = []  # (session index, one exchange stating a fact)
    questions: list[Question] = []
    for who in people:
        user = who == _USER
        for slot, (first, update) in _SLOTS.items():
            if not user and rng.random() < 0.3:
                continue
            count = 1 if slot == "pet" else min(sessions, rng.choice([2, 3] if user else [1, 1, 2]))
            animal, value, at = rng.choice(ANIMALS), "", 0
            for at in sorted(rng.sample(range(sessions), count)):
                old, value = value, fresh(_MAKERS[slot], starts)
                line = (update if old else first).format(
                    W="I" if user else f"My {who}",
                    s="" if user else "s",
                    ve="ve" if user else "s",
                    v=value,
                    o=old,
                    a=animal,
                )
                # the assistant's note restates the fact in the words the question will use
                now = "" if slot == "pet" else "now "
                said.append(
                    (at, f"User: {line}\nAssistant: Noted: {_slot_noun(who, slot, animal, 'your')} is {now}{value}.")
                )
            noun = _slot_noun(who, slot, animal, "my")
            family = ("user" if user else "other") + ("-update" if count > 1 else "-single")
            questions.append(
                Question(
                    f"q{len(questions):03d}",
                    f"What is {noun}{'' if slot == 'pet' else ' now'}?",
                    [value],
                    f"s{at:02d}",
                    family,
                )
            )
    out = []
    for n in range(sessions):
        facts = [text for at, text in said if at == n]
        talk = [
            f"User: {line}\nAssistant: {reply}"  # small talk pads sessions with few facts to a similar size
            for line, reply in rng.sample(SMALL_TALK, max(2, 4 - len(facts)))
        ]
        head = f"Session {n + 1}, {rng.randint(1, 28)} {_MONTHS[n % 12]}."
        out.append(Session(f"s{n:02d}", "\n".join([head, *talk[:1], *facts, *talk[1:]])))
    return out, questions
