"""KV stores behind one small interface: memory (LRU bounded in bytes), disk, Redis, and tiers of them.

A store maps a chunk key (`kvrag.kv.chunk_key`) to a ChunkKV. Disk and Redis keep `kvrag.codec` entries
(safetensors with a checksum); what cannot be read back safely is a miss. Stores never encode chunks
and never decide what to recompute.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote, unquote

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


# Query parameters whose values are credentials (redis-py reads `password` from the query, for one).
_SECRET_PARAMS = frozenset(
    {"password", "pass", "passwd", "pwd", "auth", "secret", "token", "access_token", "apikey", "api_key"}
)
# A query parameter has begun: '?' or '&', a name, '='. An '@' after one is in the query, not the userinfo's end.
_QUERY_STARTED = re.compile(r"[?&][A-Za-z0-9_.~%+-]*=")


def _split_url(url: str) -> tuple[str, str | None, str]:
    """`url` as (the scheme and '//', the userinfo or None, the rest: host, path, query).

    The userinfo ends at the netloc's last '@', and an unencoded password may hold '/', '?', '#' or '@'
    (which `urllib.parse.urlsplit` would take for the netloc's end): the '@' that ends it is the last one
    not inside a query parameter.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    head = scheme + sep
    at = -1
    for i, ch in enumerate(rest):
        if ch == "@" and not _QUERY_STARTED.search(rest, 0, i):
            at = i
    if at < 0:
        return head, None, rest
    return head, rest[:at], rest[at + 1 :]


def _url_secrets(url: str) -> list[str]:
    """The credentials in `url` (its password, its credential query values), as written and decoded."""
    _, userinfo, rest = _split_url(url)
    found = []
    if userinfo is not None and ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    _, q, query = rest.partition("?")
    for part in re.split(r"[&;]", query) if q else ():
        name, eq, value = part.partition("=")
        if eq and unquote(name).lower() in _SECRET_PARAMS:
            found.append(value)
    return [s for secret in found if secret for s in {secret, unquote(secret), unquote(secret.replace("+", " "))}]


def redact(url: str) -> str:
    """A URL with its password and credential query values (password=, auth=, ...) replaced by '***'.

    The username, host, path and other parameters stay as written, for messages and logs.
    """
    head, userinfo, rest = _split_url(url)
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}{':***' if colon else ''}@{rest}"
    where, q, query = rest.partition("?")
    if q:
        parts = re.split(r"([&;])", query)
        for i in range(0, len(parts), 2):
            name, eq, _ = parts[i].partition("=")
            if eq and unquote(name).lower() in _SECRET_PARAMS:
                parts[i] = f"{name}=***"
        rest = f"{where}?{''.join(parts)}"
    return head + rest


def without_credentials(url: str) -> str:
    """`url` with its password and credential query values removed (the username stays): a URL that may be
    written where a log can show it, the credentials given apart."""
    head, userinfo, rest = _split_url(url)
    if userinfo is not None:
        user = userinfo.partition(":")[0]
        rest = f"{user}@{rest}" if user else rest
    where, q, query = rest.partition("?")
    if q:
        kept = [
            part
            for part in re.split(r"[&;]", query)
            if not (part.partition("=")[1] and unquote(part.partition("=")[0]).lower() in _SECRET_PARAMS)
        ]
        rest = f"{where}?{'&'.join(kept)}" if kept else where
    return head + rest


def has_credentials(url: str) -> bool:
    """Whether `url` carries a password or a credential query value."""
    return bool(_url_secrets(url))


def _encode_userinfo(url: str) -> str:
    """`url` with '/', '?', '#', '@', '[' and ']' in its username and password percent-encoded (redis-py decodes
    them), so that a password holding them reaches the server instead of breaking the URL's parse."""
    head, userinfo, rest = _split_url(url)
    if userinfo is None or not re.search(r"[/?#@\[\]]", userinfo):
        return url
    user, colon, password = userinfo.partition(":")
    safe = "!$&'()*+,;=~-._%"
    return f"{head}{quote(user, safe=safe)}{colon}{quote(password, safe=safe + ':')}@{rest}"


