"""`KVRAG.verify` and `kvrag verify`: every indexed chunk's stored KV read and checked, damage reported by chunk and
healed with --repair; an index with KV on demand is not damaged for what it has not stored yet."""

import shutil
from pathlib import Path

import pytest
from tiny import FACTS, save_tiny

from kvrag.cli import main
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.errors import InvalidRequestError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def rag(model_dir, tmp_path, monkeypatch):
    embedder = Embedder()
    monkeypatch.setattr("kvrag.engine.rag.Embedder", lambda name=None, device="cpu": embedder)
    engine = KVRAG.from_defaults(tmp_path / "index", model=str(model_dir), chunk_tokens=120, overlap=8,
                                 cache_dir=tmp_path / "cache")
    engine.ingest(FACTS, progress=False)
    return engine


def entry(rag, key):
    return next(Path(rag.path, "kv").rglob(f"{key}*.safetensors"))


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_verify_names_damaged_and_forged_entries_and_repair_heals_them(rag, capsys):
    clean = rag.verify()
    assert clean == {"checked": 5, "ok": 5, "damaged": 0, "missing": 0, "repaired": 0, "damaged_chunks": []}
    records = sorted(rag.index.records.values(), key=lambda r: r.id)
    flipped, forged, donor = records[0], records[1], records[2]
    blob = bytearray(entry(rag, flipped.key).read_bytes())
    blob[-10] ^= 0xFF
    entry(rag, flipped.key).write_bytes(bytes(blob))
    shutil.copyfile(entry(rag, donor.key), entry(rag, forged.key))  # a valid entry of other tokens at this key
    for key in (flipped.key, forged.key):
        rag.store.front.delete(key)  # the in-memory copies go: the disk entries are read
    found = rag.verify()
    assert found["damaged"] == 2 and found["ok"] == 3 and found["repaired"] == 0
    assert found["damaged_chunks"] == sorted([flipped.id, forged.id])
    code, out, err = cli(capsys, "verify", "--index", rag.path)
    assert code == 1 and "3 ok, 2 damaged" in out and "--repair" in err and flipped.id in err
    code, out, err = cli(capsys, "verify", "--index", rag.path, "--repair")
    assert code == 0 and "2 re-encoded and written back" in out, err
    code, out, _ = cli(capsys, "verify", "--index", rag.path)
    assert code == 0 and "5 ok, 0 damaged" in out
    question = "Who runs Velloria's harbour?"
    again = KVRAG.load(rag.path, cache_dir=rag.path.parent / "cache").query(question, top_k=5, max_new_tokens=4)
    assert again.stats.chunks_encoded == 0 and again.stats.store_hits == 5  # healed: read, never recomputed


def test_kv_on_demand_is_not_damage_and_a_read_only_engine_does_not_repair(model_dir, tmp_path, monkeypatch):
    embedder = Embedder()
    monkeypatch.setattr("kvrag.engine.rag.Embedder", lambda name=None, device="cpu": embedder)
    lazy = KVRAG.from_defaults(tmp_path / "lazy", model=str(model_dir), chunk_tokens=120, overlap=8,
                               cache_dir=tmp_path / "cache")
    lazy.ingest(FACTS, progress=False, encode=False)
    assert lazy.verify()["missing"] == 5 and lazy.verify()["damaged"] == 0
    opened = KVRAG.load(tmp_path / "lazy", cache_dir=tmp_path / "cache", read_only=True)
    with pytest.raises(InvalidRequestError, match="read-only: it cannot repair"):
        opened.verify(repair=True)
