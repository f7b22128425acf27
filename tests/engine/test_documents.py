"""kvrag.engine.documents: files of any bytes and suffix become one document of their UTF-8 text, or are skipped and
named with their reason (refused at once when no skip list is given); a folder's bad file never stops the others."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.engine.documents import Skipped, to_documents
from kvrag.errors import DocumentError, KVRAGError


@given(content=st.binary(max_size=300), suffix=st.sampled_from([".txt", ".md", ".rst", ".bin", "", ".TXT"]))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_file_parsing(tmp_path_factory, content, suffix):
    path = tmp_path_factory.mktemp("f") / f"doc{suffix}"
    path.write_bytes(content)
    try:
        docs = to_documents(path)
    except DocumentError as err:
        assert isinstance(err, KVRAGError) and str(path) in str(err)
        skipped: list[Skipped] = []
        try:
            to_documents(path, skipped=skipped)
        except DocumentError as again:
            assert "every file was skipped" in str(again) and str(path) in str(again)
        assert [s.path for s in skipped] == [str(path)] and skipped[0].reason
        return
    text = content.decode("utf-8")
    assert len(docs) == 1 and docs[0].text == text and text.strip() and "\x00" not in text
    assert docs[0].id == str(path)


def test_a_folder_with_one_binary_file_among_twenty_text_files_ingests_the_twenty(tmp_path):
    for i in range(20):
        (tmp_path / f"note{i:02}.txt").write_text(f"Note {i}: the bell of Orrin rings {i} times.")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    skipped: list[Skipped] = []
    docs = to_documents(tmp_path, skipped=skipped)
    assert len(docs) == 20
    assert skipped == [Skipped(str(tmp_path / "logo.png"), "binary, or text not in UTF-8 (it holds NUL bytes)")]


def test_text_files_of_any_suffix_are_read_and_every_bad_file_is_named(tmp_path):
    package = tmp_path / "shellingham-1.5.4.dist-info"
    package.mkdir()
    (package / "METADATA").write_text("Metadata-Version: 2.1\nName: shellingham\nAuthor: Tzu-ping Chung\n")
    (package / "LICENSE").write_text("ISC License\n\nCopyright (c) 2018, Tzu-ping Chung\n")
    (package / "RECORD.csv").write_text("shellingham/__init__.py,sha256=abc,1234\n")
    (package / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (package / "empty.md").write_text("  \n")
    (package / "utf16.txt").write_bytes("text".encode("utf-16"))
    (package / ".env").write_text("SECRET=1")
    (package / ".git").mkdir()
    (package / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (package / "idx").mkdir()
    (package / "idx" / "kvrag-index.json").write_text("{}")
    skipped: list[Skipped] = []
    docs = to_documents(package, skipped=skipped)
    assert sorted(d.metadata["source"].rsplit("/", 1)[1] for d in docs) == ["LICENSE", "METADATA", "RECORD.csv"]
    reasons = {s.path.rsplit("/", 1)[1]: s.reason for s in skipped}
    assert set(reasons) == {".git", "idx", ".env", "empty.md", "latin1.txt", "utf16.txt"}
    assert reasons["latin1.txt"].startswith("not UTF-8 text (byte 3)") and "NUL" in reasons["utf16.txt"]
    assert reasons["empty.md"].startswith("empty") and "hidden" in reasons[".env"] and "index" in reasons["idx"]


def test_without_a_skip_list_a_bad_file_is_refused_naming_it(tmp_path):
    (tmp_path / "a.txt").write_text("The mill of Brenn grinds barley.")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe")
    try:
        to_documents(tmp_path)
    except DocumentError as err:
        assert f"cannot ingest {tmp_path / 'b.txt'}: not UTF-8 text (byte 0)" in str(err)
    else:
        raise AssertionError("a file that is not UTF-8 was read")