class KVStore(ABC):
    """Chunk key -> ChunkKV. `get` returns None on a miss, including an entry that cannot be trusted.

    Every store counts its `hits` and `misses`. `encoder`, `dtype` and `device` say what a serialized
    entry must have been written for and what it is read back as; `bind` sets them from a model. `secret`
    (bytes, set by `bind`) keys the checksums of serialized entries.
    """

    read_only = False  # opened to read: `put` keeps nothing durable (a memory front still fills)
    view = ""  # the namespace this store is the view of (`scoped`), "" for a whole store
    legacy: KVStore | None = None  # where a namespace's entries were kept before views (read on a miss)

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.encoder = ""
        self.dtype: torch.dtype | None = torch.float32
        self.device: torch.device | str = "cpu"
        self.secret = b""

    def bind(
        self, *, encoder: str, dtype: torch.dtype | None, device: torch.device | str, secret: bytes | None = None
    ) -> None:
        """Serve entries for this model and prefix only, read back in this dtype on this device (None: as stored,
        int8 dequantized to float32; for a reader that converts them itself, as vLLM's connector does)."""
        self.encoder, self.dtype, self.device = encoder, dtype, device
        if secret is not None:
            self.secret = secret

    def view_of(self, namespace: str) -> KVStore:
        """`scoped(namespace)`, or this store itself when it is that view already (or `namespace` is "")."""
        return self if not namespace or self.view == namespace else self.scoped(namespace)

    def scoped(self, namespace: str) -> KVStore:
        """This store's view of one namespace: its own key prefix (Redis), subfolder (disk) or key space
        (memory), so `keys()`, `len` and `nbytes` count that namespace's entries only. A store that cannot
        scope (a custom subclass that does not override this) returns itself: its keys are still salted
        by the namespace, but its listing shows every namespace's."""
        return self

    def check(self) -> None:
        """Raise StoreError now if the store cannot be reached (a server that is down)."""

    def as_stored(self, kv: ChunkKV) -> ChunkKV:
        """`kv` exactly as a later `get` returns it (after the storage dtype's rounding).

        An answer must not depend on whether a chunk's KV was fresh, in memory or read back: whoever uses
        KV it just computed and stored uses this form.
        """
        return kv

    def peek(self, key: str) -> ChunkKV | None:
        """The entry if this process holds it in memory (no I/O, no counting), else None."""
        return None

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
            return iter([k for k in self._items if _HEX_KEY.fullmatch(k)])  # not a namespace's ('ns/key')

    @property
    def nbytes(self) -> int:
        return self._bytes

    def peek(self, key: str) -> ChunkKV | None:
        return self._get(key)

    def scoped(self, namespace: str) -> KVStore:
        return _MemoryScope(self, check_namespace(namespace))


