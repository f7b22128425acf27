"""Study items: the JSONL format users bring, and the three built-in, seeded data sets.

One item is a question over a fixed list of chunks in their stitched order, with the id of the chunk that
holds the answer (the controlled setting of the study: the data places the target among distractors).
Built-in sets are generated here, deterministically from a seed, from files inside the package: nothing is
downloaded. This module never touches a model.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

from kvrag.errors import DocumentError
from kvrag.lab.study.metrics import abstains, contains_answer, correct, normalize, token_f1
from kvrag.lab.synthetic import dialogue, encyclopedia

SINGLE = ("api_docs", "open_qa", "dialogue")  # one chunk, one fact
MULTI = ("api_pairs", "chat_pairs", "compare", "bridge", "lists")  # several chunks (kvrag.lab.study.multi)
BUILTIN = SINGLE + MULTI
BUILTIN_LIMIT = 200  # items a built-in set gives when no limit is asked for (they are generated lazily)
DEFAULT_CHUNKS = (8, 10)  # chunks a question: keeps contexts near 1,000-1,300 tokens on the default model
_API_ENTRIES = Path(__file__).resolve().parents[2] / "data" / "python_docs" / "api_entries.jsonl"


@dataclass(frozen=True, slots=True)
class Chunk:
    id: str
    text: str
    doc: str = ""  # the document (or conversation) it is a part of, when the data names it

    @property
    def document(self) -> str:
        """The document it is a part of: as the data names it, else its id's part before the last '#' ("pkg#2" is
        "pkg"'s), else its own id (a chunk that is a whole document)."""
        return self.doc or self.id.rpartition("#")[0] or self.id


@dataclass(slots=True)
class StudyItem:
    """One question over chunks in their stitched order.

    A question may need several chunks (`targets`, every one needed) and several parts in its answer
    (`answers_all`, every part needed); a one-chunk, one-part item leaves both empty and has `target`, `answers`.
    """

    id: str  # unique in its file
    family: str  # data set or domain, e.g. "api_docs"; tables are per family
    question: str
    answers: list[str]  # accepted answers of a one-part answer; an output is right when it contains one
    chunks: list[Chunk]  # the stitched order
    target: str  # id of the chunk that holds the answer (of several: the first of `targets`)
    variant: str = ""  # optional: distractor kind, e.g. "same" or "mixed"; tables are per family and variant
    kind: str = ""  # optional: question kind, e.g. "api/default"
    meta: dict[str, Any] = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)  # every chunk the answer needs; [] means [target]
    answers_all: list[list[str]] = field(default_factory=list)  # each part's alternatives, all needed; [] = [answers]
    excludes: list[str] = field(default_factory=list)  # an output holding any of these is wrong (a comparison's loser)
    answerable: bool = True  # False: no chunk holds the answer; an output is right when it says so

    @property
    def target_index(self) -> int:
        return next(i for i, c in enumerate(self.chunks) if c.id == self.target)

    @property
    def target_ids(self) -> list[str]:
        """Every chunk the answer needs (one for a one-chunk item)."""
        return self.targets or [self.target]

    @property
    def target_indices(self) -> list[int]:
        where = {c.id: i for i, c in enumerate(self.chunks)}
        return [where[t] for t in self.target_ids]

    @property
    def parts(self) -> list[list[str]]:
        """The answer's parts, each a list of accepted alternatives."""
        return self.answers_all or [self.answers]

    def is_correct(self, output: str) -> bool:
        """Every part present (any of its alternatives) and no excluded string; for an item the documents cannot
        answer, an output that says they do not."""
        if not self.answerable:
            return abstains(output)
        return all(correct(output, part) for part in self.parts) and not correct(output, self.excludes)

    def gold_text(self) -> str:
        """The gold answer as one text: the parts' first alternatives, joined with "and"."""
        return " and ".join(part[0].strip() for part in self.parts)

    def f1(self, output: str) -> float:
        return token_f1(output, [self.gold_text()]) if self.answers_all else token_f1(output, self.answers)

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "id": self.id,
            "family": self.family,
            "question": self.question,
            "answers": self.answers,
            "chunks": [{"id": c.id, "text": c.text, **({"document": c.doc} if c.doc else {})} for c in self.chunks],
            "target": self.target,
        }
        if self.variant:
            row["variant"] = self.variant
        if self.kind:
            row["kind"] = self.kind
        if self.targets:
            row["targets"] = self.targets
        if self.answers_all:
            row["answers_all"] = self.answers_all
        if self.excludes:
            row["excludes"] = self.excludes
        if not self.answerable:
            row["answerable"] = False
        return row


