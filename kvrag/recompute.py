"""The one primitive: recompute a token set S against a stitched cache, through the model's public forward.

The stitched sequence is prefix + chunks in `order` + suffix, logical positions 0..N-1. Tokens outside S
keep their stored KV, re-positioned by one rotation; S and the suffix go in as new input with their true
positions and a 4-D additive mask that lets query i see key j iff pos(j) <= pos(i). The cache's physical
order then differs from the logical order, which attention never sees. Every strategy is a plan for this
function; it never decides what to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from transformers import DynamicCache

from kvrag.kv import ChunkKV
from kvrag.rope import Repositioner


@dataclass(slots=True)
class Stitched:
    """The result of one prefill: logits to sample from and the cache to decode on."""

    logits: torch.Tensor  # [K, V] float32, logits of the last K query positions
    cache: DynamicCache  # every token of the prompt once; physical order may differ from logical
    next_position: int  # logical position of the first generated token (= prompt length)
    recomputed_tokens: int  # context tokens in S
    attentions: tuple[torch.Tensor, ...] | None = None  # per layer [1, heads, Q, K], when asked for


def causal_mask(key_positions: torch.Tensor, query_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, Q, K] mask: 0 where pos(key) <= pos(query), the dtype's minimum elsewhere."""
    allowed = key_positions.view(1, -1) <= query_positions.view(-1, 1)  # [Q, K]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).view(1, 1, *allowed.shape)


@dataclass(slots=True)
class StitchLayout:
    """Where every token of a stitched prompt sits: pure bookkeeping, no tensors of the model."""

    kept: torch.Tensor  # [T_keep] offsets into the stitched context of tokens whose KV is reused, ascending
    selected: torch.Tensor  # [|S|] offsets of tokens recomputed, ascending
    deltas: torch.Tensor  # [T_ctx] new position minus the position each context token was encoded at
    key_positions: torch.Tensor  # [P + T_keep + Q] logical position of every key: prefix, reused, then new
    query_positions: torch.Tensor  # [Q] logical positions of the new input: S, then the suffix
    n_ctx: int  # context tokens


def stitch_layout(
    prefix_len: int,
    lengths: Sequence[int],
    encoded_at: Sequence[int],
    order: Sequence[int],
    recompute: Mapping[int, torch.Tensor],
    suffix_len: int,
    device: torch.device | str = "cpu",
) -> StitchLayout:
    """Positions of a plan: chunk c (length lengths[c], encoded from position encoded_at[c]) in `order`."""
    P = prefix_len
    ordered = torch.tensor([lengths[c] for c in order], dtype=torch.long)
    starts = P + torch.cumsum(ordered, 0) - ordered  # logical start of each chunk in the stitched order
    shifts = starts - torch.tensor([encoded_at[c] for c in order], dtype=torch.long)
    deltas = torch.repeat_interleave(shifts, ordered).to(device)  # [T_ctx]
    n_ctx = int(ordered.sum())
    flat = [recompute[c].cpu().to(torch.long) + int(s) - P for c, s in zip(order, starts) if c in recompute]
    selected = torch.cat(flat).to(device) if flat else torch.empty(0, dtype=torch.long, device=device)
    keep = torch.ones(n_ctx, dtype=torch.bool, device=device)
    keep[selected] = False
    kept = keep.nonzero().squeeze(1)
    query_positions = torch.cat((selected + P, torch.arange(P + n_ctx, P + n_ctx + suffix_len, device=device)))
    key_positions = torch.cat((torch.arange(P, device=device), kept + P, query_positions))
    return StitchLayout(kept, selected, deltas, key_positions, query_positions, n_ctx)