class _MemoryScope(KVStore):
    """One namespace's entries of a shared MemoryStore (one byte bound for all), under keys 'namespace/key'."""

    def __init__(self, parent: MemoryStore, namespace: str) -> None:
        super().__init__()
        self.parent, self.prefix, self.view = parent, f"{namespace}/", namespace

    def bind(
        self, *, encoder: str, dtype: torch.dtype | None, device: torch.device | str, secret: bytes | None = None
    ) -> None:
        super().bind(encoder=encoder, dtype=dtype, device=device, secret=secret)
        self.parent.bind(encoder=encoder, dtype=dtype, device=device, secret=secret)

    def _get(self, key: str) -> ChunkKV | None:
        return self.parent._get(self.prefix + key)

    def peek(self, key: str) -> ChunkKV | None:
        return self.parent._get(self.prefix + key)

    def put(self, key: str, kv: ChunkKV) -> None:
        self.parent.put(self.prefix + key, kv)

    def delete(self, key: str) -> None:
        self.parent.delete(self.prefix + key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.prefix + key in self.parent

    def keys(self) -> Iterator[str]:
        n = len(self.prefix)
        with self.parent._lock:
            return iter([k[n:] for k in self.parent._items if k.startswith(self.prefix)])

    @property
    def nbytes(self) -> int:
        with self.parent._lock:
            return sum(kv.nbytes for k, kv in self.parent._items.items() if k.startswith(self.prefix))


class _SerializedStore(KVStore):
    """A store of codec entries (bytes); subclasses say where the bytes live.

    A circuit breaker guards reads and writes: after a failure to reach it (a timeout, a refused connection:
    `_unreachable`) the store answers StoreError at once for `retry_after_s` seconds instead of waiting
    again, so a hung server costs one query its timeout, not every query.
    """

    retry_after_s = 5.0

    def __init__(self, storage_dtype: str = "float16") -> None:
        super().__init__()
        self.storage_dtype = check_storage_dtype(storage_dtype)
        self._down_until = 0.0
        self._failure = ""
        self.read_only = False

    def _guarded(self, fn: Any, *args: Any) -> Any:
        left = self._down_until - time.monotonic()
        if left > 0:
            raise StoreError(
                f"skipped: it could not be reached a moment ago ({self._failure}); retried in {left:.1f} s"
            )
        try:
            return fn(*args)
        except StoreError as err:
            if self._unreachable(err):
                self._failure, self._down_until = str(err), time.monotonic() + self.retry_after_s
            raise

    def _unreachable(self, err: StoreError) -> bool:
        """Whether a failure means the store cannot be reached (worth not waiting on again for a while)."""
        return False

    def _get(self, key: str) -> ChunkKV | None:
        blob = self._guarded(self._read, key)
        if blob is None and isinstance(self.legacy, _SerializedStore):
            try:  # written by a kvrag before namespace views, under the whole store (its key is this tenant's)
                blob = self.legacy._read(key)
            except StoreError:  # this tenant may not read there (a Redis ACL user): never ask again
                self.legacy = None
        if blob is None:
            return None
        return decode_entry(
            blob, key=key, encoder=self.encoder, dtype=self.dtype, device=self.device, secret=self.secret
        )

    def put(self, key: str, kv: ChunkKV) -> None:
        if self.read_only:
            return  # opened to read (`kvrag ask`, `kvrag info`): a recomputed chunk is not written back
        self._guarded(self._write, key, encode_entry(kv, key=key, dtype=self.storage_dtype, secret=self.secret))

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
    full disk raises StoreError and leaves every stored entry as it was. Nothing under `root` is reached
    through a symbolic link: a linked bucket folder or entry is refused (StoreError), never followed.
    `read_only` opens an existing folder without creating, sweeping or writing anything.
    """

    SUFFIX = ".kv.safetensors"
    STALE_TMP_S = 60.0  # a temporary file this old belongs to a writer that died (a live one renames in ms)

    def __init__(self, root: str | Path, storage_dtype: str = "float16", *, read_only: bool = False) -> None:
        super().__init__(storage_dtype)
        self.root = Path(root)
        self.read_only = read_only
        if read_only:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot create the KV store folder {self.root}: {err.strerror}") from err
        self.sweep()

    def scoped(self, namespace: str) -> KVStore:
        root = self.root / f"ns-{check_namespace(namespace)}"
        if root.is_symlink():
            raise StoreError(
                f"{root} is a symbolic link: kvrag never follows links inside a KV store folder; remove it"
            )
        scoped = DiskStore(root, self.storage_dtype, read_only=self.read_only)
        scoped.view, scoped.legacy = namespace, self
        return scoped

    def sweep(self, *, older_than_s: float | None = None) -> int:
        """Remove temporary files left by writers killed before their rename (older than `older_than_s`,
        default STALE_TMP_S: never a live writer's); return how many."""
        return len(self.stale_temp_files(older_than_s, remove=True))

    def stale_temp_files(self, older_than_s: float | None = None, *, remove: bool = False) -> list[Path]:
        """Temporary files older than `older_than_s` in the real (not linked) bucket folders; removed with `remove`."""
        now, age, found = time.time(), self.STALE_TMP_S if older_than_s is None else older_than_s, []
        for bucket in self.root.glob("[0-9a-f][0-9a-f]"):
            if bucket.is_symlink() or not bucket.is_dir():
                continue  # a link is never walked: its target is outside the store
            for tmp in bucket.glob(".*.tmp"):
                try:
                    if not tmp.is_symlink() and now - tmp.lstat().st_mtime > age:
                        if remove:
                            tmp.unlink()
                        found.append(tmp)
                except OSError:
                    pass
        return found

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise StoreError(f"invalid store key {key!r}: keys are hex digests from kvrag.chunk_key")
        path = self.root / key[:2] / f"{key}{self.SUFFIX}"
        if path.parent.is_symlink():
            raise StoreError(
                f"{path.parent} is a symbolic link: kvrag never follows links inside a KV store folder; "
                "remove it (its entries are recomputed)"
            )
        return path

    def _read(self, key: str) -> bytes | None:
        from kvrag.folder import read_regular

        path = self._path(key)
        try:
            return read_regular(path)  # never through a link, never a FIFO's endless wait
        except FileNotFoundError:
            return None
        except OSError as err:
            if path.is_symlink():
                raise StoreError(
                    f"{path} is a symbolic link: kvrag never follows links inside a KV store folder; remove it"
                ) from None
            raise StoreError(f"cannot read {path}: {err.strerror or err}") from err

    def _write(self, key: str, blob: bytes) -> None:
        path = self._path(key)
        tmp_name = None
        try:
            path.parent.mkdir(exist_ok=True)
            if path.parent.is_symlink():  # made a link since _path looked: never write through it
                raise StoreError(f"{path.parent} is a symbolic link: kvrag never writes through one; remove it")
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
        if self.read_only:
            raise StoreError(f"the KV store {self.root} is open read-only: nothing can be deleted")
        try:
            self._path(key).unlink()  # unlinks a link itself, never its target
        except FileNotFoundError:
            pass

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        path = self._path(key)
        return not path.is_symlink() and path.is_file()

    def _entries(self) -> Iterator[Path]:
        for path in self.root.glob(f"[0-9a-f][0-9a-f]/*{self.SUFFIX}"):
            if _HEX_KEY.fullmatch(path.name[: -len(self.SUFFIX)]) and not path.is_symlink():
                if not path.parent.is_symlink():
                    yield path

    def keys(self) -> Iterator[str]:
        for path in self._entries():
            yield path.name[: -len(self.SUFFIX)]

    @property
    def nbytes(self) -> int:
        total = 0
        for path in self._entries():
            try:
                total += path.lstat().st_size
            except OSError:
                pass
        return total


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
        socket_timeout: seconds before a connect, read or write counts as a failure; after one, the store is
            skipped (a miss, the chunk recomputed) for `retry_after_s` seconds instead of waited on again.
        retry_after_s: how long the circuit breaker stays open after a timeout or refused connection.
        read_only: never write or delete (what `kvrag ask` and `kvrag info` open).
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
        retry_after_s: float = 5.0,
        read_only: bool = False,
    ) -> None:
        super().__init__(storage_dtype)
        import redis

        self.read_only, self.retry_after_s = read_only, float(retry_after_s)
        self._redis = redis
        check_namespace(namespace)
        kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
        if password is not None:
            kwargs["password"] = password
        if ssl:
            kwargs["ssl_cert_reqs"] = "required"
            if url.startswith("redis://"):
                url = "rediss://" + url[len("redis://") :]
        self.tls: dict[str, str] = {}  # the TLS files given, as passed (another process opening this store needs them)
        if url.startswith("rediss://"):
            for name, value in (
                ("ssl_ca_certs", ssl_ca_certs),
                ("ssl_certfile", ssl_certfile),
                ("ssl_keyfile", ssl_keyfile),
            ):
                if value:
                    kwargs[name] = self.tls[name] = value
        self.url = redact(url)
        # What redis-py's own errors could echo: the URL, its password, the password given apart.
        secrets = {*_url_secrets(url), *_url_secrets(_encode_userinfo(url)), *([password] if password else [])}
        self._secrets = sorted(secrets, key=len, reverse=True)
        self.has_password = bool(secrets)  # in the URL or given apart
        self._raw_url = url
        try:
            self.client = client or redis.Redis.from_url(_encode_userinfo(url), **kwargs)
        except ValueError as err:
            raise StoreError(f"invalid Redis URL {self.url}: {self._scrub(err)}") from None
        self.namespace = namespace
        self.prefix = f"kvrag:{namespace}:"

    def scoped(self, namespace: str) -> KVStore:
        """A tenant's view: keys under `kvrag:<store namespace>:<tenant>:` (the pattern a Redis ACL user of
        that tenant is limited to, see docs/reliability.md), on the same connection pool."""
        scoped = copy.copy(self)
        scoped.prefix = f"{self.prefix}{check_namespace(namespace)}:"
        scoped.view, scoped.legacy = namespace, self
        scoped.hits = scoped.misses = 0
        scoped._down_until, scoped._failure = 0.0, ""
        return scoped

    def _scrub(self, err: BaseException) -> str:
        """An error's text with the URL redacted and every credential in it replaced by '***'."""
        text = str(err).replace(self._raw_url, self.url)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._redis.exceptions.RedisError as err:
            raise StoreError(
                f"Redis at {self.url} failed to {what}: {self._scrub(err).rstrip('.')}. Start the server or check "
                "the URL and credentials."
            ) from err

    def _unreachable(self, err: StoreError) -> bool:
        errors = self._redis.exceptions
        return isinstance(err.__cause__, (errors.ConnectionError, errors.TimeoutError))

    def ping(self) -> None:
        self._call("answer a ping", self.client.ping)

    def check(self) -> None:
        self.ping()

    def _read(self, key: str) -> bytes | None:
        return self._call("read an entry", self.client.get, self.prefix + key)

    def _write(self, key: str, blob: bytes) -> None:
        self._call("write an entry", self.client.set, self.prefix + key, blob)

    def delete(self, key: str) -> None:
        if self.read_only:
            raise StoreError(f"the Redis store at {self.url} is open read-only: nothing can be deleted")
        self._call("delete an entry", self.client.delete, self.prefix + key)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self._guarded(self._call, "check an entry", self.client.exists, self.prefix + key))

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

    def bind(
        self, *, encoder: str, dtype: torch.dtype | None, device: torch.device | str, secret: bytes | None = None
    ) -> None:
        super().bind(encoder=encoder, dtype=dtype, device=device, secret=secret)
        self.front.bind(encoder=encoder, dtype=dtype, device=device, secret=secret)
        self.back.bind(encoder=encoder, dtype=dtype, device=device, secret=secret)

    def scoped(self, namespace: str) -> KVStore:
        scoped = TieredStore(self.front.scoped(namespace), self.back.scoped(namespace))
        scoped.view = namespace
        return scoped

    def peek(self, key: str) -> ChunkKV | None:
        return self.front.peek(key)

    @property
    def read_only(self) -> bool:
        return bool(getattr(self.back, "read_only", False))

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
