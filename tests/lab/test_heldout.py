"""The held-out evaluation sets (kvrag.lab.heldout, kvrag/data/heldout): two halves that share no source and no
wording, every answer where the item says and nowhere else, questions no chunk answers scored by abstention."""

from pathlib import Path

import pytest

from kvrag.lab import heldout
from kvrag.lab.study.data import load_jsonl, parse_item
from kvrag.lab.study.metrics import abstains, correct

DATA = Path(heldout.__file__).resolve().parents[1] / "data" / "heldout"
FAMILIES = {"doc_fact", "doc_pair", "chat_fact", "chat_pair", "doc_absent", "chat_absent"}


@pytest.fixture(scope="module")
def halves():
    return {name: load_jsonl(DATA / f"{name}.jsonl") for name in ("choose", "judge")}


def test_each_half_has_every_family_and_no_skipped_line(halves):
    for items, problems in halves.values():
        assert not problems
        assert {i.family for i in items} == FAMILIES
        assert all(sum(i.family == f for i in items) == heldout.ITEMS for f in FAMILIES)


def test_the_halves_share_no_document_question_or_wording(halves):
    choose, judge = halves["choose"][0], halves["judge"][0]
    texts = lambda items: {c.text for i in items for c in i.chunks}  # noqa: E731
    assert not texts(choose) & texts(judge)
    assert not {i.question for i in choose} & {i.question for i in judge}
    pairs = [(heldout.CHOOSE_FACT, heldout.JUDGE_FACT), (heldout.CHOOSE_PAIR, heldout.JUDGE_PAIR)]
    for mine, theirs in pairs:
        assert not {w for ws in mine.values() for w in ws} & {w for ws in theirs.values() for w in ws}
    assert not set(heldout.CHOOSE_WORLD) & set(heldout.JUDGE_WORLD)
    assert not {w for ws in heldout.CHOOSE_CHAT.asks.values() for w in ws} & {
        w for ws in heldout.JUDGE_CHAT.asks.values() for w in ws
    }


def test_every_answer_is_in_its_target_and_in_no_other_document(halves):
    for items, _ in halves.values():
        for item in items:
            if not item.answerable:
                assert item.family.endswith("_absent") and not item.answers
                continue
            by_id = {c.id: c.text for c in item.chunks}
            for target, part in zip(item.target_ids, item.parts):
                assert correct(by_id[target], part), (item.id, target, part)
            if item.family.startswith("doc_"):  # a package's own other chunks may repeat it; no other package's
                own = {t.split("#")[0] for t in item.target_ids}
                for c in item.chunks:
                    if c.id.split("#")[0] not in own:
                        assert not any(correct(c.text, part) for part in item.parts), (item.id, c.id)


def test_cut_keeps_pieces_near_the_chunk_size_and_every_word():
    text = "\n".join(" ".join(f"w{i}-{j}" for j in range(40)) for i in range(20)) + "\n" + " ".join(["x"] * 400)
    pieces = heldout.cut(text, words=150)
    assert all(len(p.split()) <= 150 for p in pieces)
    assert sum(len(p.split()) for p in pieces) == len(text.split())


def test_an_unanswerable_item_is_right_when_the_output_abstains():
    row = {"id": "u", "family": "f", "question": "q?", "answerable": False, "chunks": [{"id": "a", "text": "t"}]}
    item = parse_item(row)
    assert not item.answerable and item.target == "a" and item.to_dict()["answerable"] is False
    assert item.is_correct("The documents do not say.") and item.is_correct("The context does not mention it.")
    assert not item.is_correct("Canberra.")
    assert abstains("This information is not provided.") and not abstains("It is provided under MIT.")
    with pytest.raises(ValueError, match="answerable"):
        parse_item({**row, "answerable": "no"})


@pytest.fixture(scope="module")
def deep():
    return {name: load_jsonl(DATA / f"{name}-deep.jsonl") for name in ("choose", "judge")}


def test_deep_items_answer_past_the_first_chunk_of_their_own_document_only(deep):
    for items, problems in deep.values():
        assert not problems and len(items) >= 12
        for item in items:
            assert item.family == "doc_deep" and item.answerable
            name, _, index = item.target.rpartition("#")
            assert int(index) > 0 and name.lower() in item.question.lower()
            by_id = {c.id: c.text for c in item.chunks}
            assert correct(by_id[item.target], item.answers)
            own = [c for c in item.chunks if c.id.startswith(name + "#")]
            assert not any(correct(c.text, item.answers) for c in own if int(c.id.rpartition("#")[2]) < int(index))
            assert not any(correct(c.text, item.answers) for c in item.chunks if c not in own), item.id


def test_the_deep_halves_share_no_document_and_no_wording(deep):
    docs = lambda items: {c.id.split("#")[0] for i in items for c in i.chunks}  # noqa: E731
    assert not docs(deep["choose"][0]) & docs(deep["judge"][0])
    assert not set(heldout.CHOOSE_DEEP) & set(heldout.JUDGE_DEEP)


def test_the_holders_of_a_copyright_field_are_its_people_in_order():
    field = "Copyright (C) 1997–1999 James Troup <troup@debian.org>\n 2005, 2013 Ryan Kavanagh <rak@x.org>\n© 2009 A"
    assert heldout._holders(field) == ["James Troup", "Ryan Kavanagh"]


def test_copyright_documents_read_dep5_files_naming_the_packaging(tmp_path):
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "copyright").write_text(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: foo\n\n"
        "Files: *\nCopyright: 2001 Ann Upstream\nLicense: MIT\n\nFiles: debian/*\nCopyright: 2010 Bob Packager\n"
        "License: MIT\n"
    )
    (tmp_path / "bar").mkdir()
    (tmp_path / "bar" / "copyright").write_text("This package was debianized by someone.\n")  # not DEP-5: skipped
    [doc] = heldout.copyright_documents(tmp_path)
    assert doc.name == "foo" and doc.fields == {"packaging": ["Bob Packager"]}
