"""kvrag.lab.study.cache: append-only JSONL records read back whole, whatever an answer holds or a kill cut."""

from kvrag.lab.study.cache import Appender, digest, read_jsonl


def test_a_record_whose_answer_holds_a_unicode_line_separator_is_read_back(tmp_path) -> None:
    """JSON lines end at a newline only: an answer holding U+2028 or U+0085 is one record, not two broken ones."""
    append = Appender(tmp_path / "records.jsonl")
    append({"key": "a", "text": "one\u2028two\x85three\x1cfour"})
    append({"key": "b", "text": "next"})
    append.close()
    rows = read_jsonl(tmp_path, "records")
    assert rows["a"]["text"] == "one\u2028two\x85three\x1cfour" and rows["b"]["text"] == "next"


def test_a_line_cut_by_a_killed_writer_is_skipped_and_the_next_record_starts_on_its_own_line(tmp_path) -> None:
    path = tmp_path / "records.part.jsonl"
    path.write_text('{"key": "a", "v": 1}\n{"key": "b", "v"', encoding="utf-8")  # killed mid-record
    append = Appender(path)
    append({"key": "c", "v": 3})
    append.close()
    rows = read_jsonl(tmp_path, "records")
    assert set(rows) == {"a", "c"} and rows["c"]["v"] == 3


def test_digests_are_stable_and_order_free_for_mappings() -> None:
    assert digest({"a": 1, "b": 2}, 3) == digest({"b": 2, "a": 1}, 3) != digest({"a": 1, "b": 2}, 4)
    assert len(digest("x")) == 24
