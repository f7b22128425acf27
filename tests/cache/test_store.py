"""One store test suite, run on the memory, disk, Redis (a real server) and tiered stores."""

import errno
import os
import pickle
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import RedisServer

from kvrag.cache.codec import decode_entry, encode_entry
from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import DiskStore, MemoryStore, RedisStore, TieredStore
from kvrag.errors import StoreError

ENCODER = "e" * 64


def chunk(seed=0, tokens=12):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(
        torch.randint(0, 100, (tokens,), generator=g),
        torch.randn(3, 2, tokens, 8, generator=g) * 4,
        torch.randn(3, 2, tokens, 8, generator=g),
        start=5,
        encoder=ENCODER,
    )


def key(n):
    return f"{n:064x}"


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "disk", "redis", "tiered"])
def store(request, tmp_path):
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "disk":
        s = DiskStore(tmp_path / "kv", storage_dtype="float32")
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        s = RedisStore(server.url, namespace=f"test-{os.urandom(4).hex()}", storage_dtype="float32")
    else:
        s = TieredStore(MemoryStore(), DiskStore(tmp_path / "kv", storage_dtype="float32"))
    s.bind(encoder=ENCODER, dtype=torch.float32, device="cpu")
    return s


def same(a, b):
    return (
        torch.equal(a.keys, b.keys)
        and torch.equal(a.values, b.values)
        and torch.equal(a.token_ids, b.token_ids)
        and a.start == b.start
    )


def test_roundtrip_miss_delete_and_counts(store):
    assert store.get(key(1)) is None and store.misses == 1
    store.put(key(1), chunk(1))
    store.put(key(2), chunk(2))
    assert key(1) in store and key(3) not in store
    assert same(store.get(key(1)), chunk(1)) and store.hits == 1
    assert sorted(store.keys()) == [key(1), key(2)] and len(store) == 2 and store.nbytes > 0
    store.delete(key(1))
    assert store.get(key(1)) is None and key(1) not in store
    store.delete(key(99))  # deleting a missing key is fine


def test_concurrent_writers_of_one_key_leave_a_readable_entry(store):
    threads = [threading.Thread(target=store.put, args=(key(7), chunk(7))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert same(store.get(key(7)), chunk(7))


def test_entries_of_another_model_or_prefix_are_misses(store):
    store.put(key(3), chunk(3))
    store.bind(encoder="f" * 64, dtype=torch.float32, device="cpu")
    assert store.get(key(3)) is None


def damage(store, k, how):
    back = store.back if isinstance(store, TieredStore) else store
    if isinstance(store, TieredStore):
        store.front.delete(k)
    blob = back._read(k)
    if how == "truncate":
        blob = blob[: len(blob) // 2]
    elif how == "flip":
        blob = bytearray(blob)
        blob[-5] ^= 0xFF
        blob = bytes(blob)
    elif how == "header":
        blob = bytearray(blob)
        blob[12] ^= 0x55
        blob = bytes(blob)
    else:
        blob = pickle.dumps({"keys": torch.zeros(1)})
    back._write(k, blob)


@pytest.mark.parametrize("how", ["truncate", "flip", "header", "pickle"])
def test_damaged_entries_are_misses(store, how):
    if isinstance(store, MemoryStore):
        pytest.skip("nothing serialized in memory")
    store.put(key(4), chunk(4))
    damage(store, key(4), how)
    assert store.get(key(4)) is None


def test_storage_dtypes(tmp_path):
    c = chunk(5, tokens=64)
    sizes = {}
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        blob = encode_entry(c, key=key(5), dtype=dtype)
        sizes[dtype] = len(blob)
        back = decode_entry(blob, key=key(5), encoder=ENCODER, dtype=torch.float32, device="cpu")
        err = ((back.keys - c.keys).norm() / c.keys.norm()).item()
        assert err < {"float32": 0, "float16": 1e-3, "bfloat16": 1e-2, "int8": 1e-2}[dtype] + 1e-12, (dtype, err)
    assert sizes["float16"] < 0.55 * sizes["float32"] and sizes["int8"] < 0.6 * sizes["float16"]
    with pytest.raises(Exception, match="unknown storage dtype"):
        DiskStore(tmp_path, storage_dtype="int3")


def test_memory_store_is_bounded_in_bytes():
    one = chunk(0).nbytes
    s = MemoryStore(max_bytes=3 * one)
    s.bind(encoder=ENCODER, dtype=torch.float32, device="cpu")
    for i in range(5):
        s.put(key(i), chunk(i))
    assert len(s) == 3 and s.nbytes <= 3 * one and key(0) not in s and key(4) in s
    s.get(key(2))  # now most recent
    s.put(key(5), chunk(5))
    assert key(2) in s and key(3) not in s


def test_tiered_store_fills_its_front_from_the_back(tmp_path):
    back = DiskStore(tmp_path / "kv", storage_dtype="float32")
    s = TieredStore(MemoryStore(), back)
    s.bind(encoder=ENCODER, dtype=torch.float32, device="cpu")
    back.put(key(8), chunk(8))
    assert key(8) not in s.front
    assert same(s.get(key(8)), chunk(8)) and key(8) in s.front


def test_a_full_disk_is_a_clean_error_and_corrupts_nothing(tmp_path, monkeypatch):
    s = DiskStore(tmp_path / "kv", storage_dtype="float32")
    s.bind(encoder=ENCODER, dtype=torch.float32, device="cpu")
    s.put(key(1), chunk(1))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StoreError, match="No space left on device.*nothing stored was changed"):
        s.put(key(1), chunk(2))
    with pytest.raises(StoreError):
        s.put(key(2), chunk(2))
    monkeypatch.undo()
    assert same(s.get(key(1)), chunk(1)) and key(2) not in s
    assert not list((tmp_path / "kv").rglob("*.tmp"))


def test_invalid_keys_are_refused(tmp_path):
    with pytest.raises(StoreError, match="invalid store key"):
        DiskStore(tmp_path).put("../../etc/passwd", chunk())


def test_redis_password_and_a_down_server(redis_server):
    secured = RedisServer(password="s3cret")
    try:
        s = RedisStore(secured.url, password="s3cret")
        s.ping()
        with pytest.raises(StoreError, match="failed to answer a ping"):
            RedisStore(secured.url, password="wrong").ping()
    finally:
        secured.stop()
    with pytest.raises(StoreError, match="Start the server"):
        s.ping()


# -- property tests: any sequence of operations, any key ---------------------------------------------------


def small_chunk(seed):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.arange(4), torch.randn(2, 1, 4, 4, generator=g), torch.randn(2, 1, 4, 4, generator=g), 3, "e")


OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 5), st.integers(0, 3)), max_size=40)


