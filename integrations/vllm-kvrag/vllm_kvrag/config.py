"""The connector's configuration (`KVTransferConfig.kv_connector_extra_config`) read into kvrag's store: disk or
Redis, a tenant's view, its secret, an in-memory tier. Secrets are named by files (vLLM logs the config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrag.cache.secret import user_key
from kvrag.cache.store import DiskStore, KVStore, MemoryStore, RedisStore, TieredStore, has_credentials, redact
from kvrag.errors import KVRAGError

_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _read_file(path: Any, what: str) -> bytes:
    """A secret the connector's config names by its file (the config itself is logged by vLLM)."""
    try:
        return Path(path).read_bytes().strip()
    except OSError as err:
        raise KVRAGError(f"the kvrag connector cannot read its {what} {path}: {err.strerror}") from None


def open_store(extra: dict[str, Any]) -> KVStore:
    """kvrag's store named by the connector's extra config."""
    kind = extra.get("store", "disk")
    storage = str(extra.get("storage_dtype", "float16"))
    if kind == "disk":
        if not extra.get("path"):
            raise KVRAGError("the kvrag connector's store is 'disk': give kv_connector_extra_config['path']")
        store: KVStore = DiskStore(extra["path"], storage, read_only=True)
    elif kind == "redis":
        url = str(extra.get("url", "redis://localhost:6379/0"))
        if has_credentials(url):
            raise KVRAGError(
                f"the kvrag connector's Redis URL {redact(url)} carries a password, and vLLM writes "
                "kv_connector_extra_config to its log: put the password in a file and give its path as password_file"
            )
        password = None
        if extra.get("password_file"):
            try:
                password = _read_file(extra["password_file"], "password_file").decode()
            except UnicodeDecodeError:
                raise KVRAGError(f"the kvrag connector's password_file {extra['password_file']} is not UTF-8 text")
        store = RedisStore(
            url,
            namespace=extra.get("namespace", "kvrag"),
            storage_dtype=storage,
            read_only=True,
            password=password,
            ssl=bool(extra.get("ssl")) or None,
            **{name: str(extra[name]) for name in _TLS_FILES if extra.get(name)},
        )
    else:
        raise KVRAGError(f"the kvrag connector's store must be 'disk' or 'redis', got {kind!r}")
    if extra.get("tenant"):
        store = store.scoped(str(extra["tenant"]))
    if extra.get("secret_file"):
        store.secret = _read_file(extra["secret_file"], "secret_file")
        if len(store.secret) < 16:
            raise KVRAGError(
                f"the kvrag connector's secret_file {extra['secret_file']} holds {len(store.secret)} bytes: a secret "
                "needs at least 16"
            )
    elif not extra.get("unkeyed"):
        store.secret = user_key()  # as kvrag's engine keys a disk or Redis store by default
    memory = extra.get("memory_bytes", 0)
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
        raise KVRAGError(
            f"the kvrag connector's memory_bytes must be a whole number of bytes (0: none), got {memory!r}"
        )
    if memory > 0:  # entries kept decoded in this process, bounded in bytes: a hot chunk skips the read and check
        return TieredStore(MemoryStore(memory), store)
    return store
