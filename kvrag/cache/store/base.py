"""The store interface: a chunk key to a ChunkKV, a miss for anything that cannot be trusted; namespaces; the
base of the stores that keep serialized entries (a circuit breaker in front of a slow or absent backend)."""

from __future__ import annotations

import json
import logging
import re
import struct
import time
import warnings
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch

from kvrag.cache.codec import check_storage_dtype, decode_entry, encode_entry, stored_form
from kvrag.cache.kv import ChunkKV
from kvrag.errors import InvalidRequestError, StoreError

logger = logging.getLogger(__name__)

# A namespace is part of a key prefix and of a SCAN pattern: no glob characters and no ':' (which would let
# namespace "a" see the entries of namespace "a:b").
NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
HEX_KEY = re.compile(r"[0-9a-f]{64}")

# The largest entry a store reads unless told otherwise (`max_entry_bytes`): a 32k-token chunk of a 1.5B-parameter
# model in float32 is about 2 GB. A larger one (a sparse file, a forged header) is refused as damaged, not read.
MAX_ENTRY_BYTES = 1 << 32
MAX_HEADER_BYTES = 1 << 20  # an entry's JSON header is under a kilobyte: anything near this is not kvrag's
# What `_read` returns for an entry refused before it was read: bytes that decode to no entry, so the entry is
# counted and reported as damaged (recomputed, replaced by `verify --repair`), as one whose bytes were read.
DAMAGED = b""
_WIDTH = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_WIDTH.update({"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1})


def header_length(head: bytes) -> int | None:
    """The length of the JSON header an entry's first 8 bytes announce, None when it cannot be an entry's."""
    if len(head) < 8:
        return None
    (length,) = struct.unpack("<Q", head[:8])
    return length if 2 <= length <= MAX_HEADER_BYTES else None


def entry_size(header: bytes) -> int | None:
    """The bytes a whole entry holds by its JSON header (8 + header + tensors, each tensor's bytes checked against
    its shape and dtype), None when the header is not one of a well-formed entry. What a read is capped at."""
    try:
        fields = json.loads(header)
        end = 0
        for name, tensor in fields.items():
            if name == "__metadata__":
                continue
            start, stop = tensor["data_offsets"]
            count = 1
            for n in tensor["shape"]:
                if not isinstance(n, int) or n < 0:
                    return None
                count *= n
            width = _WIDTH[tensor["dtype"]]
            if not (isinstance(start, int) and isinstance(stop, int)) or stop - start != count * width:
                return None
            end = max(end, stop)
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
        return None
    return 8 + len(header) + end


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
        self.refused = 0  # entries found but not trusted (damaged, forged, another key's): counted among misses
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
        logger.debug("%s: %s %s...", type(self).__name__, "hit" if kv is not None else "miss", key[:16])
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


class SerializedStore(KVStore):
    """A store of codec entries (bytes); subclasses say where the bytes live.

    A circuit breaker guards reads and writes: after a failure to reach it (a timeout, a refused connection:
    `_unreachable`) the store answers StoreError at once for `retry_after_s` seconds instead of waiting
    again, so a hung server costs one query its timeout, not every query.
    """

    retry_after_s = 5.0

    def __init__(self, storage_dtype: str = "float16", max_entry_bytes: int | None = None) -> None:
        super().__init__()
        self.storage_dtype = check_storage_dtype(storage_dtype)
        if max_entry_bytes is not None and (
            isinstance(max_entry_bytes, bool) or not isinstance(max_entry_bytes, int) or max_entry_bytes < 1
        ):
            raise InvalidRequestError(f"max_entry_bytes must be a positive whole number, got {max_entry_bytes!r}")
        # the most bytes one entry is read as: a larger one is refused as damaged (DAMAGED), never allocated
        self.max_entry_bytes = max_entry_bytes or MAX_ENTRY_BYTES
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
        if blob is None and isinstance(self.legacy, SerializedStore):
            try:  # written by a kvrag before namespace views, under the whole store (its key is this tenant's)
                blob = self.legacy._read(key)
            except StoreError:  # this tenant may not read there (a Redis ACL user): never ask again
                self.legacy = None
        if blob is None:
            return None
        kv = decode_entry(blob, key=key, encoder=self.encoder, dtype=self.dtype, device=self.device, secret=self.secret)
        if kv is None:
            where = f"{type(self).__name__} {getattr(self, 'root', '') or getattr(self, 'url', '')}"
            self.refused += 1
            if self.refused == 1:  # once a store: a damaged folder must not flood the log
                warnings.warn(
                    f"a stored entry failed its check (damaged, forged, or written under another secret) and was "
                    f"recomputed: {key[:16]}... in {where}; an engine that may write replaces it "
                    "with the recomputed KV (one opened read-only, as `kvrag ask`, does not)",
                    StoreWarning,
                    stacklevel=4,
                )
        return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        if self.read_only:
            return  # opened to read (`kvrag ask`, `kvrag info`): a recomputed chunk is not written back
        self._guarded(self._write, key, encode_entry(kv, key=key, dtype=self.storage_dtype, secret=self.secret))
        logger.debug("%s: wrote %s... (%d tokens)", type(self).__name__, key[:16], len(kv))

    def as_stored(self, kv: ChunkKV) -> ChunkKV:
        return stored_form(kv, dtype=self.storage_dtype)

    @abstractmethod
    def _read(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _write(self, key: str, blob: bytes) -> None: ...