@given(ops=OPS, kind=st.sampled_from(["memory", "bounded memory", "disk", "tiered"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_stores_behave_as_a_dictionary(tmp_path_factory, ops, kind):
    root = tmp_path_factory.mktemp("store")
    one = small_chunk(0).nbytes
    store = {
        "memory": lambda: MemoryStore(),
        "bounded memory": lambda: MemoryStore(max_bytes=2 * one),
        "disk": lambda: DiskStore(root, storage_dtype="float32"),
        "tiered": lambda: TieredStore(MemoryStore(max_bytes=2 * one), DiskStore(root, storage_dtype="float32")),
    }[kind]()
    store.bind(encoder="e", dtype=torch.float32, device="cpu")
    model: dict[str, int] = {}
    for op, k, seed in ops:
        key = f"{k:064x}"
        if op == "put":
            store.put(key, small_chunk(seed))
            model[key] = seed
        elif op == "delete":
            store.delete(key)
            model.pop(key, None)
        got = store.get(key)
        if key not in model:
            assert got is None
        elif got is not None or kind != "bounded memory":  # only a bounded memory store may have evicted it
            assert got is not None and torch.equal(got.keys, small_chunk(model[key]).keys)
        if kind == "bounded memory":
            assert store.nbytes <= 2 * one and set(store.keys()) <= set(model)
        else:
            assert set(store.keys()) == set(model)


@given(key=st.text(max_size=80))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_disk_store_never_writes_outside_its_folder_whatever_the_key(tmp_path_factory, key):
    root = tmp_path_factory.mktemp("keys")
    store = DiskStore(root / "kv", storage_dtype="float32")
    try:
        store.put(key, small_chunk(1))
    except StoreError as err:
        assert "invalid store key" in str(err)
    assert all(p.resolve().is_relative_to((root / "kv").resolve()) for p in root.rglob("*") if p.is_file())


def test_an_entry_larger_than_the_redis_server_can_hold_is_refused_up_front_with_the_sizes(redis_server):
    import redis

    admin = redis.Redis.from_url(redis_server.url)
    before = admin.config_get("maxmemory")["maxmemory"]
    bound = int(admin.info("memory")["used_memory"]) + (1 << 20)  # room for small entries, not for a large one
    admin.config_set("maxmemory", bound)
    try:
        s = RedisStore(redis_server.url, namespace=f"test-{os.urandom(4).hex()}", storage_dtype="float32")
        s.bind(encoder=ENCODER, dtype=torch.float32, device="cpu")
        big = chunk(tokens=bound // 384 + 64)  # float32 keys and values: 2 x 3 x 2 x 8 x 4 = 384 bytes a token
        refused = rf"an entry of [\d,]+ bytes is larger than .* \(maxmemory {bound:,} bytes"
        with pytest.raises(StoreError, match=refused):
            s.put(key(1), big)
        assert list(s.keys()) == []  # nothing was written
        s.put(key(2), chunk(1))  # a small entry still goes in
        assert list(s.keys()) == [key(2)]
    finally:
        admin.config_set("maxmemory", before)
