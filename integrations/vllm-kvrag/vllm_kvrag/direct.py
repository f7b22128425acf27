"""The connector's load straight into the request's blocks, on vLLM's CPU build: where kvrag's paged-write kernel
(`kvrag.cpu.paged_write`) writes what vLLM's own write op writes (checked once a cache layout, on a scratch cache),
reader threads read each entry, verify it, check its token ids against the prompt's, and write it into the blocks:
keys rotated from the position they were encoded at to their place and converted on the way, one pass over each
entry."""

from __future__ import annotations

from concurrent.futures import wait
from typing import TYPE_CHECKING, Any

import torch

from kvrag import cpu
from vllm_kvrag.paged import _cache_views, _missed, _write
from vllm_kvrag.plan import Piece

if TYPE_CHECKING:
    from vllm_kvrag.connector import KVRAGConnector, Load, LoadSeam


def fill(connector: KVRAGConnector, load: Load, layers: list[tuple[int, Any, torch.Tensor]]) -> int | None:
    """The connector's `_fill`, each entry written straight into the request's blocks by kvrag's paged-write
    kernel, in the reader threads, every piece at once; None (nothing written) where that kernel does not write
    what vLLM's write op writes for these caches, so the caller fills through the op."""
    if not layers:
        return None
    layers = sorted(layers, key=lambda x: x[0])
    first = layers[0][0]
    transposed = layout(connector, *layers[0][1:])
    if transposed is None or [i for i, _, _ in layers] != list(range(first, first + len(layers))):
        return None
    if any(layout(connector, layer, cache) is not transposed for _, layer, cache in layers):
        return None
    seam = connector.seam
    views = [_cache_views(cache) for _, _, cache in layers]
    caches = ([k for k, _ in views], [v for _, v in views])
    spans = seam.spans(load)
    bs = seam.block_size
    blocks = torch.tensor(load.block_ids, dtype=torch.int64)
    writes = []
    for piece, lo, hi, ids in spans:
        tokens = torch.arange(lo, hi)
        slots = blocks[tokens // bs] * bs + tokens % bs
        write = seam.reader.submit(_placed, seam, piece, lo, hi, ids, slots, caches, first, transposed)
        writes.append(write)
    try:
        for (piece, lo, _, _), write in zip(spans, writes):
            why = write.result()
            if why is not None:
                _missed(piece, why)
                return lo
        return load.end
    finally:  # a failed piece: the writes after it are not needed (vLLM computes those blocks), none left running
        for write in writes:
            write.cancel()
        wait(writes)


@torch.inference_mode()
def _placed(
    seam: LoadSeam,
    piece: Piece,
    lo: int,
    hi: int,
    ids: list[int],
    slots: torch.Tensor,
    caches: tuple[list[torch.Tensor], list[torch.Tensor]],
    first: int,
    transposed: bool,
) -> str | None:
    """Write a piece's tokens [lo, hi) into its slots of this worker's layers (the entry's layers from `first`
    on); None, or why it could not (`_entry`'s reasons). Runs in a reader thread, on one core."""
    found = seam.entry(piece, lo, hi, ids)
    if isinstance(found, str):
        return found
    part = seam.worker_part(found, first, len(caches[0]), caches[0][0].shape[1], caches[0][0].shape[3])
    if isinstance(part, str):
        return part
    keys, values = part
    cos = sin = None
    if piece.position != piece.start:
        cos, sin = seam.angles(piece.position - piece.start)
    if not cpu.paged_write(
        keys, values, *caches, slots, keys_transposed=transposed, cos=cos, sin=sin, threads=1
    ):
        # checked above and on the layout: a kvrag bug, said as such, and vLLM computes the tokens meanwhile
        return f" (kvrag's paged write refused its {keys.dtype} KV of shape {tuple(keys.shape)}: a bug in kvrag)"
    return None


def layout(connector: KVRAGConnector, layer: Any, cache: torch.Tensor) -> bool | None:
    """Whether kvrag's paged write, keys transposed (True) or not (False), writes what vLLM's write op writes into
    caches like this one; None where neither does, or the kernel is missing. Checked once a layout, on a scratch
    cache, with 40 tokens across a block's end."""
    scale = (getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0))
    kv_dtype = getattr(getattr(layer, "impl", None), "kv_cache_dtype", "auto")
    key = (getattr(layer, "isa", None), kv_dtype, scale, cache.dtype, tuple(cache.shape[1:]), cache.stride()[1:])
    seam = connector.seam
    if key in seam.layouts:
        return seam.layouts[key]
    found: bool | None = None
    if key[0] is not None and cache.dim() == 4 and kv_dtype == "auto" and scale == (1.0, 1.0):
        bs = seam.block_size
        slots = torch.arange(40) + max(0, bs - 10)  # across a block's end
        scratch = torch.zeros((int(slots[-1]) // bs + 1, *cache.shape[1:]), dtype=cache.dtype)
        heads, d = cache.shape[1], cache.shape[3] // 2  # a head's block row holds a key's and a value's D
        gen = torch.Generator().manual_seed(0)
        keys = torch.randn(1, heads, 40, d, generator=gen).to(cache.dtype)  # the layout, not the conversions
        values = torch.randn(1, heads, 40, d, generator=gen).to(cache.dtype)
        _write(layer, scratch, keys[0].transpose(0, 1), values[0].transpose(0, 1), slots)
        for transposed in (True, False):
            mine = torch.zeros_like(scratch)
            k, v = _cache_views(mine)
            written = cpu.paged_write(keys, values, [k], [v], slots, keys_transposed=transposed, threads=1)
            if written and torch.equal(mine, scratch):
                found = transposed
                break
    seam.layouts[key] = found
    return found
