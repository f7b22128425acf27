"""The one primitive: recompute a token set S against a stitched cache, through the model's public forward.

The stitched sequence is prefix + chunks in `order` + suffix, logical positions 0..N-1. Tokens outside S
keep their stored KV, re-positioned by one rotation; S and the suffix go in as new input with their true
positions and a 4-D additive mask that lets query i see key j iff pos(j) <= pos(i). The cache's physical
order then differs from the logical order, which attention never sees. Every strategy is a plan for this
function; it never decides what to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

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


def causal_mask(key_positions: torch.Tensor, query_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, Q, K] mask: 0 where pos(key) <= pos(query), the dtype's minimum elsewhere."""
    allowed = key_positions.view(1, -1) <= query_positions.view(-1, 1)  # [Q, K]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).view(1, 1, *allowed.shape)


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
) -> Stitched:
    """Fresh KV for the tokens in S and the suffix, against the reused (re-positioned) KV of the rest.

    Args:
        model: the causal LM the KV came from.
        repositioner: moves stored keys to their stitched positions.
        prefix: the prefix KV, at positions 0..P-1.
        chunks: chunk KV, each at its own `start`.
        order: indices into `chunks`, first to last in the stitched sequence.
        recompute: S, as chunk index -> sorted int64 offsets within that chunk; absent chunks keep all KV.
        suffix_ids: the suffix's token ids, always computed.
        logits_to_keep: how many last positions' logits to return.
    """
    device = prefix.keys.device
    dtype = prefix.keys.dtype
    P = len(prefix)
    lengths = torch.tensor([len(chunks[c]) for c in order], dtype=torch.long)
    starts = P + torch.cumsum(lengths, 0) - lengths  # logical start of each chunk in the stitched order
    shifts = starts - torch.tensor([chunks[c].start for c in order], dtype=torch.long)
    deltas = torch.repeat_interleave(shifts, lengths).to(device)  # [T_ctx]
    n_ctx = int(lengths.sum())

    # S as flat offsets into the stitched context, ascending (= logical order).
    flat = [recompute[c].to(torch.long) + int(s) - P for c, s in zip(order, starts) if c in recompute]
    selected = torch.cat(flat).to(device) if flat else torch.empty(0, dtype=torch.long, device=device)
    keep = torch.ones(n_ctx, dtype=torch.bool, device=device)
    keep[selected] = False
    kept = keep.nonzero().squeeze(1)  # [T_keep] offsets of reused tokens

    ctx_keys = torch.cat([chunks[c].keys for c in order], dim=2) if order else prefix.keys[:, :, :0]  # [L, H, T_ctx, D]
    ctx_values = torch.cat([chunks[c].values for c in order], dim=2) if order else prefix.values[:, :, :0]
    ctx_ids = torch.cat([chunks[c].token_ids for c in order]).to(device) if order else prefix.token_ids[:0]
    if selected.numel():
        ctx_keys, ctx_values, deltas = ctx_keys[:, :, kept], ctx_values[:, :, kept], deltas[kept]
    keys = torch.cat((prefix.keys, repositioner.shift(ctx_keys, deltas)), dim=2)  # [L, H_kv, P+T_keep, D]
    values = torch.cat((prefix.values, ctx_values), dim=2)
    cache = DynamicCache(ddp_cache_data=[(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(keys.shape[0])])

    suffix = torch.as_tensor(suffix_ids, dtype=torch.long, device=device)
    input_ids = torch.cat((ctx_ids[selected], suffix)).view(1, -1)  # [1, Q]
    query_positions = torch.cat((selected + P, torch.arange(P + n_ctx, P + n_ctx + len(suffix), device=device)))
    key_positions = torch.cat((torch.arange(P, device=device), kept + P, query_positions))
    mask = causal_mask(key_positions, query_positions, dtype)
    out = model(
        input_ids=input_ids,
        position_ids=query_positions.view(1, -1),
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return Stitched(
        logits=out.logits[0].float(),
        cache=cache,
        next_position=P + n_ctx + len(suffix),
        recomputed_tokens=int(selected.numel()),
    )


@torch.inference_mode()
def full_prefill(model: torch.nn.Module, ids: Sequence[int] | torch.Tensor, *, logits_to_keep: int = 1) -> Stitched:
    """The reference: one plain forward over the whole prompt, nothing reused."""
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    cache = DynamicCache()
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return Stitched(logits=out.logits[0].float(), cache=cache, next_position=input_ids.shape[1], recomputed_tokens=0)
