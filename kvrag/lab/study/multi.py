"""Built-in study sets whose questions need several chunks, generated from the single-chunk sets' sources.

Five sets, each its own family: `api_pairs` (two parameters' defaults from two API entries), `chat_pairs` (two
facts from two sessions of one chat), `compare` (which of two invented entities is older, larger, longer: one
number in each entity's article), `bridge` (one article names a person, the person's own article holds the
answer) and `lists` (one fact of each of three entities). Every fact an answer needs sits in exactly one chunk,
and no distractor holds any part of the answer (tested). This module never touches a model.
"""

from __future__ import annotations

import random
from typing import Iterator

from kvrag.lab.study.data import Chunk, StudyItem, absent, api_questions, api_entries
from kvrag.lab.study.metrics import contains_answer
from kvrag.lab.synthetic import Question, dialogue, encyclopedia

MULTI = ("api_pairs", "chat_pairs", "compare", "bridge", "lists")

# attribute -> (question with {a} and {b}, whether the smaller value wins)
_COMPARISONS = {
    "founded": ("Which was founded earlier, {a} or {b}?", True),
    "born_year": ("Who was born earlier, {a} or {b}?", True),
    "launched": ("Which ship was launched earlier, {a} or {b}?", True),
    "population": ("Which town has the larger population, {a} or {b}?", False),
    "length": ("Which river is longer, {a} or {b}?", False),
    "staff": ("Which company has more employees, {a} or {b}?", False),
}
# facts whose value is a person's name: a bridge's first hop
_PERSON_VALUED = {"founder", "mayor", "captain", "builder"}
# a person's facts a bridge may ask for
_PERSON_FACTS = {"born_year", "birthplace", "job", "work"}


def _join(first: str, second: str) -> str:
    """Two questions as one: "What is A, and who is B?"."""
    return f"{first.rstrip('?')}, and {second[0].lower()}{second[1:]}"


def _placed(rng: random.Random, targets: list[Chunk], distractors: list[Chunk], size: int) -> list[Chunk]:
    """`size` chunks: the targets at random places among the first distractors."""
    order = list(distractors[: size - len(targets)])
    for target in targets:
        order.insert(rng.randrange(len(order) + 1), target)
    return order


def _item(
    rng: random.Random,
    qid: str,
    family: str,
    kind: str,
    question: str,
    parts: list[list[str]],
    targets: list[Chunk],
    pool: list[Chunk],
    size: int,
    excludes: list[str] | None = None,
) -> StudyItem | None:
    """An item whose distractors (from `pool`, in its order) hold no part of the answer; None when too few do.
    `size` is the chunks it has, at least its targets."""
    size = max(size, len(targets))
    taken = {t.id for t in targets}
    needles = [a for part in parts for a in part] + (excludes or [])
    free = [c for c in pool if c.id not in taken and absent(needles, c.text)]
    if len(free) < size - len(targets):
        return None
    order = _placed(rng, targets, free, size)
    answers = parts[0] if len(parts) == 1 else [" and ".join(p[0] for p in parts)]
    return StudyItem(
        qid,
        family,
        question,
        answers,
        order,
        targets[0].id,
        "same",
        kind,
        targets=[t.id for t in targets],
        answers_all=parts if len(parts) > 1 else [],
        excludes=excludes or [],
    )


