"""kvrag.engine.index: dense and BM25-fused search with filters applied before top-k; copies; save and load whole."""

import numpy as np
import pytest

from kvrag.engine.index import ChunkIndex, ChunkRecord
from kvrag.rank import words
from kvrag.errors import InvalidRequestError

TEXTS = {
    "a#0": ("The river Tam floods every spring.", {"lang": "en"}),
    "b#0": ("Le port de Velloria compte nine navires.", {"lang": "fr"}),
    "c#0": ("The archive opens at nine.", {"lang": "en"}),
}


def unit(*values: float) -> np.ndarray:
    v = np.array(values, dtype=np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture
def index() -> ChunkIndex:
    index = ChunkIndex(3)
    records = [ChunkRecord(id=i, doc_id=i.split("#")[0], text=t, metadata=m) for i, (t, m) in TEXTS.items()]
    index.add(records, np.stack([unit(1, 0, 0), unit(0, 1, 0), unit(0.9, 0, 0.44)]))
    return index


def test_dense_search_is_best_first_and_filters_apply_before_top_k(index):
    hits = index.search(unit(1, 0, 0), "", top_k=2)
    assert [r.id for r, _ in hits] == ["a#0", "c#0"] and hits[0][1] == pytest.approx(1.0, abs=1e-6)
    assert [r.id for r, _ in index.search(unit(1, 0, 0), "", top_k=1, filters={"lang": "fr"})] == ["b#0"]
    assert [r.id for r, _ in index.search(unit(1, 0, 0), "", top_k=5, filters={"lang": ["fr", "en"]})] == [
        "a#0",
        "c#0",
        "b#0",
    ]
    assert index.search(unit(1, 0, 0), "", top_k=3, filters={"lang": "de"}) == []
    with pytest.raises(InvalidRequestError, match="top_k must be at least 1"):
        index.search(unit(1, 0, 0), "", top_k=0)


def test_bm25_fusion_lifts_the_chunk_that_shares_the_question_words(index):
    # dense: a, c, b; BM25: c (every word), b ("nine"), a (none); reciprocal-rank fusion puts c first
    question = "archive opens nine"
    assert index.search(unit(1, 0, 0), question, top_k=1)[0][0].id == "a#0"
    assert index.search(unit(1, 0, 0), question, top_k=1, bm25=True)[0][0].id == "c#0"


def test_a_copy_is_independent_and_removal_returns_the_documents_chunks(index):
    before = index.copy()
    gone = index.remove_doc("a")
    assert [r.id for r in gone] == ["a#0"] and len(index) == 2 and len(before) == 3
    assert index.docs() == {"b", "c"} and "a#0" in {r.id for r, _ in before.search(unit(1, 0, 0), "", top_k=1)}
    assert index.remove_doc("nothing") == []


def test_save_and_load_round_trip_by_generation(index, tmp_path):
    written = index.save(tmp_path, "g1")
    assert sorted(p.name for p in written) == ["chunks-g1.jsonl", "vectors-g1.safetensors"]
    back = ChunkIndex.load(tmp_path, 3, "g1")
    assert {r.id: r.text for r in back.records.values()} == {i: t for i, (t, _) in TEXTS.items()}
    assert [r.id for r, _ in back.search(unit(0, 1, 0), "", top_k=1)] == ["b#0"]
    (tmp_path / "vectors-g1.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not readable safetensors"):
        ChunkIndex.load(tmp_path, 3, "g1")


def test_words_are_lower_cased_word_runs():
    assert words("The Archive, opens at 9!") == ["the", "archive", "opens", "at", "9"]