# -- JSONL --------------------------------------------------------------------------------------------------


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise ValueError(f"'{key}' must be a list of strings")
    return [a for a in value if normalize(a)]


def _answer_fields(row: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """(answers, answers_all, excludes) of a row: `answers` or `answers_all` (a list of parts), or both."""
    parts: list[list[str]] = []
    if "answers_all" in row:
        if not isinstance(row["answers_all"], list) or not row["answers_all"]:
            raise ValueError("'answers_all' must be a non-empty list of parts, each a list of accepted strings")
        for n, part in enumerate(row["answers_all"]):
            kept = _strings(part, f"answers_all[{n}]")
            if not kept:
                raise ValueError(f"'answers_all' part {n} holds no answer with a letter or digit in it")
            parts.append(kept)
    if "answers" in row or not parts:
        answers = _strings(row.get("answers"), "answers")
        if not answers:
            raise ValueError("'answers' holds no answer with a letter or digit in it")
    else:
        answers = parts[0] if len(parts) == 1 else [" and ".join(part[0] for part in parts)]
    excludes = _strings(row.get("excludes", []), "excludes")
    return answers, parts, excludes


def _target_fields(row: dict[str, Any], ids: list[str]) -> tuple[str, list[str]]:
    """(target, targets): `target`, `targets` (every chunk needed), or both (then target is one of targets)."""
    targets: list[str] = []
    if "targets" in row:
        raw = row["targets"]
        if not isinstance(raw, list) or not raw or not all(isinstance(t, str) and t.strip() for t in raw):
            raise ValueError("'targets' must be a non-empty list of chunk ids")
        if len(set(raw)) != len(raw):
            raise ValueError("'targets' repeats a chunk id")
        targets = list(raw)
    target = row.get("target", targets[0] if targets else None)
    if not isinstance(target, str) or not target.strip():
        raise ValueError("'target' must be a non-empty string (or give 'targets')")
    for t in [target, *targets]:
        if t not in ids:
            raise ValueError(f"target '{t}' is not the id of one of its chunks")
    if targets and target not in targets:
        raise ValueError(f"target '{target}' is not one of 'targets'")
    return target, targets if len(targets) > 1 else []


def parse_item(row: Any) -> StudyItem:
    """One JSON object as a StudyItem, or a ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError(f"a line must be a JSON object, got {type(row).__name__}")
    for key in ("id", "family", "question"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"'{key}' must be a non-empty string")
    answerable = row.get("answerable", True)
    if not isinstance(answerable, bool):
        raise ValueError("'answerable' must be true or false when given")
    answers, answers_all, excludes = _answer_fields(row) if answerable else ([], [], [])
    chunks = row.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ValueError('\'chunks\' must be a non-empty list of {"id", "text"} objects')
    parsed = []
    for n, c in enumerate(chunks):
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(c.get("text"), str):
            raise ValueError(f"chunk {n} must be an object with string 'id' and 'text'")
        if not c["text"].strip():
            raise ValueError(f"chunk {n} ('{c['id']}') has no text")
        if not isinstance(c.get("document", ""), str):
            raise ValueError(f"chunk {n} ('{c['id']}'): 'document' must be a string when given")
        parsed.append(Chunk(c["id"], c["text"], c.get("document", "")))
    ids = [c.id for c in parsed]
    if len(set(ids)) != len(ids):
        raise ValueError("chunk ids repeat within the item")
    if not answerable and "target" not in row and "targets" not in row:
        row = {**row, "target": ids[0]}  # no chunk holds the answer: the first stands in where a row needs one
    target, targets = _target_fields(row, ids)
    for key in ("variant", "kind"):
        if not isinstance(row.get(key, ""), str):
            raise ValueError(f"'{key}' must be a string when given")
    return StudyItem(
        id=row["id"],
        family=row["family"],
        question=row["question"],
        answers=answers,
        chunks=parsed,
        target=target,
        variant=row.get("variant", ""),
        kind=row.get("kind", ""),
        targets=targets,
        answers_all=answers_all if len(answers_all) > 1 else [],
        excludes=excludes,
        answerable=answerable,
    )


def load_jsonl(path: str | Path) -> tuple[list[StudyItem], list[str]]:
    """Items of a study JSONL file, and one "FILE:LINE: reason" for every line skipped.

    A line that is not valid JSON, misses a field, has no usable answer, or names a target that is not one of
    its chunks is skipped and reported; a repeated id keeps the first. A file with no usable line is refused.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DocumentError(f"cannot read the study data {path}: {err.strerror or err}") from None
    items, problems, seen = [], [], set()
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            item = parse_item(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError:
            problems.append(f"{path}:{number}: not UTF-8 text")
            continue
        except json.JSONDecodeError as err:
            problems.append(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})")
            continue
        except ValueError as err:
            problems.append(f"{path}:{number}: {err}")
            continue
        if item.id in seen:
            problems.append(f"{path}:{number}: id '{item.id}' repeats an earlier line")
            continue
        seen.add(item.id)
        items.append(item)
    if not items:
        detail = "; ".join(problems[:3]) or "the file is empty"
        raise DocumentError(f"no usable study item in {path}: {detail}. The format is in docs/data_format.md")
    return items, problems


def write_jsonl(items: list[StudyItem], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item.to_dict(), ensure_ascii=False) + "\n")


