"""The paged write (`csrc/paged_write.c`, built apart: it needs the compiler's _Float16): a stored piece's keys and
values put into a serving engine's paged blocks in one pass, converted to the cache's dtype and the keys rotated on
the way; vLLM's connector uses it where it writes what vLLM's own write op writes."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvrag.cpu.cbuild import build

PAGED_SOURCES = (Path(__file__).with_name("csrc") / "paged_write.c",)
_PAGED_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@functools.cache
def _paged_library() -> ctypes.CDLL | None:
    """The paged-cache write, built apart: it needs the compiler's _Float16 (else None, and callers keep their own
    path)."""
    library = build("kvrag-paged", PAGED_SOURCES)
    if library is None:
        return None
    pointer, long, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    for source in _PAGED_TYPES.values():
        for cache in _PAGED_TYPES.values():
            function = getattr(library, f"paged_write_{source}_{cache}")
            function.argtypes = [pointer, pointer, long, long, int_, int_, long, int_, int_, pointer, pointer]
            function.argtypes += [pointer, pointer, pointer, long, long, int_, int_, int_]
            function.restype = ctypes.c_int
    return library


def paged_write(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    slots: torch.Tensor,
    *,
    keys_transposed: bool,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    threads: int | None = None,
) -> bool:
    """Write a piece's keys and values [L, H_kv, T, D] (float32, float16 or bfloat16, CPU; a slice of an entry along
    T is fine) into L layers' paged caches at `slots` [T] (int64: block * block_size + offset), converted to the
    caches' dtype, keys rotated by one shift on the way (cos, sin: [D_rot] float32; None: no rotation, in float32
    as `rotate_keys`). Each layer's caches are [blocks, H_kv, block_size, D] views: values one row a slot, keys the
    same or, `keys_transposed`, D rows of block_size slots a head (vLLM's CPU layout); every layer's alike in shape,
    dtype and strides. False, having written nothing, where the kernel does not take these tensors."""
    if len(key_caches) != len(value_caches) or not key_caches or keys.dim() != 4 or keys.shape != values.shape:
        return False
    layers, heads, tokens, d = keys.shape
    first = key_caches[0]
    rot = cos.shape[-1] if cos is not None else 0
    caches = [*key_caches, *value_caches]
    if (
        keys.device.type != "cpu"
        or keys.dtype not in _PAGED_TYPES
        or values.dtype != keys.dtype
        or keys.stride() != values.stride()
        or keys.stride(3) != 1
        or keys.stride(2) != d
        or len(key_caches) != layers
        or first.dtype not in _PAGED_TYPES
        or first.dim() != 4
        or first.shape[1] != heads
        or first.shape[3] != d
        or any(c.dtype != first.dtype or c.shape != first.shape or c.stride() != first.stride() for c in caches)
        or first.stride(3) != 1
        or first.stride(2) != d
        or slots.dtype != torch.int64
        or slots.shape != (tokens,)
        or not slots.is_contiguous()
        or (cos is None) != (sin is None)
    ):
        return False
    if cos is not None and (
        cos.dim() != 1
        or sin.shape != cos.shape  # type: ignore[union-attr]
        or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))  # type: ignore[union-attr]
        or not 0 < rot <= d
        or rot % 2
    ):
        return False
    if tokens and not 0 <= int(slots.min()) <= int(slots.max()) < first.shape[0] * first.shape[2]:
        raise IndexError(f"paged_write: slots outside the cache's {first.shape[0]} blocks of {first.shape[2]}")
    library = _paged_library()
    if library is None:
        return False
    if not tokens:
        return True
    array = ctypes.c_void_p * layers
    key_pointers = array(*(c.data_ptr() for c in key_caches))
    value_pointers = array(*(c.data_ptr() for c in value_caches))
    function = getattr(library, f"paged_write_{_PAGED_TYPES[keys.dtype]}_{_PAGED_TYPES[first.dtype]}")
    status = function(
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        layers,
        heads,
        tokens,
        d,
        rot,
        cos.data_ptr() if cos is not None else None,
        sin.data_ptr() if sin is not None else None,
        key_pointers,
        value_pointers,
        slots.data_ptr(),
        first.stride(0),
        first.stride(1),
        first.shape[2],
        int(keys_transposed),
        threads if threads is not None else torch.get_num_threads(),
    )
    return status == 0
