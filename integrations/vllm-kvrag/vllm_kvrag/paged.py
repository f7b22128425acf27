"""The worker's side of writing into vLLM's paged caches: the decoder layers' caches of a forward, the write of a
layer's keys and values (vLLM's own op on its CPU backend, `layout.scatter` on a GPU backend's), the reader
threads' CPU affinity, and the warning a missed entry gives."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import KVRAGError
from vllm_kvrag.layout import layout_of, scatter
from vllm_kvrag.plan import Piece

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

_LAYER = re.compile(r"layers\.(\d+)\.")


class KVRAGLoadWarning(UserWarning):
    """A stored entry could not be read when its tokens were due; vLLM computes those tokens itself."""


def _missed(piece: Piece, why: str) -> None:
    warnings.warn(
        f"kvrag: the stored entry {piece.key[:12]} is missing or damaged{why}; vLLM computes its tokens",
        KVRAGLoadWarning,
        stacklevel=3,
    )


def _use_worker_cpus() -> None:
    """Let a reader thread run on every core the worker's threads may use. vLLM's CPU worker pins its main
    thread to one core (its OpenMP threads to the others), and a thread inherits its creator's pinning: the
    readers would otherwise share the writer's one core while the others sit idle during the load."""
    if not hasattr(os, "sched_setaffinity"):
        return  # not Linux: nothing is pinned this way
    cpus: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            cpus |= os.sched_getaffinity(int(task.name))
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    if cpus:
        os.sched_setaffinity(0, cpus)


def _paged_layers(forward_context: ForwardContext) -> list[tuple[int, Any, torch.Tensor]]:
    """(layer index, attention layer, its paged cache) for every decoder layer of the forward."""
    layers = []
    for name, layer in forward_context.no_compile_layers.items():
        cache = getattr(layer, "kv_cache", None)
        found = _LAYER.search(name)
        if cache is not None and found is not None:
            layers.append((int(found.group(1)), layer, cache))
    return layers


def _cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU-backend layer's paged cache [blocks, H_kv, block_size, 2 D] as its keys' and values' [blocks, H_kv,
    block_size, D] views (a head's block holds its keys, then its values)."""
    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)
    return key_cache, value_cache


def _write(layer: Any, cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write [T, H_kv, D] keys and values into a layer's paged cache at `slots`: with vLLM's own write op on its CPU
    backend, by `layout.scatter` into a GPU backend's cache (`layout.layout_of` has taken the layout)."""
    found = layout_of(layer, cache)
    if isinstance(found, str):
        raise KVRAGError(f"kvrag's connector does not write {found}")  # start_load_kv refuses these first
    if found.kind == "split":
        scatter(cache, keys, values, slots)
        return
    isa = layer.isa
    from vllm import _custom_ops as ops

    key_cache, value_cache = _cache_views(cache)
    ops.cpu_attn_reshape_and_cache(
        keys.to(cache.dtype),
        values.to(cache.dtype),
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=getattr(layer, "_k_scale_float", 1.0),
        v_scale=getattr(layer, "_v_scale_float", 1.0),
        kv_cache_dtype=getattr(getattr(layer, "impl", None), "kv_cache_dtype", "auto"),
    )
