"""Tenants against a tenant with store access: each namespace its own view of a store (Redis prefix, disk
subfolder, memory key space), Redis ACL users limited to their prefix, and keys derived with a tenant secret."""

import pytest
import redis
from redis_server import RedisServer
from tiny import FACTS, HashEmbedder

from kvrag.cache.store import DiskStore, MemoryStore, RedisStore, StoreWarning, TieredStore
from kvrag.engine.rag import KVRAG
from kvrag.errors import StoreError

SECRET_DOC = "The vault code of the Orrin bank is 4471."
Q = "What is the vault code of the Orrin bank?"
pytestmark = pytest.mark.usefixtures("hash_embedder")
GEN = dict(max_new_tokens=3, strategy="reuse")
SECRET_A = b"tenant-a secret: 32 random bytes!"


@pytest.fixture(scope="module")
def server():
    server = RedisServer()
    yield server
    server.stop()


def engine(kv, store, namespace, **kwargs):
    return KVRAG(kv, embedder=HashEmbedder(), store=store, namespace=namespace, **kwargs)


def admin(server):
    return redis.Redis.from_url(server.url)


@pytest.fixture(autouse=True)
def flush(server):
    admin(server).flushdb()


def test_a_tenant_lists_and_counts_only_its_own_entries_in_a_shared_redis(kv, server):
    a = engine(kv, RedisStore(server.url), "tenant-a")
    b = engine(kv, RedisStore(server.url), "tenant-b")
    a.ingest([SECRET_DOC, *FACTS[:2]], progress=False)
    b.ingest(FACTS[2:], progress=False)
    names = sorted(k.decode() for k in admin(server).keys("*"))
    assert len(names) == 6 and all(n.startswith(("kvrag:kvrag:tenant-a:", "kvrag:kvrag:tenant-b:")) for n in names)
    assert sorted(a.store.keys()) == sorted(n.rsplit(":", 1)[1] for n in names if ":tenant-a:" in n)
    assert sorted(b.store.keys()) == sorted(n.rsplit(":", 1)[1] for n in names if ":tenant-b:" in n)
    assert a.info()["kv_entries"] == 3 and b.info()["kv_entries"] == 3
    assert a.info()["kv_orphans"] == 0 and "tenant-b:" in b.info()["kv_store"]
    shared = RedisStore(server.url)  # the shared namespace lists no tenant's entries
    assert list(shared.keys()) == []


def test_acl_users_limited_to_their_prefix_cannot_read_each_others_entries(kv, server):
    root = admin(server)
    for tenant, password in (("tenant-a", "pw-a"), ("tenant-b", "pw-b")):
        # what docs/reliability.md tells an operator to run, verbatim
        root.execute_command(
            "ACL", "SETUSER", tenant, "on", f">{password}", "resetkeys", f"~kvrag:kvrag:{tenant}:*", "resetchannels",
            "-@all", "+get", "+getrange", "+set", "+del", "+exists", "+strlen", "+scan", "+ping",
        )  # fmt: skip
    host = f"127.0.0.1:{server.port}/0"
    a = engine(kv, TieredStore(MemoryStore(), RedisStore(f"redis://tenant-a:pw-a@{host}")), "tenant-a")
    a.ingest([SECRET_DOC], progress=False)
    fresh_a = engine(kv, RedisStore(f"redis://tenant-a:pw-a@{host}"), "tenant-a")
    hit = fresh_a.answer(Q, [SECRET_DOC], **GEN)
    assert hit.stats.store_hits == 1 and hit.stats.chunks_encoded == 0  # A reads its own entries
    key = next(iter(a.store.keys()))

    b_client = redis.Redis.from_url(f"redis://tenant-b:pw-b@{host}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        b_client.get(f"kvrag:kvrag:tenant-a:{key}")  # B's credentials cannot read A's entry at all
    with pytest.raises(redis.exceptions.NoPermissionError):
        b_client.set(f"kvrag:kvrag:tenant-a:{key}", b"forged")
    # B posing as tenant-a with its own credentials: every read is refused, the chunk is recomputed
    posing = engine(kv, RedisStore(f"redis://tenant-b:pw-b@{host}"), "tenant-a")
    with pytest.warns(StoreWarning, match="NOPERM|permission"):
        out = posing.answer(Q, [SECRET_DOC], **GEN)
    assert out.stats.store_hits == 0 and out.stats.chunks_encoded == 1 and out.token_ids == hit.token_ids
    with pytest.raises(StoreError, match="NOPERM|permission"):
        posing.ingest(["B tries to write into A's prefix."], progress=False)
    # B in its own namespace works as usual
    b = engine(kv, RedisStore(f"redis://tenant-b:pw-b@{host}"), "tenant-b")
    b.ingest(FACTS[:1], progress=False)
    assert b.info()["kv_entries"] == 1 and a.info()["kv_entries"] == 1


@pytest.mark.parametrize("store_kind", ["redis", "disk", "memory"])
def test_knowing_a_tenants_label_is_not_enough_with_a_tenant_secret(kv, server, tmp_path, store_kind):
    def store():
        if store_kind == "redis":
            return RedisStore(server.url)
        if store_kind == "disk":
            return DiskStore(tmp_path / "kv")
        return shared_memory

    shared_memory = MemoryStore()
    a = engine(kv, store(), "tenant-a", secret=SECRET_A)
    a.ingest([SECRET_DOC], progress=False)
    again = engine(kv, store(), "tenant-a", secret=SECRET_A).answer(Q, [SECRET_DOC], **GEN)
    assert again.stats.store_hits == 1  # the tenant itself, with its secret, hits
    for prober in (
        engine(kv, store(), "tenant-a"),  # the label alone (a hit here was the membership test)
        engine(kv, store(), "tenant-a", secret=b"a guessed secret of 32 bytes....."),
    ):
        probe = prober.answer(Q, [SECRET_DOC], **GEN)
        assert probe.stats.store_hits == 0 and probe.stats.chunks_encoded == 1
        assert probe.token_ids == again.token_ids


def test_disk_and_memory_stores_give_each_namespace_its_own_view(kv, tmp_path):
    for shared in (DiskStore(tmp_path / "kv"), MemoryStore()):
        a, b = engine(kv, shared, "tenant-a"), engine(kv, shared, "tenant-b")
        a.ingest([SECRET_DOC, FACTS[0]], progress=False)
        assert len(list(a.store.keys())) == 2 and list(b.store.keys()) == [] and list(shared.keys()) == []
        assert b.info()["kv_entries"] == 0 and b.info()["kv_bytes"] == 0 and a.info()["kv_bytes"] > 0
    # a namespace's folder is made at its first write: tenant B wrote nothing, so it has none
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["ns-tenant-a"]
    assert len(list((tmp_path / "kv" / "ns-tenant-a").rglob("*.kv.safetensors"))) == 2