def multi(name: str, rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    """The items of the multi-chunk set `name`, endlessly (the caller stops at its limit)."""
    makers = {"api_pairs": _api_pairs, "chat_pairs": _chat_pairs, "compare": _compare, "bridge": _bridge}
    return {**makers, "lists": _lists}[name](rng, chunks)


def _api_pairs(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    entries = api_entries()
    texts = [Chunk(e["id"], e["text"]) for e in entries]
    defaults = [(i, q, a) for i, e in enumerate(entries) for kind, q, a in api_questions(e) if kind == "api/default"]
    defaults = [(i, q, a) for i, q, a in defaults if contains_answer(texts[i].text, a[0])]
    for n in range(10**6):
        (i, q1, a1), (j, q2, a2) = rng.sample(defaults, 2)
        if i == j or entries[i]["page"] == entries[j]["page"] or normalize_eq(a1[0], a2[0]):
            continue
        if not absent(a1, texts[j].text) or not absent(a2, texts[i].text):
            continue  # each part in exactly one of the two entries
        pages = {entries[i]["page"], entries[j]["page"]}
        same = [c for k, c in enumerate(texts) if entries[k]["page"] in pages]
        pool = rng.sample(same, len(same)) + rng.sample(texts, 60)
        item = _item(rng, f"apip{n:05d}", "api_pairs", "api/default+default", _join(q1, q2), [a1, a2],
                     [texts[i], texts[j]], pool, rng.randint(*chunks))
        if item is not None:
            yield item


def normalize_eq(a: str, b: str) -> bool:
    return contains_answer(a, b) or contains_answer(b, a)


def _chat_pairs(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    for talk in range(10**6):
        count = rng.randint(*chunks)
        sessions, questions = dialogue(rng.randrange(10**9), sessions=count)
        order = [Chunk(f"cp{talk}-{s.id}", s.text) for s in sessions]
        by_id = {s.id: c for s, c in zip(sessions, order)}
        rng.shuffle(questions)
        for q1, q2 in zip(questions[::2], questions[1::2]):
            if q1.target == q2.target:
                continue
            t1, t2 = by_id[q1.target], by_id[q2.target]
            if not absent(q1.answers, t2.text) or not absent(q2.answers, t1.text):
                continue
            if any(not absent(q1.answers + q2.answers, c.text) for c in order if c not in (t1, t2)):
                continue  # an older value may recur; the latest values must not
            yield StudyItem(
                f"cp{talk}-{q1.id}-{q2.id}",
                "chat_pairs",
                _join(q1.question, q2.question),
                [f"{q1.answers[0]} and {q2.answers[0]}"],
                order,
                t1.id,
                "same",
                f"{q1.family}+{q2.family}",
                targets=[t1.id, t2.id],
                answers_all=[q1.answers, q2.answers],
            )
            break  # one pair a chat: contexts vary


def _facts(questions: list[Question]) -> dict[str, dict[str, Question]]:
    """article id -> attribute -> the question asking for it."""
    out: dict[str, dict[str, Question]] = {}
    for q in questions:
        out.setdefault(q.target, {})[q.family.split("/")[1]] = q
    return out


def _world(rng: random.Random) -> tuple[int, dict[str, Chunk], dict[str, str], list[Question]]:
    world = rng.randrange(10**9)
    articles, questions = encyclopedia(world, entities=50)
    chunks = {a.id: Chunk(f"m{world}-{a.id}", a.text) for a in articles}
    return world, chunks, {a.id: a.title for a in articles}, questions


def _name(title: str) -> str:
    """An entity's name as a question says it ("the Velia", "Velloria")."""
    return "the " + title[4:] if title.startswith("The ") else title


def _compare(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    for _ in range(10**6):
        world, chunk, titles, questions = _world(rng)
        facts = _facts(questions)
        for attribute, (template, smaller) in rng.sample(sorted(_COMPARISONS.items()), len(_COMPARISONS)):
            having = [a for a in facts if attribute in facts[a]]
            if len(having) < 2:
                continue
            a, b = rng.sample(having, 2)
            va, vb = (int(facts[x][attribute].answers[0].replace(",", "")) for x in (a, b))
            if va == vb:
                continue
            win, lose = (a, b) if (va < vb) == smaller else (b, a)
            question = template.format(a=_name(titles[a]), b=_name(titles[b]))
            names = [[titles[win].removeprefix("The ")], [titles[lose].removeprefix("The ")]]
            pool = [chunk[x] for x in rng.sample(sorted(chunk), len(chunk))]
            item = _item(rng, f"cmp{world}-{a}-{b}", "compare", f"compare/{attribute}", question, names[:1],
                         [chunk[a], chunk[b]], pool, rng.randint(*chunks), excludes=names[1])
            if item is not None:
                yield item
                break


def _bridge(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    for _ in range(10**6):
        world, chunk, titles, questions = _world(rng)
        facts = _facts(questions)
        people = [a for a in facts if _PERSON_FACTS & set(facts[a])]  # only people have these facts
        links = [(a, f) for a in facts for f in facts[a] if f in _PERSON_VALUED]
        if not people or not links:
            continue
        (first, attribute), person = rng.choice(links), rng.choice(people)
        if first == person:
            continue
        hop = facts[first][attribute]  # "Who is the founder of Velloria?"
        fact = facts[person][rng.choice(sorted(_PERSON_FACTS & set(facts[person])))]  # "What is the birth year of X?"
        name = titles[person]
        named = Chunk(chunk[first].id, chunk[first].text.replace(hop.answers[0], name))  # Velloria's founder is X
        wh, noun = fact.question.split(" is the ", 1)
        question = f"{wh} is the {noun.removesuffix(f' {name}?')} {hop.question.split(' is ', 1)[1]}"
        pool = [chunk[x] for x in rng.sample(sorted(chunk), len(chunk)) if x != first]
        pool = [c for c in pool if not contains_answer(c.text, name) or c.id == chunk[person].id]
        item = _item(rng, f"br{world}-{first}-{person}", "bridge", f"bridge/{attribute}>{fact.family}", question,
                     [fact.answers], [named, chunk[person]], pool, rng.randint(*chunks))
        if item is not None:
            yield item


def _lists(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    for _ in range(10**6):
        world, chunk, titles, questions = _world(rng)
        by_family: dict[str, list[Question]] = {}
        for q in questions:
            by_family.setdefault(q.family, []).append(q)
        family = rng.choice(sorted(f for f, qs in by_family.items() if len(qs) >= 3))
        picked = rng.sample(by_family[family], 3)
        wh, rest = picked[0].question.split(" is the ", 1)
        noun = rest.removesuffix(f" {_name(titles[picked[0].target])}?")
        names = [_name(titles[q.target]) for q in picked]
        question = f"{wh} is the {noun} each of {names[0]}, {names[1]} and {names[2]}?"
        pool = [chunk[x] for x in rng.sample(sorted(chunk), len(chunk))]
        item = _item(rng, f"ls{world}-{'-'.join(q.id for q in picked)}", "lists", f"list/{family}", question,
                     [q.answers for q in picked], [chunk[q.target] for q in picked], pool, rng.randint(*chunks))
        if item is not None:
            yield item
