"""A cache's keys and values as buffers with free slots after the filled ones: what every decode step writes its
token's key and value into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _has_room(layer: Any, length: int) -> bool:
    """Whether the layer's keys and values are still the head of its buffers, with room for `length` slots (a
    GrowingLayer's own test; the same for a plain layer that an earlier fast decode gave buffers)."""
    in_room = getattr(layer, "_in_room", None)
    if in_room is not None:
        return in_room(length)
    return all(
        view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride() and length <= buf.shape[-2]
        for view, buf in ((layer.keys, layer._keys), (layer.values, layer._values))
    )


@dataclass(slots=True)
class Room:
    """A cache's keys and values as buffers with free slots after the filled ones, for `FastDecoder.step`."""

    keys: list[torch.Tensor]  # per layer [H_kv, capacity, d]
    values: list[torch.Tensor]  # per layer [H_kv, capacity, d]
    filled: int  # slots in use, the same in every layer

    @classmethod
    def of(cls, cache: Any, room: int) -> Room:
        """The cache's own preallocated room when it has enough (a StitchedCache), else its KV copied once into
        buffers with `room` free slots, which the cache then holds."""
        filled = cache.layers[0].keys.shape[-2]
        keys, values = [], []
        for layer in cache.layers:
            own = getattr(layer, "_keys", None)
            if own is None or not _has_room(layer, filled + room):
                k, v = layer.keys, layer.values  # [1, H_kv, T, d]
                own = k.new_empty((*k.shape[:2], filled + room, k.shape[-1]))
                own_v = v.new_empty((*v.shape[:2], filled + room, v.shape[-1]))
                own[:, :, :filled].copy_(k)
                own_v[:, :, :filled].copy_(v)
                layer._keys, layer._values = own, own_v
            keys.append(layer._keys[0])
            values.append(layer._values[0])
            if layer._keys.is_cuda:  # finite numbers in the free slots, which a CUDA graph's step masks out
                layer._keys[:, :, filled:].zero_()
                layer._values[:, :, filled:].zero_()
        return cls(keys, values, filled)

    def commit(self, cache: Any, filled: int) -> None:
        """Show the cache's layers the first `filled` slots, as a transformers forward leaves them."""
        self.filled = filled
        for layer in cache.layers:
            layer.keys, layer.values = layer._keys[:, :, :filled], layer._values[:, :, :filled]
