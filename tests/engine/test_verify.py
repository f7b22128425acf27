"""`KVRAG.verify` and `kvrag verify`: every indexed chunk's stored KV read and checked, damage reported by chunk and
healed with --repair (a sparse file of absurd size, a link, a folder or a FIFO at a chunk's key, a missing entry);
an index with KV on demand is not damaged for what it has not stored yet."""

import os
import shutil
import threading
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
    assert clean == {
        "checked": 5, "ok": 5, "damaged": 0, "missing": 0, "repaired": 0, "filled": 0, "damaged_chunks": []
    }
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


def _in_thread(fn, seconds=60.0):
    """fn() on a thread that must end within `seconds` (a FIFO's endless open fails the test, not the run)."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(value=fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "hung"
    return out["value"]


def test_a_sparse_entry_of_absurd_size_is_damaged_never_read_and_repair_replaces_it(rag, capsys):
    records = sorted(rag.index.records.values(), key=lambda r: r.id)
    huge = entry(rag, records[0].key)
    with open(huge, "r+b") as f:
        f.truncate(1 << 40)  # a sparse terabyte: before, read whole (MemoryError) and counted as stored
    rag.store.front.delete(records[0].key)
    found = rag.verify()
    assert found["damaged"] == 1 and found["damaged_chunks"] == [records[0].id] and found["ok"] == 4
    code, out, err = cli(capsys, "ask", "--index", rag.path, "Who runs Velloria's harbour?", "--top-k", "5",
                         "--max-new-tokens", "2")
    assert code == 0, err  # the entry is recomputed: an answer, no MemoryError
    code, out, err = cli(capsys, "verify", "--index", rag.path, "--repair")
    assert code == 0 and "1 re-encoded and written back" in out, err
    assert huge.stat().st_size < 1 << 20
    assert rag.verify()["ok"] == 5


def test_repair_replaces_a_link_a_folder_and_a_fifo_at_a_key_and_stores_a_missing_entry(rag, tmp_path, capsys):
    records = sorted(rag.index.records.values(), key=lambda r: r.id)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(entry(rag, records[4].key).read_bytes())
    linked, folder, fifo, gone = (entry(rag, r.key) for r in records[:4])
    linked.unlink()
    linked.symlink_to(outside)  # a valid entry's bytes, through a link
    folder.unlink()
    folder.mkdir()
    (folder / "inside").write_text("x")
    fifo.unlink()
    os.mkfifo(fifo)
    gone.unlink()
    for record in records:
        rag.store.front.delete(record.key)
    found = _in_thread(rag.verify)
    # before: all four counted as "not stored", and --repair left them (the link stayed in kv/)
    assert found["damaged"] == 3 and found["missing"] == 1 and found["ok"] == 1
    assert found["damaged_chunks"] == sorted(r.id for r in records[:3])
    code, out, err = cli(capsys, "verify", "--index", rag.path)
    assert code == 1 and "3 damaged, 1 not stored" in out
    code, out, err = _in_thread(lambda: cli(capsys, "verify", "--index", rag.path, "--repair"))
    assert code == 0 and "3 re-encoded and written back" in out and "1 not stored encoded and stored" in out, err
    for path in (linked, folder, fifo, gone):
        assert path.is_file() and not path.is_symlink()
    assert outside.read_bytes() == entry(rag, records[4].key).read_bytes()  # the link's target was never touched
    code, out, _ = cli(capsys, "verify", "--index", rag.path)
    assert code == 0 and "5 ok, 0 damaged, 0 not stored" in out
