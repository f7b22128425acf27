"""Security: only safetensors and JSON are read back, tenants never share KV, Redis credentials and TLS."""

import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import torch
from redis_server import RedisServer, free_port
from tiny import FACTS, HashEmbedder, byte_tokenizer, save_tiny, tiny_model

from kvrag import KVModel
from kvrag.cache.store import DiskStore, MemoryStore, RedisStore, TieredStore
from kvrag.cli import main
from kvrag.engine.folder import IndexWarning
from kvrag.engine.rag import KVRAG
from kvrag.errors import IndexLoadError, InvalidRequestError, StoreError

ROOT = Path(__file__).resolve().parents[2]
SECRET = "The vault code of the Orrin bank is 4471."


@pytest.fixture(autouse=True)
def hash_embedder(monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", HashEmbedder)


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


class Planted:
    """A pickle that, if ever unpickled, leaves a marker file: the proof it was loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def pickles(marker):
    import io

    buf = io.BytesIO()
    torch.save({"keys": Planted(marker)}, buf)  # torch's zip-of-pickle format
    return {"pickle": pickle.dumps(Planted(marker)), "torch.save": buf.getvalue()}


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_a_pickle_planted_in_the_store_is_refused_not_loaded(kv, tmp_path, kind):
    rag = KVRAG(kv, embedder=HashEmbedder(), store=TieredStore(MemoryStore(), DiskStore(tmp_path / "kv")))
    rag.ingest(FACTS, progress=False)
    expected = rag.query("Who runs Velloria's harbour?", top_k=2, max_new_tokens=4)
    marker = tmp_path / "unpickled"
    for key in list(rag.store.back.keys()):
        rag.store.back._write(key, pickles(marker)[kind])
        rag.store.front.delete(key)
    answer = rag.query("Who runs Velloria's harbour?", top_k=2, max_new_tokens=4)
    assert not marker.exists() and answer.stats.chunks_encoded == 2 and answer.token_ids == expected.token_ids


def test_a_pickle_planted_in_redis_is_refused_not_loaded(kv, tmp_path):
    server = RedisServer()
    try:
        store = RedisStore(server.url, namespace="planted")
        store.bind(encoder=kv.encoder_id, dtype=torch.float32, device="cpu")
        key = kv.chunk_key(kv.layout.chunk_ids(FACTS[0][0]))
        for kind, blob in pickles(tmp_path / "unpickled").items():
            store._write(key, blob)
            assert store.get(key) is None, kind
    finally:
        server.stop()
    assert not (tmp_path / "unpickled").exists()


def test_a_pickle_planted_in_the_index_folder_is_refused_not_loaded(tmp_path):
    model = save_tiny(tmp_path / "model")
    KVRAG.from_defaults(tmp_path / "index", model=str(model)).ingest(FACTS, progress=False)
    marker = tmp_path / "unpickled"
    vectors = next((tmp_path / "index" / "index").glob("vectors-*.safetensors"))
    vectors.write_bytes(pickles(marker)["pickle"])
    with pytest.warns(IndexWarning, match="damaged; rebuilt by embedding the 5 stored chunk texts"):
        rag = KVRAG.load(tmp_path / "index", store=MemoryStore())  # never unpickled: re-embedded instead
    assert not marker.exists() and len(rag.index) == 5
    chunks = next((tmp_path / "index" / "index").glob("chunks-*.jsonl"))
    chunks.write_bytes(pickles(marker)["pickle"])
    with pytest.raises(IndexLoadError, match="does not match the checksum"):
        KVRAG.load(tmp_path / "index", store=MemoryStore())
    assert not marker.exists()


def test_the_library_never_calls_a_deserializer_that_can_run_code():
    """Only safetensors and JSON are read back: no pickle, torch.load, numpy pickles or FAISS's own format."""
    banned = re.compile(r"\bpickle\b|torch\.load\(|allow_pickle\s*=\s*True|read_index\(|joblib|dill|marshal\.load")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "kvrag").rglob("*.py"))
        if "study" not in p.parts and p.name != "bench.py"  # built elsewhere; checked by their own suites
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if banned.search(line) and "never pickle" not in line
    ]
    assert offenders == []


# -- tenants ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", ["memory", "disk", "redis"])
def test_one_tenants_chunks_are_never_served_to_another(kv, tmp_path, shared):
    server = RedisServer() if shared == "redis" else None
    try:
        if shared == "memory":
            store = MemoryStore()
        elif shared == "disk":
            store = DiskStore(tmp_path / "kv")
        else:
            store = RedisStore(server.url, namespace="shared")
        a = KVRAG(kv, embedder=HashEmbedder(), store=store, namespace="tenant-a")
        b = KVRAG(kv, embedder=HashEmbedder(), store=store, namespace="tenant-b")
        control = KVRAG(kv, embedder=HashEmbedder(), store=store, namespace="tenant-a")  # the same tenant
        a.ingest([SECRET, *[t for t, _ in FACTS]], progress=False)
        probe = b.answer("What is the vault code?", [SECRET], max_new_tokens=4)
        assert probe.stats.store_hits == 0 and probe.stats.chunks_encoded == 1  # computed, never A's KV
        c = KVRAG(kv, embedder=HashEmbedder(), store=store, namespace="tenant-c")
        assert c.store_kv([SECRET]).store_hits == 0  # precomputing cannot probe either
        assert control.answer("What is the vault code?", [SECRET], max_new_tokens=4).stats.store_hits == 1
        assert probe.token_ids == control.answer("What is the vault code?", [SECRET], max_new_tokens=4).token_ids
        assert a.source.key(kv.layout.chunk_ids(SECRET)) != b.source.key(kv.layout.chunk_ids(SECRET))
    finally:
        if server:
            server.stop()


