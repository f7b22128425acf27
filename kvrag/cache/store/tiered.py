"""A memory front over a durable back store: reads fill the front, writes go to both."""

from __future__ import annotations

from typing import Iterator

import torch

from kvrag.cache.kv import ChunkKV
from kvrag.cache.store.base import KVStore


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
