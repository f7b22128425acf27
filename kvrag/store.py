"""KV stores behind one small interface: memory (LRU bounded in bytes), disk, Redis, and tiers of them.

A store maps a chunk key (`kvrag.kv.chunk_key`) to a ChunkKV. Disk and Redis keep `kvrag.codec` entries
(safetensors with a checksum); what cannot be read back safely is a miss. Stores never encode chunks
and never decide what to recompute.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import torch

from kvrag.codec import check_storage_dtype, decode_entry, encode_entry
from kvrag.errors import InvalidRequestError, StoreError
from kvrag.kv import ChunkKV

# A namespace is part of a key prefix and of a SCAN pattern: no glob characters and no ':' (which would let
# namespace "a" see the entries of namespace "a:b").
NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HEX_KEY = re.compile(r"[0-9a-f]{64}")


class StoreWarning(UserWarning):
    """A KV store failed during a query; the answer was computed without it."""


def check_namespace(namespace: str) -> str:
    """A namespace (tenant) name: 1-128 letters, digits, '_', '.', '-', starting with a letter or digit."""
    if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
        raise InvalidRequestError(
            f"invalid namespace {namespace!r}: use 1-128 letters, digits, '_', '.' or '-', starting with a letter "
            "or digit"
        )
    return namespace


def redact(url: str) -> str:
    """A URL with its password replaced by '***', for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


class KVStore(ABC):
    """Chunk key -> ChunkKV. `get` returns None on a miss, including an entry that cannot be trusted.

    Every store counts its `hits` and `misses`. `encoder`, `dtype` and `device` say what a serialized
    entry must have been written for and what it is read back as; `bind` sets them from a model.
    """

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.encoder = ""
        self.dtype = torch.float32
        self.device: torch.device | str = "cpu"

    def bind(self, *, encoder: str, dtype: torch.dtype, device: torch.device | str) -> None:
        """Serve entries for this model and prefix only, read back in this dtype on this device."""
        self.encoder, self.dtype, self.device = encoder, dtype, device

    def check(self) -> None:
        """Raise StoreError now if the store cannot be reached (a server that is down)."""

    def as_stored(self, kv: ChunkKV) -> ChunkKV:
        """`kv` exactly as a later `get` returns it (after the storage dtype's rounding).

        An answer must not depend on whether a chunk's KV was fresh, in memory or read back: whoever uses
        KV it just computed and stored uses this form.
        """
        return kv

    def get(self, key: str) -> ChunkKV | None:
        kv = self._get(key)
        if kv is None:
            self.misses += 1
        else:
            self.hits += 1
        return kv

    @abstractmethod
    def _get(self, key: str) -> ChunkKV | None: ...

    @abstractmethod
    def put(self, key: str, kv: ChunkKV) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held."""

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())


class MemoryStore(KVStore):
    """In-process LRU of ready-to-use ChunkKV, bounded in bytes (the least recently used go first).

    Entries are kept in the model's dtype on its device, so a hit costs no decoding.
    """

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._items.get(key)
            if kv is None or kv.encoder != self.encoder:
                return None
            self._items.move_to_end(key)
            return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        if kv.nbytes > self.max_bytes:
            return  # larger than the whole bound: keeping it would evict everything else
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = kv
            self._bytes += kv.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def keys(self) -> Iterator[str]:
        with self._lock:  # a copy: another thread may put or evict while the caller iterates
            return iter(list(self._items))

    @property
    def nbytes(self) -> int:
        return self._bytes


class _SerializedStore(KVStore):
    """A store of codec entries (bytes); subclasses say where the bytes live."""

    def __init__(self, storage_dtype: str = "float16") -> None:
        super().__init__()
        self.storage_dtype = check_storage_dtype(storage_dtype)

    def _get(self, key: str) -> ChunkKV | None:
        blob = self._read(key)
        if blob is None:
            return None
        return decode_entry(blob, key=key, encoder=self.encoder, dtype=self.dtype, device=self.device)

    def put(self, key: str, kv: ChunkKV) -> None:
        self._write(key, encode_entry(kv, key=key, dtype=self.storage_dtype))

    def as_stored(self, kv: ChunkKV) -> ChunkKV:
        back = decode_entry(
            encode_entry(kv, key="0" * 64, dtype=self.storage_dtype),
            key="0" * 64,
            encoder=kv.encoder,
            dtype=kv.keys.dtype,
            device=kv.keys.device,
        )
        assert back is not None
        return back

    @abstractmethod
    def _read(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _write(self, key: str, blob: bytes) -> None: ...


class DiskStore(_SerializedStore):
    """One safetensors file an entry under `root`, written to a temporary name and renamed into place.

    Concurrent writers of one key each rename a complete file, so a reader never sees half an entry; a
    full disk raises StoreError and leaves every stored entry as it was.
    """

    SUFFIX = ".kv.safetensors"
    STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died (a live one renames in ms)

    def __init__(self, root: str | Path, storage_dtype: str = "float16") -> None:
        super().__init__(storage_dtype)
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot create the KV store folder {self.root}: {err.strerror}") from err
        self._sweep()

    def _sweep(self) -> None:
        """Remove temporary files left by writers that were killed before their rename (never a live writer's)."""
        now = time.time()
        for tmp in self.root.glob("*/.*.tmp"):
            try:
                if now - tmp.stat().st_mtime > self.STALE_TMP_S:
                    tmp.unlink()
            except OSError:
                pass

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise StoreError(f"invalid store key {key!r}: keys are hex digests from kvrag.chunk_key")
        return self.root / key[:2] / f"{key}{self.SUFFIX}"

    def _read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise StoreError(f"cannot read {self._path(key)}: {err.strerror}") from err

    def _write(self, key: str, blob: bytes) -> None:
        path = self._path(key)
        tmp_name = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, path)
            tmp_name = None
        except OSError as err:
            raise StoreError(
                f"cannot write a KV entry under {self.root}: {err.strerror or err}; nothing stored "
                "was changed. Free space or choose another folder."
            ) from err
        finally:
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name)
                except OSError:
                    pass

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._path(key).is_file()

    def keys(self) -> Iterator[str]:
        for path in self.root.glob(f"*/*{self.SUFFIX}"):
            yield path.name[: -len(self.SUFFIX)]

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob(f"*/*{self.SUFFIX}"))