def test_namespaces_are_checked_kept_in_the_index_and_reach_the_cli(tmp_path, capsys):
    model = save_tiny(tmp_path / "model")
    for bad in ["a:b", "*", "tenant?", "", "x" * 129, "-lead", "ünï"]:
        with pytest.raises(InvalidRequestError, match="invalid namespace"):
            RedisStore("redis://127.0.0.1:1/0", namespace=bad)
        if bad:
            with pytest.raises(InvalidRequestError, match="invalid namespace"):
                KVRAG.from_defaults(None, model=str(model), namespace=bad)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "vault.txt").write_text(SECRET)
    code = main(
        ["ingest", str(docs), "--index", str(tmp_path / "i"), "--model", str(model), "--namespace", "t-1", "--quiet"]
    )
    assert code == 0
    assert KVRAG.load(tmp_path / "i").namespace == "t-1"
    with pytest.raises(IndexLoadError, match="built for namespace 't-1'"):
        KVRAG.load(tmp_path / "i", namespace="t-2")
    assert main(["info", "--index", str(tmp_path / "i")]) == 0 and '"namespace": "t-1"' in capsys.readouterr().out
    assert main(["ingest", str(docs), "--index", str(tmp_path / "j"), "--model", str(model), "--namespace", "a:b"]) == 2
    assert "invalid namespace" in capsys.readouterr().err


def test_redis_namespaces_do_not_see_each_other_even_in_listings(kv):
    server = RedisServer()
    try:
        a, ab = RedisStore(server.url, namespace="a"), RedisStore(server.url, namespace="a-b")
        for s in (a, ab):
            s.bind(encoder=kv.encoder_id, dtype=torch.float32, device="cpu")
        chunk = kv.encode([FACTS[0][0]])[0]
        ab.put("0" * 64, chunk)
        redis.Redis(port=server.port).set("kvrag:a:" + "1" * 64 + ":extra", b"x")  # a longer name under a's prefix
        assert list(a.keys()) == [] and a.get("0" * 64) is None and list(ab.keys()) == ["0" * 64]
    finally:
        server.stop()


# -- Redis credentials and TLS ------------------------------------------------------------------------------


def test_a_redis_password_never_appears_in_messages():
    port = free_port()
    with pytest.raises(StoreError) as caught:
        RedisStore(f"redis://:hunter2-secret@127.0.0.1:{port}/0", socket_timeout=0.5).ping()
    assert "hunter2-secret" not in str(caught.value) and ":***@" in str(caught.value)
    with pytest.raises(StoreError) as caught:
        RedisStore(f"redis://user:hunter2-secret@127.0.0.1:{port}/0", socket_timeout=0.5).ping()
    assert "hunter2-secret" not in str(caught.value)


def test_redis_password_and_tls_settings_reach_the_client(tmp_path):
    store = RedisStore(
        "redis://cache.internal:6380/2",
        password="pw",
        ssl=True,
        ssl_ca_certs="/etc/ca.pem",
        ssl_certfile="/etc/client.pem",
        ssl_keyfile="/etc/client.key",
        socket_timeout=1.5,
    )
    pool = store.client.connection_pool
    assert pool.connection_class is redis.connection.SSLConnection and store.url.startswith("rediss://")
    assert {k: pool.connection_kwargs[k] for k in ("password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")} == {
        "password": "pw",
        "ssl_ca_certs": "/etc/ca.pem",
        "ssl_certfile": "/etc/client.pem",
        "ssl_keyfile": "/etc/client.key",
    }
    assert pool.connection_kwargs["ssl_cert_reqs"] == "required" and pool.connection_kwargs["socket_timeout"] == 1.5
    assert pool.connection_kwargs["host"] == "cache.internal" and pool.connection_kwargs["db"] == 2


def test_a_real_tls_redis(kv, tmp_path):
    if not shutil.which("openssl") or not shutil.which("redis-server"):
        pytest.skip("openssl and redis-server are needed to start a TLS server")
    for name in ("ca", "other"):
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / f"{name}.key"),
             "-out", str(tmp_path / f"{name}.pem")],
            check=True, capture_output=True,
        )  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--tls-cert-file", str(tmp_path / "ca.pem"), "--tls-key-file", str(tmp_path / "ca.key"),
         "--tls-ca-cert-file", str(tmp_path / "ca.pem"), "--tls-auth-clients", "no", "--requirepass", "pw"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"redis://127.0.0.1:{port}/0"
        store = RedisStore(url, password="pw", ssl=True, ssl_ca_certs=str(tmp_path / "ca.pem"))
        for _ in range(100):
            try:
                store.ping()
                break
            except StoreError:
                import time

                time.sleep(0.05)
        store.bind(encoder=kv.encoder_id, dtype=torch.float32, device="cpu")
        chunk = kv.encode([FACTS[0][0]])[0]
        store.put("ab" * 32, chunk)
        assert torch.allclose(store.get("ab" * 32).keys, chunk.keys, atol=1e-2)
        with pytest.raises(StoreError, match="certificate verify failed"):  # a server we cannot verify
            RedisStore(url, password="pw", ssl=True, ssl_ca_certs=str(tmp_path / "other.pem")).ping()
        with pytest.raises(StoreError):  # plain text to a TLS port
            RedisStore(url, password="pw", socket_timeout=1).ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert not os.path.exists(tmp_path / "unpickled")
