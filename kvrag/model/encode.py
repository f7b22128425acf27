"""Encoding: the prefix once, then each chunk behind it at the canonical start position, in batches; or a document's
chunks in runs, each behind the run's earlier chunks (`encode_runs`).

A chunk's KV is what the model computes for its tokens when they follow the prefix directly (or the prefix and its
run's earlier chunks). Batches are
right-padded: under the causal mask a real token never attends to padding that comes after it, so padding
does not change any chunk's KV. This module never stitches or generates.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from kvrag.cache.kv import ChunkKV, ids_digest
from kvrag.compat import with_cache

DEFAULT_BATCH_TOKENS = 4096


def stacked_kv(cache: DynamicCache, row: int, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row's [begin, end) slice of a cache as contiguous [L, H_kv, T, D] keys and values."""
    keys = torch.stack([layer.keys[row, :, begin:end] for layer in cache.layers])  # [L, H_kv, T, D]
    values = torch.stack([layer.values[row, :, begin:end] for layer in cache.layers])  # [L, H_kv, T, D_v]
    return keys, values


def prefix_cache(prefix: ChunkKV, batch: int = 1) -> DynamicCache:
    """A fresh DynamicCache holding the prefix KV, repeated over `batch` rows (views, no copy)."""
    return DynamicCache(
        ddp_cache_data=[
            (
                prefix.keys[i].unsqueeze(0).expand(batch, -1, -1, -1),
                prefix.values[i].unsqueeze(0).expand(batch, -1, -1, -1),
            )
            for i in range(prefix.keys.shape[0])
        ]
    )


@torch.inference_mode()
def encode_prefix(model: torch.nn.Module, prefix_ids: Sequence[int]) -> ChunkKV:
    """Run the prefix alone from position 0 and keep its KV."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prefix_ids)], dtype=torch.long, device=device)  # [1, P]
    cache = DynamicCache()
    model(input_ids=ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    keys, values = stacked_kv(cache, 0, 0, ids.shape[1])
    return ChunkKV(token_ids=ids[0].clone(), keys=keys, values=values, start=0)


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group chunk indices by length so that rows x longest row stays under `batch_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max(lengths[i], *(lengths[j] for j in current)) if current else lengths[i]
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def encode_chunks(
    model: torch.nn.Module,
    prefix: ChunkKV,
    chunk_ids: Sequence[Sequence[int]],
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_batch: Callable[[int], None] | None = None,
    encoder: str = "",
) -> list[ChunkKV]:
    """Encode many chunks behind the prefix, batched; return their KV in the given order.

    Args:
        model: the causal LM.
        prefix: the prefix KV (from `encode_prefix`).
        chunk_ids: each chunk's token ids.
        batch_tokens: rows x padded length per forward; 0 or less encodes one chunk a forward.
        on_batch: called with the number of chunks finished after each forward (progress).
        encoder: recorded in each ChunkKV (see `kvrag.cache.kv.encoder_id`).
    """
    runs = encode_runs(
        model, prefix, [[ids] for ids in chunk_ids], batch_tokens=batch_tokens, on_batch=on_batch, encoder=encoder
    )
    return [run[0] for run in runs]


def context_runs(lengths: Sequence[int], window: int) -> list[list[int]]:
    """One document's chunks (their token counts, in document order) cut into runs of consecutive chunks of at most
    `window` tokens each (a longer chunk is a run of its own): each chunk is encoded behind its run's earlier ones."""
    runs: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if runs and total + n <= window:
            runs[-1].append(i)
            total += n
        else:
            runs.append([i])
            total = n
    return runs


@torch.inference_mode()
def encode_runs(
    model: torch.nn.Module,
    prefix: ChunkKV,
    runs: Sequence[Sequence[Sequence[int]]],
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_batch: Callable[[int], None] | None = None,
    encoder: str = "",
) -> list[list[ChunkKV]]:
    """Encode runs of chunks behind the prefix, a run a batch row: each chunk's KV is what the model computes for its
    tokens after the prefix and the run's earlier chunks, at the positions they hold there (`ChunkKV.start`).

    A run of one chunk is a chunk encoded alone (`encode_chunks`). Stitched in their run's order from its first
    chunk on, a run's chunks are exactly the full prefill of prefix + those chunks: nothing is re-positioned and
    every token attended to what it attends to there. Rows are batched by length as `encode_chunks`' are.

    Args:
        runs: each run's chunks' token ids, in order.
        on_batch: called with the number of chunks finished after each forward.
        Others as `encode_chunks`'.
    """
    device = prefix.keys.device
    start = len(prefix)
    lengths = [sum(len(ids) for ids in run) for run in runs]
    out: list[list[ChunkKV] | None] = [None] * len(runs)
    groups = length_batches(lengths, batch_tokens) if batch_tokens > 0 else [[i] for i in range(len(runs))]
    for group in groups:
        width = max(lengths[i] for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long, device=device)  # [B, T_max], right-padded
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = torch.as_tensor([t for chunk in runs[i] for t in chunk], dtype=torch.long)
        positions = torch.arange(start, start + width, device=device).expand(len(group), -1)  # [B, T_max]
        cache = prefix_cache(prefix, len(group))
        model(input_ids=ids, position_ids=positions, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
        for row, i in enumerate(group):
            kvs, at = [], start
            for chunk in runs[i]:
                keys, values = stacked_kv(cache, row, at, at + len(chunk))
                offset = at - start
                kvs.append(
                    ChunkKV(
                        token_ids=ids[row, offset : offset + len(chunk)].clone(),
                        keys=keys,
                        values=values,
                        start=at,
                        encoder=encoder,
                        behind=ids_digest(ids[row, :offset].tolist()),
                    )
                )
                at += len(chunk)
            out[i] = kvs
        if on_batch is not None:
            on_batch(sum(len(runs[i]) for i in group))
    return out  # type: ignore[return-value]