def stitched_kv(
    repositioner: Repositioner,
    prefix: ChunkKV,
    chunks: Sequence[ChunkKV],
    order: Sequence[int],
    layout: StitchLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reused KV (prefix, then kept context tokens re-positioned) and the context ids in stitched order.

    Returns keys [L, H_kv, P+T_keep, D], values [L, H_kv, P+T_keep, D_v], context ids [T_ctx].
    """
    ctx_keys = torch.cat([chunks[c].keys for c in order], dim=2)  # [L, H_kv, T_ctx, D]
    ctx_values = torch.cat([chunks[c].values for c in order], dim=2)
    ctx_ids = torch.cat([chunks[c].token_ids for c in order]).to(prefix.keys.device)
    deltas = layout.deltas
    if layout.selected.numel():
        ctx_keys, ctx_values, deltas = ctx_keys[:, :, layout.kept], ctx_values[:, :, layout.kept], deltas[layout.kept]
    keys = torch.cat((prefix.keys, repositioner.shift(ctx_keys, deltas)), dim=2)
    values = torch.cat((prefix.values, ctx_values), dim=2)
    return keys, values, ctx_ids


def as_cache(keys: torch.Tensor, values: torch.Tensor, cache_class: type[DynamicCache] = DynamicCache) -> DynamicCache:
    """A DynamicCache over [L, H_kv, T, D] keys and values (batch of one; views, no copy)."""
    return cache_class(ddp_cache_data=[(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(keys.shape[0])])


@torch.inference_mode()
def recompute(
    model: torch.nn.Module,
    repositioner: Repositioner,
    prefix: ChunkKV,
    chunks: Sequence[ChunkKV],
    order: Sequence[int],
    recompute: Mapping[int, torch.Tensor],
    suffix_ids: Sequence[int] | torch.Tensor,
    *,
    logits_to_keep: int = 1,
    **forward_kwargs: Any,
) -> Stitched:
    """Fresh KV for the tokens in S and the suffix, against the reused (re-positioned) KV of the rest.

    Args:
        model: the causal LM the KV came from.
        repositioner: moves stored keys to their stitched positions.
        prefix: the prefix KV, at positions 0..P-1.
        chunks: chunk KV, each at its own `start`.
        order: indices into `chunks`, first to last in the stitched sequence (non-empty).
        recompute: S, as chunk index -> sorted int64 offsets within that chunk; absent chunks keep all KV.
        suffix_ids: the suffix's token ids, always computed.
        logits_to_keep: how many last positions' logits to return.
        forward_kwargs: passed to the model's forward (e.g. output_attentions).
    """
    device = prefix.keys.device
    suffix = torch.as_tensor(suffix_ids, dtype=torch.long, device=device)
    if suffix.numel() == 0:
        raise ValueError("the suffix is empty: the question's tokens are what the logits are read from")
    layout = stitch_layout(
        len(prefix), [len(c) for c in chunks], [c.start for c in chunks], order, recompute, len(suffix), device
    )
    keys, values, ctx_ids = stitched_kv(repositioner, prefix, chunks, order, layout)
    cache = as_cache(keys, values)
    input_ids = torch.cat((ctx_ids[layout.selected], suffix)).view(1, -1)  # [1, Q]
    out = model(
        input_ids=input_ids,
        position_ids=layout.query_positions.view(1, -1),
        attention_mask=causal_mask(layout.key_positions, layout.query_positions, prefix.keys.dtype),
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **forward_kwargs,
    )
    return Stitched(
        logits=out.logits[0].float(),
        cache=cache,
        next_position=len(prefix) + layout.n_ctx + len(suffix),
        recomputed_tokens=int(layout.selected.numel()),
        attentions=getattr(out, "attentions", None),
    )


@torch.inference_mode()
def full_prefill(model: torch.nn.Module, ids: Sequence[int] | torch.Tensor, *, logits_to_keep: int = 1) -> Stitched:
    """The reference: one plain forward over the whole prompt, nothing reused."""
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    cache = DynamicCache()
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return Stitched(logits=out.logits[0].float(), cache=cache, next_position=input_ids.shape[1], recomputed_tokens=0)
