"""kvrag.engine.folder: a commit writes a new generation and the manifest names it; a damaged or foreign manifest is
a clear IndexLoadError; only the committed generation is kept."""

import json

import numpy as np
import pytest

from kvrag.engine.folder import INDEX_FORMAT, MANIFEST, IndexFolder
from kvrag.engine.index import ChunkIndex, ChunkRecord
from kvrag.errors import IndexLoadError


def an_index(n: int) -> ChunkIndex:
    index = ChunkIndex(2)
    records = [ChunkRecord(id=f"d#{i}", doc_id="d", text=f"chunk {i}") for i in range(n)]
    index.add(records, np.tile(np.array([[1.0, 0.0]], np.float32), (n, 1)))
    return index


# what an engine's commit records (kvrag.engine.rag.KVRAG._commit)
FIELDS = {
    "dim": 2,
    "model": "m",
    "dtype": "float32",
    "fingerprint": "f",
    "architecture": "a",
    "weights": "w",
    "embedder": "e",
    "chunk_tokens": 200,
    "overlap": 20,
    "storage_dtype": "float16",
    "namespace": "",
}


def test_a_commit_names_its_generation_and_keeps_only_it(tmp_path):
    folder = IndexFolder(tmp_path)
    assert not folder.exists()
    first = folder.commit(an_index(1), FIELDS)
    second = folder.commit(an_index(3), FIELDS)
    manifest = folder.manifest()
    assert manifest["index"] == second != first and manifest["format"] == INDEX_FORMAT and manifest["model"] == "m"
    assert len(folder.load_index(manifest)) == 3
    assert all(first not in p.name for p in (tmp_path / "index").iterdir())


def test_a_missing_damaged_or_foreign_manifest_is_a_clear_error(tmp_path):
    folder = IndexFolder(tmp_path)
    with pytest.raises(IndexLoadError, match="no kvrag index at"):
        folder.manifest()
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(IndexLoadError, match="unreadable"):
        folder.manifest()
    (tmp_path / MANIFEST).write_text(json.dumps({"format": 1}))
    with pytest.raises(IndexLoadError, match="index format 1"):
        folder.manifest()
    with pytest.raises(IndexLoadError, match="damaged"):
        folder.load_index({"dim": 2, "index": "missing"})


def test_the_lock_is_exclusive_or_shared_and_needs_the_folder(tmp_path):
    folder = IndexFolder(tmp_path / "absent")
    with folder.lock():  # no folder yet: nothing to lock, nothing created
        pass
    assert not (tmp_path / "absent").exists()
    with IndexFolder(tmp_path).lock(shared=True), IndexFolder(tmp_path).lock(shared=True):
        pass  # two readers at once
