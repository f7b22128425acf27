"""The stitched cache and its buffers: a DynamicCache whose layers grow into preallocated room (so decoding appends
without copying), and the Workspace that lends those buffers from one answer to the next."""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrag import cpu


class GrowingLayer(DynamicLayer):
    """A cache layer that appends into room kept after its tokens instead of concatenating.

    Its KV is written once; the model's new tokens and every decoded token are copied into the room, which
    grows (by half again) only when it runs out. `keys`/`values` are views of the filled part, as in
    DynamicLayer, so everything that reads a DynamicLayer reads this one.
    """

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, length: int = 0) -> None:
        super().__init__()
        if keys is not None and values is not None:
            self.device, self.is_initialized = keys.device, True
            self._keys, self._values = keys, values  # [B, H_kv, capacity, D]
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True
        self._keys, self._values = key_states[:, :, :0], value_states[:, :, :0]
        self.keys, self.values = self._keys, self._values

    def _in_room(self, length: int) -> bool:
        """Whether `keys`/`values` are still the head of the buffers (nothing replaced them) with room for `length`."""
        return (
            all(
                view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride() and view.shape[:2] == buf.shape[:2]
                for view, buf in ((self.keys, self._keys), (self.values, self._values))
            )
            and length <= self._keys.shape[-2]
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.keys.shape[-2], key_states.shape[-2]
        if not self._in_room(n + q):
            capacity = n + q + max(64, (n + q) // 2)
            for name in ("keys", "values"):
                old = getattr(self, name)
                buf = old.new_empty((*old.shape[:2], capacity, old.shape[-1]))
                buf[:, :, :n].copy_(old)
                setattr(self, f"_{name}", buf)
        self._keys[:, :, n : n + q].copy_(key_states)
        self._values[:, :, n : n + q].copy_(value_states)
        self.keys, self.values = self._keys[:, :, : n + q], self._values[:, :, : n + q]
        return self.keys, self.values


class StitchedCache(DynamicCache):
    """A DynamicCache of GrowingLayers over [L, B, H_kv, capacity, D] buffers (or L [B, H_kv, capacity, D] ones)
    whose first `length` slots are filled."""

    def __init__(
        self, keys: torch.Tensor | Sequence[torch.Tensor], values: torch.Tensor | Sequence[torch.Tensor], length: int
    ) -> None:
        super().__init__()
        self.layers = [GrowingLayer(keys[i], values[i], length) for i in range(len(keys))]
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # flat storage lent by a Workspace
        # the filled slots' stitch, where `stitch_cache(deferred=True)` left it for the forward to write: nothing
        # reads the cache before `stitched_forward`, which writes it (in the C forward, a layer at a time)
        self.pending: cpu.Stitch | None = None

    def refilled(self, length: int) -> StitchedCache:
        """A cache over this one's buffers whose first `length` slots are filled (what was written past them is
        room again): the same reused KV for another forward, nothing copied."""
        return StitchedCache([layer._keys for layer in self.layers], [layer._values for layer in self.layers], length)


class Workspace:
    """Cache buffers kept from one request to the next, so a stitched cache is written into memory already mapped.

    Fresh multi-megabyte tensors cost a page fault on every 4 KiB at first touch, which on a CPU is several
    times the cost of the copy itself. A request takes the buffers (or new ones when they are lent out or
    too small) and its owner gives them back once nothing reads the cache any more; only then are they
    written again. Holds one pair of buffers: the largest handed back.
    """

    def __init__(self) -> None:
        self._free: tuple[torch.Tensor, torch.Tensor] | None = None  # flat keys and values storage
        self._lock = threading.Lock()

    def take(
        self, keys_shape: tuple[int, ...], values_shape: tuple[int, ...], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values tensors of these shapes (contents undefined), and the flat buffers they view."""
        nk, nv = math.prod(keys_shape), math.prod(values_shape)
        with self._lock:
            free, self._free = self._free, None
        fits = (
            free is not None
            and free[0].dtype == like.dtype
            and free[0].device == like.device
            and free[0].numel() >= nk
            and free[1].numel() >= nv
        )
        if not fits:
            if free is not None:
                self.give_back_buffers(free)
            free = (like.new_empty(nk), like.new_empty(nv))
        assert free is not None
        return free[0][:nk].view(keys_shape), free[1][:nv].view(values_shape), free

    def give_back_buffers(self, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._lock:
            if (
                self._free is None
                or buffers[0].numel() + buffers[1].numel() > self._free[0].numel() + self._free[1].numel()
            ):
                self._free = buffers

    def give_back(self, cache: DynamicCache) -> None:
        """Return a StitchedCache's buffers: the caller promises that nothing reads `cache` any more."""
        buffers = getattr(cache, "buffers", None)
        if buffers is not None:
            cache.buffers = None  # type: ignore[attr-defined]
            self.give_back_buffers(buffers)


def as_cache(keys: torch.Tensor, values: torch.Tensor, cache_class: type[DynamicCache] = DynamicCache) -> DynamicCache:
    """A DynamicCache (or subclass) holding [L, H_kv, T, D] keys and values, batch of one."""
    return cache_class(ddp_cache_data=[(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(keys.shape[0])])
