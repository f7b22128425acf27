"""How a vLLM worker's paged KV cache is laid out, and how kvrag writes stored KV into it on any device.

vLLM gives each attention layer one cache tensor. Its logical shape is [blocks, kv heads, block tokens, content];
its physical order is one of vLLM's KVCacheLayouts (`vllm.v1.kv_cache_layout`: LBHNC, LBNHC, BLHNC, ... for
"heads before tokens" (HND) or "tokens before heads" (NHD) and where the layers sit), which only the strides
say. Two contents are known here:

- `cpu`: vLLM's CPU attention backend, content 2 x D read as a head's block of keys then its block of values;
  written with vLLM's own CPU op (`cpu_attn_reshape_and_cache`) or kvrag's paged-write kernel;
- `split`: the GPU backends (FlashAttention, FlashInfer, Triton), content 2 x D read as a token's key then its
  value (`kv_cache.transpose(1, 2).split(head_size, dim=-1)` in their `do_kv_cache_update`); written here by
  `scatter`, an indexed copy into the logical view, which holds whatever the strides are and on whatever device
  the cache lives.

Anything else is refused by name (`layout_of` says why) and vLLM computes the tokens: an fp8 cache (its scales
are vLLM's to apply), a cache whose last dimension is not twice the head size, a dtype other than float16,
bfloat16 and float32.

With tensor parallelism a worker holds some of the model's kv heads (`kv_heads_of`: vLLM's own split, each head
replicated on several workers where there are fewer kv heads than workers); a stored entry holds them all, and
each worker writes its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedLayout:
    """A layer's paged cache as kvrag writes it: `kind` "cpu" or "split" (module docstring)."""

    kind: str
    block_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype


def layout_of(layer: Any, cache: torch.Tensor) -> PagedLayout | str:
    """The layout of `layer`'s paged cache, or why kvrag does not write it (one line, naming what it found)."""
    kv_dtype = str(getattr(getattr(layer, "impl", None), "kv_cache_dtype", "auto"))
    if kv_dtype != "auto":
        return f"a {kv_dtype} KV cache (kvrag writes float16, bfloat16 and float32 caches)"
    if cache.dim() != 4 or cache.shape[-1] % 2:
        return f"a KV cache of shape {tuple(cache.shape)} (kvrag writes [blocks, kv heads, block tokens, 2 x D])"
    if cache.dtype not in _DTYPES:
        return f"a {cache.dtype} KV cache (kvrag writes float16, bfloat16 and float32 caches)"
    blocks, heads, block_size, content = cache.shape
    kind = "cpu" if getattr(layer, "isa", None) is not None else "split"
    return PagedLayout(kind, block_size, heads, content // 2, cache.dtype)


def split_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `split` cache's keys and values as [blocks, kv heads, block tokens, D] views (no copy)."""
    keys, values = cache.split(head_dim, dim=-1)
    return keys, values


@torch.inference_mode()
def scatter(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write [T, H_kv, D] keys and values into a `split` cache at `slots` (slot = block x block size + token),
    converted to the cache's dtype on the cache's device: an indexed copy into the logical view, whatever its
    physical order (every KVCacheLayout), bit for bit what vLLM's `reshape_and_cache_flash` stores for a cache
    dtype of "auto"."""
    block_size, head_dim = cache.shape[2], keys.shape[-1]
    key_view, value_view = split_views(cache, head_dim)
    slots = slots.to(cache.device, torch.int64)
    blocks, tokens = slots // block_size, slots % block_size
    key_view[blocks, :, tokens] = keys.to(cache.device, cache.dtype)  # [T, H_kv, D] at (block, :, token)
    value_view[blocks, :, tokens] = values.to(cache.device, cache.dtype)


def kv_heads_of(total: int, tp_rank: int, tp_size: int) -> slice:
    """The kv heads worker `tp_rank` of `tp_size` holds, as vLLM's QKVParallelLinear splits them: `total / tp_size`
    each where there are at least as many heads as workers, else one each, every head on `tp_size / total`
    consecutive workers."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}")
    if tp_size >= total:
        if tp_size % total:
            raise ValueError(f"{total} kv heads do not replicate evenly over {tp_size} workers")
        head = tp_rank // (tp_size // total)
        return slice(head, head + 1)
    if total % tp_size:
        raise ValueError(f"{total} kv heads do not split evenly over {tp_size} workers")
    each = total // tp_size
    return slice(tp_rank * each, (tp_rank + 1) * each)


def tensor_parallel() -> tuple[int, int]:
    """This worker's (tensor-parallel rank, size); (0, 1) where vLLM's parallel state is not set up."""
    try:
        from vllm.distributed import parallel_state

        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no distributed state (a test, one worker): all heads are this worker's
        return 0, 1
