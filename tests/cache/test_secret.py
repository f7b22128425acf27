"""Keyed by default: the user's key, made once and private; every engine that writes a disk or Redis store keys its
entries and index with it; a forged entry is a miss with a warning, never an answer; another key finds nothing."""

import os
import stat

import pytest
from tiny import FACTS, HashEmbedder

from kvrag.cache.codec import encode_entry
from kvrag.cache.secret import check_secret, user_key, user_key_path
from kvrag.cache.store import DiskStore, MemoryStore, StoreWarning
from kvrag.engine.rag import KVRAG
from kvrag.errors import IndexLoadError, InvalidRequestError

pytestmark = pytest.mark.usefixtures("hash_embedder")
Q = "When does the archive open?"
GEN = dict(max_new_tokens=4, strategy="reuse")


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


def test_the_users_key_is_made_once_private_and_refused_when_others_may_read_it(config):
    key = user_key()
    path = user_key_path()
    assert path == config / "kvrag" / "key" and len(key) == 64 and user_key() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)
    with pytest.raises(InvalidRequestError, match="chmod 600"):
        user_key()
    path.unlink()
    os.symlink(config / "elsewhere", path)  # a link planted where the key goes is never followed
    with pytest.raises(InvalidRequestError, match="cannot read"):
        user_key()


def test_secrets_given_are_checked_and_an_empty_one_keys_nothing():
    assert check_secret("") == b"" and check_secret(None) == b"" and check_secret("s" * 16) == b"s" * 16
    with pytest.raises(InvalidRequestError, match="at least 16 bytes"):
        check_secret("short")


def test_an_engine_on_disk_is_keyed_by_the_users_key_and_one_in_memory_is_not(kv, tmp_path, config):
    on_disk = KVRAG.from_defaults(tmp_path / "index")
    assert on_disk.secret == user_key()
    assert KVRAG(kv, embedder=HashEmbedder(), store=DiskStore(tmp_path / "kv")).secret == user_key()
    assert KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore()).secret == b""
    assert KVRAG(kv, embedder=HashEmbedder(), store=DiskStore(tmp_path / "kv2"), secret="").secret == b""


def test_a_forged_entry_is_a_miss_with_one_warning_and_the_answer_is_full_prefills(kv, tmp_path, config):
    """The attack: an entry with the right token ids, other values and a valid unkeyed checksum, written where the
    engine's entry is. With the default key it fails its check: recomputed, never used."""
    rag = KVRAG(kv, embedder=HashEmbedder(), store=DiskStore(tmp_path / "kv"), path=tmp_path / "index")
    rag.ingest(FACTS, progress=False)
    rag.persist()
    want = rag.query(Q, **GEN)
    store = DiskStore(tmp_path / "kv")
    keys = list(store.keys())
    assert keys
    for key in keys:
        honest = rag.store.get(key)
        forged = type(honest)(
            keys=honest.keys.flip(-1), values=honest.values.flip(-1), token_ids=honest.token_ids,
            start=honest.start, encoder=honest.encoder,
        )
        store._write(key, encode_entry(forged, key=key, dtype="float16"))  # no secret: what a writer without it can do
    reopened = KVRAG.load(tmp_path / "index", store=DiskStore(tmp_path / "kv"), model=kv)
    with pytest.warns(StoreWarning, match="failed its check"):
        got = reopened.query(Q, **GEN)
    assert got.token_ids == want.token_ids and got.stats.chunks_encoded >= 1
    assert reopened.store.refused >= 1
    healed = KVRAG.load(tmp_path / "index", store=DiskStore(tmp_path / "kv"), model=kv)  # rewritten after the recompute
    assert healed.query(Q, **GEN).stats.chunks_encoded == 0 and healed.store.refused == 0


def test_a_tenant_with_another_key_finds_no_entry_under_the_same_label(kv, tmp_path, config):
    a = KVRAG(kv, embedder=HashEmbedder(), store=DiskStore(tmp_path / "kv"), namespace="tenant")
    a.ingest(FACTS, progress=False)
    written = set(a.store.keys())
    b = KVRAG(kv, embedder=HashEmbedder(), store=DiskStore(tmp_path / "kv"), namespace="tenant", secret="b" * 32)
    b.ingest(FACTS, progress=False)  # the same texts under the same label: every key differs, nothing is read
    assert written and b.store.hits == 0 and b.store.refused == 0
    assert written.isdisjoint(set(b.store.keys()) - written) and len(set(b.store.keys())) == 2 * len(written)


def test_an_index_built_unkeyed_is_opened_only_when_asked_to(kv, tmp_path, config):
    rag = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore(), path=tmp_path / "index", secret="")
    rag.ingest(FACTS, progress=False)
    rag.persist()
    with pytest.raises(IndexLoadError, match="--no-secret"):
        KVRAG.load(tmp_path / "index", store=MemoryStore(), model=kv)
    assert KVRAG.load(tmp_path / "index", store=MemoryStore(), secret="", model=kv).secret == b""


class FillingStore(DiskStore):
    """A disk store that fills up after `room` entries (a full disk, a Redis at maxmemory)."""

    room = 2

    def _write(self, key, blob):
        if sum(1 for _ in self.keys()) >= self.room:
            from kvrag.errors import StoreError

            raise StoreError("no space left on device")
        super()._write(key, blob)


def test_a_failed_ingest_removes_the_entries_it_wrote_and_says_so(kv, tmp_path, config):
    from kvrag.errors import StoreError

    rag = KVRAG(kv, embedder=HashEmbedder(), store=FillingStore(tmp_path / "kv"), path=tmp_path / "index")
    with pytest.raises(StoreError, match="the entries this ingest wrote were removed"):
        rag.ingest(FACTS, progress=False)
    assert list(rag.store.keys()) == [] and len(rag.index) == 0


def test_first_uses_at_once_agree_on_one_whole_key(config):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: user_key(), range(32)))
    assert len(set(keys)) == 1 and len(keys[0]) == 64
    assert [p.name for p in user_key_path().parent.iterdir()] == ["key"]  # no temporary file left
