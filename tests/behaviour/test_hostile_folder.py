"""A hostile tenant's index folder and input files (435e88b): confinement, input files, integrity and forgery.

Every case keeps an "outside" folder (with a sentinel) next to the index folder and ends by checking that
nothing outside the index folder was created, modified or deleted: a link, a path in a manifest or a forged
entry never makes kvrag read, write or delete elsewhere, and never makes an answer wrong with exit 0.
"""

import json
import os
import shutil
import stat
import struct
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import FACTS, HashEmbedder, save_tiny

from kvrag.cache.codec import decode_entry, encode_entry
from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import StoreWarning
from kvrag.cli import main
from kvrag.engine import documents
from kvrag.engine.folder import MANIFEST
from kvrag.engine.rag import KVRAG
from kvrag.errors import DocumentError, IndexLoadError, InvalidRequestError

Q = "Who runs Velloria's harbour?"
GEN = {"top_k": 2, "max_new_tokens": 6}
ASK = ["--top-k", "2", "--max-new-tokens", "6"]
QUESTIONS = [
    Q,
    "When was the lighthouse of Karsa built?",
    "What does the river Tam do in spring?",
    "What does the old mill of Brenn grind?",
]
SECRET = "s" * 32


@pytest.fixture(autouse=True)
def hash_embedder(monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", HashEmbedder)


# -- the world: a healthy index, its healthy answers, and everything outside the index folder -----------


def snapshot(root, skip=()):
    """Every path under `root` (links not followed): kind, and for a file its size, mtime and bytes."""
    root, skip = Path(root), {Path(s) for s in skip}
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(n for n in dirnames if here / n not in skip)
        for name in dirnames + sorted(filenames):
            path = here / name
            if path in skip:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                seen[str(path)] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                seen[str(path)] = ("dir",)
            elif stat.S_ISREG(st.st_mode):
                seen[str(path)] = ("file", st.st_size, st.st_mtime_ns, path.read_bytes())
            else:  # a FIFO: never opened
                seen[str(path)] = ("other", stat.S_IFMT(st.st_mode))
    return seen


def tree(root):
    """An index folder's names and bytes (links shown as links)."""
    return {k: v[:2] + v[3:] if v[0] == "file" else v for k, v in snapshot(root).items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


def _healthy(path, model_dir, secret=None):
    """Build an index of FACTS at `path`; return what a healthy engine on it answers and ranks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvrag.engine.rag.Embedder", HashEmbedder)
        kwargs = {"secret": secret} if secret else {}
        KVRAG.from_defaults(path, model=str(model_dir), **kwargs).ingest(FACTS, progress=False)
        rag = KVRAG.load(path, **kwargs)  # every chunk's KV stored: nothing is written
        answer = rag.query(Q, **GEN)
        assert answer.stats.store_hits == 2 and answer.stats.chunks_encoded == 0
        return {
            "path": path,
            "token_ids": answer.token_ids,
            "text": answer.text,
            "top": [s.id for s in answer.sources],
            "ranks": {q: [s.id for s in rag.retrieve(q, top_k=5)] for q in QUESTIONS},
            "records": {r.id: r for r in rag.index.records.values()},
        }


@pytest.fixture(scope="module")
def golden(tmp_path_factory, model_dir):
    return _healthy(tmp_path_factory.mktemp("golden") / "idx", model_dir)


@pytest.fixture(scope="module")
def golden_secret(tmp_path_factory, model_dir):
    return _healthy(tmp_path_factory.mktemp("golden-secret") / "idx", model_dir, secret=SECRET)


class World:
    """tmp_path with `idx` (a copy of a healthy index) and `outside` (a sentinel); `seal` records everything
    but `idx`, `check` asserts it is all as recorded."""

    def __init__(self, tmp_path, model_dir, goldens):
        self.root, self.model_dir, self.goldens = tmp_path, model_dir, goldens
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        (self.outside / "sentinel.txt").write_text("do not touch")
        self.idx = tmp_path / "idx"
        self.skip = [self.idx]
        self.sealed = None

    def copy(self, golden):
        shutil.copytree(golden["path"], self.idx, symlinks=True)
        return self.idx

    def watched(self):
        seen = snapshot(self.root, self.skip)
        for extra in [self.model_dir, *self.goldens]:
            seen.update(snapshot(extra))
        return seen

    def seal(self):
        self.sealed = self.watched()
        assert str(self.outside / "sentinel.txt") in self.sealed

    def check(self):
        assert self.sealed is not None, "seal() the world before acting in it"
        now = self.watched()
        assert sorted(set(now) - set(self.sealed)) == [], "created outside the index folder"
        assert sorted(set(self.sealed) - set(now)) == [], "deleted outside the index folder"
        assert [k for k in now if now[k] != self.sealed[k]] == [], "modified outside the index folder"


@pytest.fixture
def world(tmp_path, model_dir, golden):
    return World(tmp_path, model_dir, [golden["path"]])


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvrag: error: "), (code, err)
    for word in words:
        assert word in lines[0], (word, lines[0])


def entry(idx, key):
    return idx / "kv" / key[:2] / f"{key}.kv.safetensors"


def in_thread(fn, timeout_s=30.0, unblock=None):
    """fn() on a daemon thread; what it raised (None if nothing). A hang past timeout_s fails the test."""
    done = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            done["error"] = exc
        done["ended"] = True

    worker = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        if unblock is not None:
            unblock()
        pytest.fail(f"hung for {timeout_s:.0f} s")
    return done.get("error"), time.monotonic() - t0


# -- 1. confinement -------------------------------------------------------------------------------------


def test_1a_an_index_subfolder_linked_outside_is_refused_and_nothing_there_deleted(world, golden, capsys):
    idx = world.copy(golden)
    bait = world.outside / "bait"
    shutil.move(idx / "index", bait)  # the real index files, which a commit's sweep of old generations would take
    (bait / "vectors-0123456789abcdef.safetensors").write_text("precious")
    (bait / "chunks-0123456789abcdef.jsonl").write_text("precious")
    (bait / "notes.txt").write_text("precious")
    (idx / "index").symlink_to(bait, target_is_directory=True)
    (world.root / "new.txt").write_text("The glass tower of Quillon has ninety floors.")
    world.seal()

    code, _, err = cli(capsys, "ingest", world.root / "new.txt", "--index", idx, "--quiet")
    one_error(code, err, "symbolic link")
    with pytest.raises(IndexLoadError, match="symbolic link"):
        KVRAG.load(idx)
    assert sorted(p.name for p in bait.iterdir()) == sorted(
        [*(p.name for p in (golden["path"] / "index").iterdir()), "vectors-0123456789abcdef.safetensors"]
        + ["chunks-0123456789abcdef.jsonl", "notes.txt"]
    )
    world.check()


def test_1b_a_kv_folder_linked_outside_is_never_written_or_read(world, golden, capsys):
    idx = world.copy(golden)
    bait = world.outside / "kv-bait"  # empty: an ask that followed the link would store recomputed KV there
    bait.mkdir()
    (bait / "sentinel.txt").write_text("do not touch")
    shutil.rmtree(idx / "kv")
    (idx / "kv").symlink_to(bait, target_is_directory=True)
    world.seal()

    code, out, err = cli(capsys, "ask", Q, "--index", idx, *ASK)
    one_error(code, err, "symbolic link")
    assert out == ""
    code, _, err = cli(capsys, "info", "--index", idx)
    one_error(code, err, "symbolic link")
    with pytest.raises(IndexLoadError, match="symbolic link"):
        KVRAG.load(idx)
    with pytest.raises(IndexLoadError, match="symbolic link"):
        KVRAG.from_defaults(idx)
    assert sorted(p.name for p in bait.iterdir()) == ["sentinel.txt"]
    world.check()


def test_1c_a_lock_file_linked_to_a_missing_outside_path_is_never_created(world, golden, capsys):
    idx = world.copy(golden)
    target = world.outside / "created-by-kvrag"
    (idx / ".kvrag.lock").unlink()
    (idx / ".kvrag.lock").symlink_to(target)
    (world.root / "new.txt").write_text("The glass tower of Quillon has ninety floors.")
    world.seal()

    code, _, err = cli(capsys, "info", "--index", idx)
    one_error(code, err, "symbolic link", ".kvrag.lock")
    assert not os.path.lexists(target)
    code, _, err = cli(capsys, "ingest", world.root / "new.txt", "--index", idx, "--quiet")
    one_error(code, err, "symbolic link", ".kvrag.lock")
    assert not os.path.lexists(target)
    assert os.readlink(idx / ".kvrag.lock") == str(target)
    world.check()


@pytest.mark.parametrize("generation", ["/../../../outside/x", "../x"])
def test_1d_a_manifest_index_that_leaves_the_folder_is_damaged(world, golden, capsys, generation):
    idx = world.copy(golden)
    manifest = json.loads((idx / MANIFEST).read_text())
    real = manifest["index"]
    # Plant a complete index where the generation's file names lead. `vectors-/../../../outside/x.safetensors`
    # under idx/index is outside/x.safetensors once the folder `vectors-` exists; `vectors-../x.safetensors`
    # is x.safetensors in a folder `vectors-..`, which kvrag never writes.
    escapes = generation.startswith("/")
    for stem, suffix in (("vectors", ".safetensors"), ("chunks", ".jsonl")):
        hop = idx / "index" / (f"{stem}-" if escapes else f"{stem}-..")
        hop.mkdir()
        planted = (world.outside if escapes else hop) / f"x{suffix}"
        blob = (idx / "index" / f"{stem}-{real}{suffix}").read_bytes()
        planted.write_bytes(blob.replace(b"Velloria", b"PLANTED!") if stem == "chunks" else blob)
        assert (idx / "index" / f"{stem}-{generation}{suffix}").read_bytes() == planted.read_bytes()  # reachable
    manifest["index"] = generation
    manifest.pop("checksums", None)
    (idx / MANIFEST).write_text(json.dumps(manifest))
    world.seal()

    with pytest.raises(IndexLoadError, match="damaged") as raised:
        KVRAG.load(idx)
    assert "generation" in str(raised.value)
    code, out, err = cli(capsys, "info", "--index", idx)
    one_error(code, err, "damaged")
    code, out, err = cli(capsys, "ask", Q, "--index", idx, *ASK)
    one_error(code, err, "damaged")
    assert "PLANTED" not in out
    world.check()


@pytest.mark.parametrize("linked", ["entry", "bucket"])
def test_1e_a_kv_entry_or_bucket_linked_outside_is_recomputed_not_followed(world, golden, capsys, linked):
    idx = world.copy(golden)
    keys = [golden["records"][i].key for i in golden["top"]]
    target = keys[0]
    if linked == "entry":  # the very entry, moved outside: following the link would read a valid entry
        moved = world.outside / "stolen.kv.safetensors"
        shutil.move(entry(idx, target), moved)
        entry(idx, target).symlink_to(moved)
        lost = [target]
    else:
        moved = world.outside / "bucket"
        shutil.move(idx / "kv" / target[:2], moved)
        (idx / "kv" / target[:2]).symlink_to(moved, target_is_directory=True)
        lost = [k for k in keys if k[:2] == target[:2]]
    world.seal()

    with pytest.warns(StoreWarning, match="symbolic link"):
        code, out, err = cli(capsys, "ask", Q, "--index", idx, "--json", *ASK)
    assert code == 0, err
    answer = json.loads(out)
    assert answer["text"] == golden["text"]
    assert answer["stats"]["chunks_encoded"] == len(lost) and answer["stats"]["store_hits"] == 2 - len(lost)

    rag = KVRAG.load(idx)  # writable: the recomputed chunk may be stored, but never through the link
    with pytest.warns(StoreWarning, match="symbolic link"):
        answer = rag.query(Q, **GEN)
    assert answer.token_ids == golden["token_ids"]
    assert answer.stats.chunks_encoded == len(lost) and answer.stats.store_hits == 2 - len(lost)
    world.check()


def test_1f_read_only_commands_write_nothing_into_the_index_folder(world, golden, capsys):
    idx = world.copy(golden)
    for path in (idx / "kv").rglob("*.kv.safetensors"):
        path.unlink()
    (idx / ".kvrag.lock").unlink()
    before = tree(idx)
    (world.root / "questions.txt").write_text(Q + "\n")
    out_dir = world.root / "agree-out"
    world.skip.append(out_dir)  # agree's declared output, checked below
    world.seal()

    code, out, err = cli(capsys, "ask", Q, "--index", idx, "--json", *ASK)
    assert code == 0, err
    answer = json.loads(out)
    assert answer["text"] == golden["text"] and answer["stats"]["chunks_encoded"] == 2
    assert tree(idx) == before
    code, out, err = cli(capsys, "info", "--index", idx)
    assert code == 0, err
    assert tree(idx) == before
    info = json.loads(out)
    assert (info["chunks"], info["kv_entries"], info["kv_missing"]) == (5, 0, 5)
    code, out, err = cli(
        capsys, "agree", "--index", idx, "--questions", world.root / "questions.txt", "--out", out_dir,
        "--candidates", "target_recompute", "--budgets", "0.05", "--limit", "1", "--max-new-tokens", "4",
        "--top-k", "2", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert (out_dir / "results.json").is_file()
    rag = KVRAG.load(idx, read_only=True)
    assert rag.query(Q, **GEN).token_ids == golden["token_ids"]
    assert tree(idx) == before
    assert not os.path.lexists(idx / ".kvrag.lock")
    world.check()


# -- 2. input files -------------------------------------------------------------------------------------


def docs_of(idx):
    return len(KVRAG.load(idx, read_only=True).index.docs())


def test_2a_a_linked_input_file_or_folder_is_refused_unless_asked(world, golden, capsys):
    idx = world.copy(golden)
    secret = world.outside / "secret.txt"
    secret.write_text("The vault code of the Orrin bank is 4471.")
    link = world.root / "passwd.txt"
    link.symlink_to(secret)
    docs = world.root / "docs"
    docs.mkdir()
    (docs / "ok.txt").write_text("The glass tower of Quillon has ninety floors.")
    (docs / "leak").symlink_to(world.outside, target_is_directory=True)
    world.seal()

    rag = KVRAG.load(idx)
    for item in (link, docs):
        with pytest.raises(DocumentError, match="symbolic link"):
            rag.ingest(item, progress=False)
        code, _, err = cli(capsys, "ingest", item, "--index", idx, "--quiet")
        one_error(code, err, "symbolic link", "--follow-symlinks")
    assert docs_of(idx) == 5 and "4471" not in " ".join(r.text for r in rag.index.records.values())

    code, _, err = cli(capsys, "ingest", link, "--index", idx, "--quiet", "--follow-symlinks")
    assert code == 0, err
    assert docs_of(idx) == 6
    stats = rag.ingest(link, progress=False, follow_symlinks=True)  # the same file: the same document
    assert stats.documents == 1 and stats.encoded == 0 and len(rag.index.docs()) == 6
    assert rag.retrieve("What is the vault code of the Orrin bank?", top_k=1)[0].text == secret.read_text()
    world.check()


def test_2b_a_fifo_is_refused_at_once(world, golden, capsys):
    idx = world.copy(golden)
    fifo = world.root / "pipe.txt"
    os.mkfifo(fifo)
    world.seal()

    def unblock():  # a reader blocked opening the FIFO gets end-of-file
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    rag = KVRAG.load(idx)
    error, took = in_thread(lambda: rag.ingest(fifo, progress=False), timeout_s=20, unblock=unblock)
    assert isinstance(error, DocumentError) and "not a regular file" in str(error), error
    assert took < 10
    result = {}
    error, took = in_thread(
        lambda: result.update(zip(("code", "out", "err"), cli(capsys, "ingest", fifo, "--index", idx, "--quiet"))),
        timeout_s=20,
        unblock=unblock,
    )
    assert error is None, error
    one_error(result["code"], result["err"], "not a regular file")
    assert docs_of(idx) == 5
    world.check()


def test_2c_a_link_to_dev_zero_is_refused_even_when_links_are_followed(world, golden, monkeypatch):
    idx = world.copy(golden)
    zero = world.root / "zero.txt"
    zero.symlink_to("/dev/zero")
    world.seal()
    read = documents.LOADERS[".txt"]

    def guarded(path):  # reading /dev/zero never ends: a regression fails here instead of filling memory
        assert os.path.realpath(path) != "/dev/zero", "kvrag read /dev/zero"
        return read(path)

    monkeypatch.setitem(documents.LOADERS, ".txt", guarded)
    rag = KVRAG.load(idx)
    with pytest.raises(DocumentError, match="symbolic link"):
        rag.ingest(zero, progress=False)
    with pytest.raises(DocumentError, match="not a regular file"):
        rag.ingest(zero, progress=False, follow_symlinks=True)
    assert docs_of(idx) == 5
    world.check()


def test_2d_a_file_over_the_size_limit_is_refused_naming_the_limit(world, golden, capsys):
    idx = world.copy(golden)
    big = world.root / "big.txt"
    big.write_text("The harbour of Velloria. " * 24_000)  # 600,000 bytes
    world.seal()

    rag = KVRAG.load(idx)
    with pytest.raises(DocumentError, match=r"0\.6 MB, over the 0\.2 MB limit"):
        rag.ingest(big, progress=False, max_file_bytes=200_000)
    code, _, err = cli(capsys, "ingest", big, "--index", idx, "--quiet", "--max-file-mb", "0.5")
    one_error(code, err, "over the 0.5 MB limit", "--max-file-mb")
    assert docs_of(idx) == 5
    world.check()


def test_2e_one_file_under_several_spellings_is_one_document(world, golden, monkeypatch):
    idx = world.copy(golden)
    (world.root / "dir").mkdir()
    (world.root / "dir" / "a.txt").write_text("The glass tower of Quillon has ninety floors.")
    monkeypatch.chdir(world.root)
    world.seal()

    rag = KVRAG.load(idx)
    spellings = [Path("dir/a.txt"), Path("dir/../dir/a.txt"), world.root / "dir" / "a.txt", Path("./dir//a.txt")]
    for n, path in enumerate(spellings):
        stats = rag.ingest(path, progress=False)
        assert (stats.documents, stats.encoded) == (1, 1 if n == 0 else 0)
        assert (len(rag.index.docs()), len(rag.index)) == (6, 6), path
    texts = [s.text for s in rag.retrieve("How many floors has the glass tower of Quillon?", top_k=3)]
    assert texts[0] == "The glass tower of Quillon has ninety floors." and len(set(texts)) == 3
    assert docs_of(idx) == 6
    world.check()


# -- 3. integrity and forgery ---------------------------------------------------------------------------


def _read_entry(rag, idx, key, secret=b""):
    kv = decode_entry(
        entry(idx, key).read_bytes(),
        key=key,
        encoder=rag.kvmodel.encoder_id,
        dtype=torch.float32,
        device="cpu",
        **({"secret": secret} if secret else {}),
    )
    assert kv is not None
    return kv


def test_3a_another_chunks_kv_at_a_chunks_key_is_refused(world, golden):
    idx = world.copy(golden)
    rag = KVRAG.load(idx)
    records = golden["records"]
    target = records[golden["top"][0]].key
    other = next(r.key for i, r in records.items() if i not in golden["top"])
    # signed with the index's own key (the key holder's mistake, or a copy between its keys)
    forged = encode_entry(_read_entry(rag, idx, other, secret=rag.secret), key=target, dtype="float16", secret=rag.secret)
    accepted = decode_entry(
        forged, key=target, encoder=rag.kvmodel.encoder_id, dtype=torch.float32, device="cpu", secret=rag.secret
    )
    assert accepted is not None  # the codec alone takes it: only the token-id check stands in the way
    entry(idx, target).write_bytes(forged)
    world.seal()

    with pytest.warns(StoreWarning, match="other tokens"):
        answer = rag.query(Q, **GEN)
    assert answer.token_ids == golden["token_ids"]
    assert answer.stats.store_hits == 1 and answer.stats.chunks_encoded == 1
    world.check()


def test_3b_under_a_secret_an_unkeyed_entry_with_the_right_tokens_is_a_miss(world, golden, golden_secret):
    world.goldens.append(golden_secret["path"])
    idx = world.copy(golden_secret)
    rag = KVRAG.load(idx, secret=SECRET)
    keys = {r.key for r in golden_secret["records"].values()}
    assert keys.isdisjoint(r.key for r in golden["records"].values())  # keys are HMACs under the secret
    target = golden_secret["records"][golden_secret["top"][0]].key
    real = _read_entry(rag, idx, target, secret=SECRET.encode())
    fake = ChunkKV(real.token_ids, real.keys, -3 * real.values + 1, real.start, real.encoder)
    forged = encode_entry(fake, key=target, dtype="float16")  # the right token ids, other values, unkeyed
    common = {"key": target, "encoder": rag.kvmodel.encoder_id, "dtype": torch.float32, "device": "cpu"}
    assert decode_entry(forged, **common) is not None and decode_entry(forged, **common, secret=SECRET.encode()) is None
    entry(idx, target).write_bytes(forged)
    world.seal()

    answer = rag.query(Q, **GEN)
    assert answer.token_ids == golden_secret["token_ids"]
    assert answer.stats.chunks_encoded == 1 and answer.stats.store_hits == 1
    world.check()


@pytest.mark.parametrize("field", ["key", "text"])
def test_3c_swapped_fields_in_the_records_file_fail_its_checksum(world, golden, capsys, field):
    idx = world.copy(golden)
    chunks = next((idx / "index").glob("chunks-*.jsonl"))
    rows = [json.loads(line) for line in chunks.read_text().splitlines()]
    rows[0][field], rows[1][field] = rows[1][field], rows[0][field]
    assert rows[0][field] != rows[1][field]
    chunks.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    world.seal()

    with pytest.raises(IndexLoadError, match="checksum"):
        KVRAG.load(idx)
    code, out, err = cli(capsys, "ask", Q, "--index", idx, *ASK)
    one_error(code, err, "checksum")
    assert out == ""
    world.check()


def _damage_vectors(path, row, how):
    """Scale one row by 1000, or flip the exponent byte of its first value; return the damaged vectors."""
    from safetensors import safe_open
    from safetensors.numpy import load, save

    blob = path.read_bytes()
    tensors = load(blob)
    at = int(np.flatnonzero(tensors["rows"] == row)[0])
    if how == "scaled row":
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata()
        tensors["vectors"][at] *= 1000
        path.write_bytes(save(tensors, metadata=metadata))
    else:
        (length,) = struct.unpack("<Q", blob[:8])
        start = json.loads(blob[8 : 8 + length])["vectors"]["data_offsets"][0]
        dim = tensors["vectors"].shape[1]
        byte = 8 + length + start + at * dim * 4 + 3  # the high byte (sign, exponent) of vectors[at, 0]
        path.write_bytes(blob[:byte] + bytes([blob[byte] ^ 0x40]) + blob[byte + 1 :])
    return load(path.read_bytes())


@pytest.mark.parametrize("how", ["scaled row", "flipped byte"])
def test_3d_a_damaged_vectors_file_is_rebuilt_and_ranks_as_healthy(world, golden, how):
    idx = world.copy(golden)
    q = QUESTIONS[1]
    second = golden["records"][golden["ranks"][q][1]]  # damaged, its row outranks the true first
    damaged = _damage_vectors(next((idx / "index").glob("vectors-*.safetensors")), second.row, how)
    ids = {r.row: i for i, r in golden["records"].items()}
    scores = damaged["vectors"] @ HashEmbedder().embed([q])[0]
    assert ids[int(damaged["rows"][int(np.argmax(scores))])] == second.id != golden["ranks"][q][0]
    world.seal()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rag = KVRAG.load(idx)
    assert {q: [s.id for s in rag.retrieve(q, top_k=5)] for q in QUESTIONS} == golden["ranks"]
    from kvrag.engine.folder import IndexWarning

    rebuilt = [w for w in caught if issubclass(w.category, IndexWarning) and "rebuilt" in str(w.message)]
    assert len(rebuilt) == 1, [str(w.message) for w in caught]
    assert rag.query(Q, **GEN).token_ids == golden["token_ids"]
    world.check()


def test_3e_a_secret_index_needs_its_secret_and_a_short_secret_is_refused(
    world, golden, golden_secret, model_dir, capsys
):
    world.goldens.append(golden_secret["path"])
    idx = world.copy(golden_secret)
    plain = world.root / "plain"
    shutil.copytree(golden["path"], plain, symlinks=True)
    world.skip.append(plain)
    (world.root / "secret.key").write_text(SECRET + "\n")
    (world.root / "short.key").write_text("s" * 15)
    world.seal()

    with pytest.raises(IndexLoadError, match="not your kvrag key"):
        KVRAG.load(idx)
    with pytest.raises(IndexLoadError, match="secret given does not match"):
        KVRAG.load(idx, secret="t" * 32)
    with pytest.raises(IndexLoadError, match="secret given does not match"):  # keyed by the user's key
        KVRAG.load(plain, secret=SECRET)
    for short in ("s" * 15, b"s" * 15):
        with pytest.raises(InvalidRequestError, match="at least 16 bytes"):
            KVRAG.from_defaults(world.root / "fresh", model=str(model_dir), secret=short)
    assert not os.path.lexists(world.root / "fresh")
    code, _, err = cli(capsys, "info", "--index", idx)
    one_error(code, err, "secret")
    code, _, err = cli(capsys, "info", "--index", idx, "--secret-file", world.root / "short.key")
    one_error(code, err, "secret", "at least 16")
    code, out, err = cli(capsys, "info", "--index", idx, "--secret-file", world.root / "secret.key")
    assert code == 0 and json.loads(out)["chunks"] == 5, err
    assert KVRAG.load(idx, secret=SECRET).query(Q, **GEN).token_ids == golden_secret["token_ids"]
    world.check()


@pytest.mark.parametrize("damage", ["model missing", "dim a string"])
def test_3f_a_manifest_with_a_missing_or_mistyped_field_is_one_line(world, golden, capsys, damage):
    idx = world.copy(golden)
    manifest = json.loads((idx / MANIFEST).read_text())
    if damage == "model missing":
        del manifest["model"]
    else:
        manifest["dim"] = str(manifest["dim"])
    (idx / MANIFEST).write_text(json.dumps(manifest))
    world.seal()

    for argv in (["info", "--index", idx], ["ask", Q, "--index", idx, *ASK]):
        code, out, err = cli(capsys, *argv)
        one_error(code, err, "damaged", "'model'" if damage == "model missing" else "'dim'")
        assert out == ""
    with pytest.raises(IndexLoadError, match="damaged"):
        KVRAG.load(idx)
    world.check()


# -- 4. a model folder whose weights can run code when read -------------------------------------------------


def test_a_model_folder_with_pickled_weights_is_refused_in_one_line_and_never_unpickled(tmp_path, capsys):
    import pickle

    class Planted:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "unpickled",))

    model = save_tiny(tmp_path / "model")
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Planted()}))
    note = tmp_path / "note.txt"
    note.write_text(FACTS[0][0])
    capsys.readouterr()  # save_tiny's progress bars
    assert main(["ingest", str(note), "--index", str(tmp_path / "idx"), "--model", str(model), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "safetensors weights only" in err[0], err
    assert not (tmp_path / "unpickled").exists()