# -- built-in data sets ----------------------------------------------------------------------------------


def absent(answers: list[str], text: str) -> bool:
    return not any(contains_answer(text, a) for a in answers)


def _place(rng: random.Random, target: Chunk, distractors: list[Chunk]) -> tuple[list[Chunk], int]:
    at = rng.randrange(len(distractors) + 1)
    return distractors[:at] + [target] + distractors[at:], at


@lru_cache(maxsize=1)
def api_entries() -> list[dict[str, Any]]:
    """The function and method entries of the bundled Python 3.11 library documentation."""
    with _API_ENTRIES.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


_TRIVIAL_DEFAULTS = {"None", "True", "False", "0", "1", "-1", "''", '""', "()", "[]", "{}"}
_RETURNS = re.compile(r"^Returns? (?P<what>[^.]{12,140}?)\.(?:\s|$)")


def api_questions(entry: dict[str, Any]) -> Iterator[tuple[str, str, list[str]]]:
    """(kind, question, answers) drawn from one entry's signature and first sentence."""
    name = entry["signature"].split("(", 1)[0]
    for param in entry["params"]:
        default = param["default"]
        if default is None or default in _TRIVIAL_DEFAULTS or len(default) > 24 or not normalize(default):
            continue
        answer = default.strip("'\"")
        yield "api/default", f"What is the default value of the {param['name']} parameter of {name}?", [answer]
    body = entry["text"].split("\n", 1)[1] if "\n" in entry["text"] else ""
    found = _RETURNS.match(body)
    short = name.rsplit(".", 1)[-1]
    if found and len(short) >= 4:
        what = found["what"]
        question = f"Which function returns {what}?"
        if not contains_answer(question, short):
            yield "api/returns", question, [short]