class RedisStore(_SerializedStore):
    """Entries in a Redis server (redis-py), under `namespace`.

    Args:
        url: a redis:// or rediss:// (TLS) URL; or pass a ready `client`. A password in the URL is never
            shown in messages.
        namespace: a key prefix (letters, digits, '_', '.', '-'); separate namespaces never see each other's
            entries, not even in `keys()`.
        password: the server's password (`requirepass` or an ACL user's).
        ssl: connect over TLS, verifying the server's certificate (a redis:// URL becomes rediss://).
        ssl_ca_certs: the CA bundle that signed the server's certificate.
        ssl_certfile, ssl_keyfile: a client certificate and key, for servers that require one.
        socket_timeout: seconds before a connect, read or write counts as a failure.
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        namespace: str = "kvrag",
        storage_dtype: str = "float16",
        client: Any = None,
        password: str | None = None,
        ssl: bool | None = None,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        socket_timeout: float = 5.0,
    ) -> None:
        super().__init__(storage_dtype)
        import redis

        self._redis = redis
        check_namespace(namespace)
        kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
        if password is not None:
            kwargs["password"] = password
        if ssl:
            kwargs["ssl_cert_reqs"] = "required"
            if url.startswith("redis://"):
                url = "rediss://" + url[len("redis://") :]
        if url.startswith("rediss://"):
            for name, value in (
                ("ssl_ca_certs", ssl_ca_certs),
                ("ssl_certfile", ssl_certfile),
                ("ssl_keyfile", ssl_keyfile),
            ):
                if value:
                    kwargs[name] = value
        self.url = redact(url)
        try:
            self.client = client or redis.Redis.from_url(url, **kwargs)
        except ValueError as err:
            raise StoreError(f"invalid Redis URL {self.url}: {err}") from None
        self.prefix = f"kvrag:{namespace}:"

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._redis.exceptions.RedisError as err:
            raise StoreError(
                f"Redis at {self.url} failed to {what}: {err}. Start the server or check the URL and credentials."
            ) from err

    def ping(self) -> None:
        self._call("answer a ping", self.client.ping)

    def check(self) -> None:
        self.ping()

    def _read(self, key: str) -> bytes | None:
        return self._call("read an entry", self.client.get, self.prefix + key)

    def _write(self, key: str, blob: bytes) -> None:
        self._call("write an entry", self.client.set, self.prefix + key, blob)

    def delete(self, key: str) -> None:
        self._call("delete an entry", self.client.delete, self.prefix + key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and bool(self._call("check an entry", self.client.exists, self.prefix + key))

    def keys(self) -> Iterator[str]:
        for raw in self._call("list entries", lambda: list(self.client.scan_iter(match=self.prefix + "*"))):
            key = raw.decode(errors="replace")[len(self.prefix) :]
            if _HEX_KEY.fullmatch(key):  # only kvrag's own entries, never a longer name under the prefix
                yield key

    @property
    def nbytes(self) -> int:
        return sum(self._call("size an entry", self.client.strlen, self.prefix + k) for k in self.keys())


class TieredStore(KVStore):
    """A fast store in front of a durable one: reads fill the front, writes go to both."""

    def __init__(self, front: KVStore, back: KVStore) -> None:
        super().__init__()
        self.front, self.back = front, back

    def bind(self, *, encoder: str, dtype: torch.dtype, device: torch.device | str) -> None:
        super().bind(encoder=encoder, dtype=dtype, device=device)
        self.front.bind(encoder=encoder, dtype=dtype, device=device)
        self.back.bind(encoder=encoder, dtype=dtype, device=device)

    def check(self) -> None:
        self.front.check()
        self.back.check()

    def _get(self, key: str) -> ChunkKV | None:
        kv = self.front.get(key)
        if kv is None:
            kv = self.back.get(key)
            if kv is not None:
                self.front.put(key, kv)
        return kv

    def as_stored(self, kv: ChunkKV) -> ChunkKV:
        return self.front.as_stored(self.back.as_stored(kv))

    def put(self, key: str, kv: ChunkKV) -> None:
        # The front holds what the back returns, so a hit in either gives the same answer; it is written
        # first: with the back down, the next query still finds the entry in front.
        self.front.put(key, self.back.as_stored(kv))
        self.back.put(key, kv)

    def delete(self, key: str) -> None:
        self.back.delete(key)
        self.front.delete(key)

    def __contains__(self, key: object) -> bool:
        # Durably stored: the front may hold an entry whose write to a failing back did not happen.
        return key in self.back

    def keys(self) -> Iterator[str]:
        return self.back.keys()

    @property
    def nbytes(self) -> int:
        return self.back.nbytes
