"""kvrag.engine.documents: files of any bytes and suffix become one document of their UTF-8 text, or a clear error."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.engine.documents import to_documents
from kvrag.errors import DocumentError, EmptyInputError, InvalidRequestError, KVRAGError


@given(content=st.binary(max_size=300), suffix=st.sampled_from([".txt", ".md", ".rst", ".bin", "", ".TXT"]))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_file_parsing(tmp_path_factory, content, suffix):
    path = tmp_path_factory.mktemp("f") / f"doc{suffix}"
    path.write_bytes(content)
    try:
        docs = to_documents(path)
    except (DocumentError, EmptyInputError, InvalidRequestError) as err:
        assert isinstance(err, KVRAGError) and str(path) in str(err) or "empty" in str(err)
        return
    assert len(docs) == 1 and docs[0].text == content.decode("utf-8") and docs[0].text.strip()
    assert suffix.lower() in (".txt", ".md", ".rst") and docs[0].id == str(path)