def _api_docs(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    entries = api_entries()
    texts = [Chunk(e["id"], e["text"]) for e in entries]
    candidates = [(i, *q) for i, e in enumerate(entries) for q in api_questions(e)]
    rng.shuffle(candidates)
    others = _mixed_pool(rng)
    for n, (i, kind, question, answers) in enumerate(candidates):
        target = texts[i]
        if not contains_answer(target.text, answers[0]):
            continue
        size = rng.randint(*chunks) - 1
        page = entries[i]["page"]
        same_page = [c for j, c in enumerate(texts) if j != i and entries[j]["page"] == page]
        rest = [c for j, c in enumerate(texts) if j != i and entries[j]["page"] != page]
        # same kind: entries of the same page first (the hard case: similar API pages), then any other entry
        same = rng.sample(same_page, len(same_page)) + rng.sample(rest, min(len(rest), 4 * size))
        mixed = _alternate(rng.sample(rest, 4 * size), rng.sample(others["article"] + others["session"], 4 * size))
        yield from _variants(rng, f"api{n:04d}", "api_docs", kind, question, answers, target, size, same, mixed)


def _variants(
    rng: random.Random,
    qid: str,
    family: str,
    kind: str,
    question: str,
    answers: list[str],
    target: Chunk,
    size: int,
    same: list[Chunk],
    mixed: list[Chunk] | None,
) -> Iterator[StudyItem]:
    """The item with same-kind distractors and, when given, the one with mixed ones, target at one position."""
    pools = [("same", same)] + ([("mixed", mixed)] if mixed is not None else [])
    chosen = {v: [c for c in pool if absent(answers, c.text)][:size] for v, pool in pools}
    if any(len(c) < size for c in chosen.values()):
        return
    at = rng.randrange(size + 1)
    for variant, distractors in chosen.items():
        order = distractors[:at] + [target] + distractors[at:]
        yield StudyItem(f"{qid}-{variant}", family, question, answers, order, target.id, variant, kind)


@lru_cache(maxsize=4)
def _world(seed: int) -> tuple[list[Chunk], list[Any], dict[str, str]]:
    articles, questions = encyclopedia(seed, entities=50)
    kinds = {q.target: q.family.split("/")[0] for q in questions}
    return [Chunk(f"w{seed}-{a.id}", a.text) for a in articles], questions, kinds


def _mixed_pool(rng: random.Random) -> dict[str, list[Chunk]]:
    """Texts of every built-in kind: API entries, encyclopedia articles and chat sessions."""
    api = [Chunk(e["id"], e["text"]) for e in rng.sample(api_entries(), 200)]
    articles = _world(rng.randrange(10**9))[0]
    sessions = [Chunk(f"d-{s.id}", s.text) for s in dialogue(rng.randrange(10**9), sessions=24)[0]]
    return {"api": api, "article": articles, "session": sessions}


def _alternate(first: list[Chunk], second: list[Chunk]) -> list[Chunk]:
    """first[0], second[0], first[1], ...: a mixed list stays half and half however much of it is used."""
    return [c for pair in zip(first, second) for c in pair]


def _open_qa(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    others = _mixed_pool(rng)
    for _ in range(1000):
        world = rng.randrange(10**9)
        articles, questions, kinds = _world(world)
        by_id = {c.id.split("-", 1)[1]: c for c in articles}
        for q in rng.sample(questions, 40):  # a few questions a world, so contexts vary
            target = by_id[q.target]
            size = rng.randint(*chunks) - 1
            kind = kinds[q.target]
            same_kind = [c for c in articles if c.id != target.id and kinds[c.id.split("-", 1)[1]] == kind]
            other_kind = [c for c in articles if c.id != target.id and kinds[c.id.split("-", 1)[1]] != kind]
            same = rng.sample(same_kind, len(same_kind)) + rng.sample(other_kind, len(other_kind))
            mixed = _alternate(
                rng.sample(other_kind, 2 * size), rng.sample(others["api"] + others["session"], 2 * size)
            )
            qid = f"w{world}-{q.id}"
            yield from _variants(rng, qid, "open_qa", q.family, q.question, q.answers, target, size, same, mixed)


def _dialogue(rng: random.Random, chunks: tuple[int, int]) -> Iterator[StudyItem]:
    for talk in range(100_000):
        count = rng.randint(*chunks)
        sessions, questions = dialogue(rng.randrange(10**9), sessions=count)
        order = [Chunk(f"c{talk}-{s.id}", s.text) for s in sessions]  # time order: the target's place varies
        for q in questions:
            yield StudyItem(
                f"c{talk}-{q.id}", "dialogue", q.question, q.answers, order, f"c{talk}-{q.target}", "same", q.family
            )


# the single-chunk sets' item makers, by name (SINGLE); the several-chunk ones are `kvrag.lab.study.multi`'s
SINGLE_MAKERS: dict[str, Callable[[random.Random, tuple[int, int]], Iterator[StudyItem]]] = {
    "api_docs": _api_docs,
    "open_qa": _open_qa,
    "dialogue": _dialogue,
}
