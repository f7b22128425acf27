"""The Redis store: codec entries under a key prefix, on a server shared by many processes."""

from __future__ import annotations

import copy
from typing import Any, Iterator

from kvrag.cache.store.base import DAMAGED, HEX_KEY, KVStore, SerializedStore, check_namespace
from kvrag.cache.store.urls import encode_userinfo, redact, url_secrets
from kvrag.errors import StoreError


class RedisStore(SerializedStore):
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
        max_entry_bytes: the most bytes of one entry read; a larger one is damaged, never fetched whole (default
            `MAX_ENTRY_BYTES`).
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
        max_entry_bytes: int | None = None,
    ) -> None:
        super().__init__(storage_dtype, max_entry_bytes)
        import redis

        self.read_only, self.retry_after_s = read_only, float(retry_after_s)
        self._redis = redis
        self._limit_asked = False  # the server's bound on one entry, asked at the first write (`_entry_limit`)
        self._limit: tuple[str, int] | None = None
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
        secrets = {*url_secrets(url), *url_secrets(encode_userinfo(url)), *([password] if password else [])}
        self._secrets = sorted(secrets, key=len, reverse=True)
        self.has_password = bool(secrets)  # in the URL or given apart
        self._raw_url = url
        try:
            self.client = client or redis.Redis.from_url(encode_userinfo(url), **kwargs)
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
                f"Redis at {self.url} failed to {what}: {self._scrub(err).rstrip('.')}. {_advice(err)}"
            ) from err

    def _unreachable(self, err: StoreError) -> bool:
        errors = self._redis.exceptions
        return isinstance(err.__cause__, (errors.ConnectionError, errors.TimeoutError))

    def ping(self) -> None:
        self._call("answer a ping", self.client.ping)

    def check(self) -> None:
        self.ping()

    def _read(self, key: str) -> bytes | None:
        def capped() -> bytes | None:
            # no more of the entry than an entry can be (GETRANGE's end is inclusive: one byte more than the bound
            # tells a larger one, which is never fetched whole); nothing back is a miss, or an empty (damaged) value
            blob = self.client.getrange(self.prefix + key, 0, self.max_entry_bytes)
            if not blob:
                return DAMAGED if self.client.exists(self.prefix + key) else None
            return DAMAGED if len(blob) > self.max_entry_bytes else bytes(blob)

        return self._call("read an entry", capped)

    def _write(self, key: str, blob: bytes) -> None:
        limit = self._entry_limit()
        if limit is not None and len(blob) > limit[1]:
            raise StoreError(
                f"an entry of {len(blob):,} bytes is larger than the Redis server at {self.url} can hold "
                f"({limit[0]} {limit[1]:,} bytes): raise it (CONFIG SET {limit[0]} ...) or keep the KV elsewhere "
                "(the index folder's own disk store); nothing was written"
            )
        self._call("write an entry", self.client.set, self.prefix + key, blob)

    def _entry_limit(self) -> tuple[str, int] | None:
        """The server's bound on one entry, asked once: the smaller of maxmemory (when set) and proto-max-bulk-len,
        with its name; None when the server will not say (CONFIG refused to this user)."""
        if not self._limit_asked:
            self._limit_asked = True
            try:
                said: dict[str, int] = {}
                for name in ("maxmemory", "proto-max-bulk-len"):
                    for k, v in self.client.config_get(name).items():
                        said[k.decode() if isinstance(k, bytes) else str(k)] = int(v)
                bounds = [(name, n) for name, n in said.items() if n > 0]
                self._limit = min(bounds, key=lambda b: b[1]) if bounds else None
            except (self._redis.RedisError, AttributeError, ValueError, TypeError):  # AttributeError: a client
                self._limit = None  # without CONFIG (a proxy's, a test's)
        return self._limit

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
            if HEX_KEY.fullmatch(key):  # only kvrag's own entries, never a longer name under the prefix
                yield key

    @property
    def nbytes(self) -> int:
        return sum(self._call("size an entry", self.client.strlen, self.prefix + k) for k in self.keys())


def _advice(err: BaseException) -> str:
    """What to do about a Redis error, by what the server said (its reply's first word) or how the call failed."""
    said = str(err).split(" ", 1)[0].upper()
    if said == "OOM" or "maxmemory" in str(err):
        return (
            "The server is out of memory (maxmemory): raise it, or let it evict (maxmemory-policy allkeys-lru); an "
            "entry of this model is a few MB."
        )
    if said == "READONLY":
        return "The server is a read-only replica: point the URL at the primary."
    if said in ("NOAUTH", "WRONGPASS", "NOPERM"):
        return "Check the credentials (a password file) and the user's ACL key pattern."
    return "Start the server or check the URL and credentials."
