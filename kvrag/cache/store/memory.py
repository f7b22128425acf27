"""The in-process store: LRU bounded in bytes, holding ChunkKV as they are, and its namespace views."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator

import torch

from kvrag.cache.kv import ChunkKV
from kvrag.cache.store.base import HEX_KEY, KVStore, check_namespace


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
            return iter([k for k in self._items if HEX_KEY.fullmatch(k)])  # not a namespace's ('ns/key')

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
