"""The one primitive: recompute a token set S against a stitched cache, through the model's public forward (for a
bfloat16 model on CPU, where it holds bit for bit, the same forward in one C call: `kvrag.cpu.prefill`).

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

from kvrag import cpu
from kvrag.cache.kv import ChunkKV
from kvrag.compat import with_cache
from kvrag.model.rope import Repositioner
from kvrag.model.stitched import GrowingLayer, StitchedCache, Workspace, as_cache  # noqa: F401 - as before
from kvrag.timing import Phases, phase


@dataclass(slots=True)
class Prefill:
    """The result of one prefill (stitched or plain): logits to sample from and the cache to decode on."""

    logits: torch.Tensor  # [K, V] float32, logits of the last K query positions
    cache: DynamicCache  # every token of the prompt once; physical order may differ from logical
    next_position: int  # logical position of the first generated token (= prompt length)
    recomputed_tokens: int  # context tokens in S
    attentions: tuple[torch.Tensor, ...] | None = None  # per layer [1, heads, Q, K], when asked for
    key_positions: torch.Tensor | None = None  # [N] logical position of each physical cache slot; None: in order
    prompt_ids: list[int] | None = None  # the prompt's token ids in logical order, where the caller knows them


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
    shifts: torch.Tensor  # [len(order)] the same, one a chunk (every token of a chunk moves by its chunk's shift)
    key_positions: torch.Tensor  # [P + T_keep + Q] logical position of every key: prefix, reused, then new
    query_positions: torch.Tensor  # [Q] logical positions of the new input: S, then the suffix
    n_ctx: int  # context tokens


def stitch_layout(
    prefix_len: int,
    lengths: Sequence[int],
    encoded_at: Sequence[int],
    order: Sequence[int],
    selected: Mapping[int, torch.Tensor],
    suffix_len: int,
    device: torch.device | str = "cpu",
) -> StitchLayout:
    """Positions of a plan: chunk c (length lengths[c], encoded from position encoded_at[c]) in `order`."""
    P = prefix_len
    ordered = torch.tensor([lengths[c] for c in order], dtype=torch.long)
    starts = P + torch.cumsum(ordered, 0) - ordered  # logical start of each chunk in the stitched order
    shifts = starts - torch.tensor([encoded_at[c] for c in order], dtype=torch.long)
    n_ctx = int(ordered.sum())
    flat = [selected[c].cpu().to(torch.long) + int(s) - P for c, s in zip(order, starts) if c in selected]
    in_s = torch.cat(flat).to(device) if flat else torch.empty(0, dtype=torch.long, device=device)  # [|S|]
    keep = torch.ones(n_ctx, dtype=torch.bool, device=device)
    keep[in_s] = False
    kept = keep.nonzero().squeeze(1)
    query_positions = torch.cat((in_s + P, torch.arange(P + n_ctx, P + n_ctx + suffix_len, device=device)))
    key_positions = torch.cat((torch.arange(P, device=device), kept + P, query_positions))
    return StitchLayout(kept, in_s, shifts.to(device), key_positions, query_positions, n_ctx)


def stitch_cache(
    repositioner: Repositioner,
    prefix: ChunkKV,
    chunks: Sequence[ChunkKV],
    order: Sequence[int],
    selected: Mapping[int, torch.Tensor],
    layout: StitchLayout,
    *,
    room: int,
    phases: Phases | None = None,
    workspace: Workspace | None = None,
    key_scale: Mapping[int, float] | None = None,
    deferred: bool = False,
) -> StitchedCache:
    """The reused KV (prefix, then the kept context tokens re-positioned) written once into a cache with `room` free
    slots.

    Each chunk's kept keys are rotated by its one shift straight into their slots, every layer and head in
    one pass; values are copied in. Nothing is concatenated, and the model's new tokens then go into the room.
    `key_scale` multiplies a chunk's reused keys by a factor (an attention temperature on that chunk).
    On CPU the prefix and every piece go in one call of the C kernel (`kvrag.cpu.stitch_plan`), timed as
    re-positioning (the values' copy included); elsewhere, or where it does not apply, a rotation a chunk then the
    copies.
    `deferred`: where that C call applies it is prepared and not run, left as the cache's `pending` stitch for
    `stitched_forward` to write (within its forward in C, a layer just before that layer's attention, which then
    reads it from the caches rather than from memory); the caller then runs that forward before anything reads
    the cache.
    """
    key_scale = key_scale or {}
    L, H, P, D = prefix.keys.shape
    n = P + int(layout.kept.numel())
    shapes = (L, 1, H, n + room, D), (L, 1, H, n + room, prefix.values.shape[-1])  # [L, B=1, H_kv, capacity, D]
    if workspace is not None:
        keys, values, buffers = workspace.take(*shapes, prefix.keys)
    else:
        keys, values, buffers = prefix.keys.new_empty(shapes[0]), prefix.values.new_empty(shapes[1]), None
    with phase(phases, "cache assembly and mask"):
        pieces = []  # (chunk index, offsets kept or None for all, slot of its first kept token, kept count)
        at = P
        for c in order:
            kept = None
            if c in selected and selected[c].numel():
                keep = torch.ones(len(chunks[c]), dtype=torch.bool, device=keys.device)
                keep[selected[c].to(keys.device)] = False
                kept = keep.nonzero().squeeze(1)
            m = len(chunks[c]) if kept is None else int(kept.numel())
            pieces.append((c, kept, at, m))
            at += m
    with phase(phases, "re-positioning"):
        cos, sin = repositioner.angles(layout.shifts.to(keys.device))  # [C, D_rot]: one shift a chunk
        plan = _stitch_in_one_pass(repositioner.model, keys, values, prefix, chunks, pieces, cos, sin, key_scale)
        if plan is not None and not deferred:
            plan.run()
        one_pass = plan is not None
        for j, (c, kept, at, m) in enumerate(pieces):
            if m and not one_pass:
                src = chunks[c].keys if kept is None else chunks[c].keys[:, :, kept]
                repositioner.rotate_into(keys[:, 0, :, at : at + m], src, cos[j], sin[j])
                if key_scale.get(c, 1.0) != 1.0:
                    keys[:, 0, :, at : at + m].mul_(key_scale[c])
    with phase(phases, "cache assembly and mask"):
        if not one_pass:
            keys[:, 0, :, :P].copy_(prefix.keys)
            values[:, 0, :, :P].copy_(prefix.values)
            for c, kept, at, m in pieces:
                if m:
                    src = chunks[c].values if kept is None else chunks[c].values[:, :, kept]
                    values[:, 0, :, at : at + m].copy_(src)
        cache = StitchedCache(keys, values, n)
        cache.buffers = buffers
        cache.pending = plan if deferred else None
        return cache


def _stitch_in_one_pass(
    model: torch.nn.Module | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix: ChunkKV,
    chunks: Sequence[ChunkKV],
    pieces: list[tuple[int, torch.Tensor | None, int, int]],
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_scale: Mapping[int, float],
) -> cpu.Stitch | None:
    """The prefix and every kept piece as one call of the C kernel (keys rotated, values copied: `cpu.stitch_plan`),
    prepared, not yet run; None where it does not apply (then the caller's torch path writes them). A piece of a
    chunk's tokens (some recomputed) is gathered first."""
    if keys.device.type != "cpu" or any(key_scale.get(c, 1.0) != 1.0 for c, _, _, _ in pieces):
        return None
    parts, angles = [], []  # (keys, values, first slot, rotated), and the piece's (cos, sin)
    if len(prefix):
        parts.append((prefix.keys, prefix.values, 0, False))  # in place already: copied, not rotated
        angles.append((torch.ones_like(cos[0]), torch.zeros_like(sin[0])))
    for j, (c, kept, at, m) in enumerate(pieces):
        if m:
            kv = chunks[c]
            pk, pv = (kv.keys, kv.values) if kept is None else (kv.keys[:, :, kept], kv.values[:, :, kept])
            parts.append((pk, pv, at, True))
            angles.append((cos[j], sin[j]))
    if not parts:
        return None
    stacked_cos, stacked_sin = (torch.stack(a) for a in zip(*angles))
    return cpu.stitch_plan(model, keys[:, 0], values[:, 0], parts, stacked_cos, stacked_sin)


@torch.inference_mode()
def recompute(
    model: torch.nn.Module,
    repositioner: Repositioner,
    prefix: ChunkKV,
    chunks: Sequence[ChunkKV],
    order: Sequence[int],
    selected: Mapping[int, torch.Tensor],
    suffix_ids: Sequence[int] | torch.Tensor,
    *,
    logits_to_keep: int = 1,
    room: int = 0,
    phases: Phases | None = None,
    workspace: Workspace | None = None,
    key_scale: Mapping[int, float] | None = None,
    **forward_kwargs: Any,
) -> Prefill:
    """Fresh KV for the tokens in S and the suffix, against the reused (re-positioned) KV of the rest.

    Args:
        model: the causal LM the KV came from.
        repositioner: moves stored keys to their stitched positions.
        prefix: the prefix KV, at positions 0..P-1.
        chunks: chunk KV, each at its own `start`.
        order: indices into `chunks`, first to last in the stitched sequence (non-empty).
        selected: S, as chunk index -> sorted int64 offsets within that chunk; absent chunks keep all KV.
        suffix_ids: the suffix's token ids, always computed.
        logits_to_keep: how many last positions' logits to return.
        room: cache slots kept free for tokens decoded after the prompt (more are added when needed).
        phases: where to record re-positioning, cache assembly (the ids) and forward times (opt-in; the 4-D mask,
            where the model's forward needs one, is made in the forward's).
        workspace: where the cache's buffers come from; the caller gives them back when done with the cache.
        key_scale: chunk index -> factor on that chunk's reused keys (an attention temperature; see Plan).
        forward_kwargs: passed to the model's forward (e.g. output_attentions).
    """
    # Long only by its documented arguments: the body is the primitive's four steps, kept in one place.
    device = prefix.keys.device
    suffix = torch.as_tensor(suffix_ids, dtype=torch.long, device=device)
    if suffix.numel() == 0:
        raise ValueError("the suffix is empty: the question's tokens are what the logits are read from")
    with phase(phases, "cache assembly and mask"):
        layout = stitch_layout(
            len(prefix), [len(c) for c in chunks], [c.start for c in chunks], order, selected, len(suffix), device
        )
    n_new = int(layout.query_positions.numel())
    cache = stitch_cache(
        repositioner,
        prefix,
        chunks,
        order,
        selected,
        layout,
        room=n_new + room,
        phases=phases,
        workspace=workspace,
        key_scale=key_scale,
        # where the forward below runs in C, the stitch is written within it, a layer at a time (timed there)
        deferred=logits_to_keep == 1 and not forward_kwargs and cpu.prefill_may_take(model, prefix.keys),
    )
    with phase(phases, "cache assembly and mask"):
        ctx_ids = torch.cat([chunks[c].token_ids for c in order]).to(device)
        input_ids = torch.cat((ctx_ids[layout.selected], suffix)).view(1, -1)  # [1, Q]
    with phase(phases, "forward"):  # the 4-D mask made in it where the model's forward runs
        logits, out = stitched_forward(
            model, cache, input_ids, layout.query_positions, layout.key_positions, logits_to_keep, **forward_kwargs
        )
    return Prefill(
        logits=logits,
        cache=cache,
        next_position=len(prefix) + layout.n_ctx + len(suffix),
        recomputed_tokens=int(layout.selected.numel()),
        attentions=getattr(out, "attentions", None),
        key_positions=layout.key_positions,
    )


def stitched_forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    logits_to_keep: int = 1,
    **forward_kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The forward of a stitched prefill's new tokens ([1, Q], at logical `query_positions`) over `cache`, whose
    keys sit at logical `key_positions` (each token sees those at or before its own: `causal_mask`): the last
    `logits_to_keep` tokens' logits [logits_to_keep, V] float32 and the model's output (None where the whole
    forward ran in one C call, `kvrag.cpu.prefill`: one token's logits and no extra outputs asked for; no mask is
    made then). A stitch `cache` still owes (`stitch_cache(deferred=True)`) is written first, or by the C call a layer
    at a time."""
    if logits_to_keep == 1 and not forward_kwargs:
        logits = _forward_in_c(model, cache, input_ids, query_positions, key_positions)
        if logits is not None:
            return logits, None
    _settle(cache)
    dtype = cache.layers[0].keys.dtype if cache.layers else next(model.parameters()).dtype
    out = model(
        input_ids=input_ids,
        position_ids=query_positions.view(1, -1),
        attention_mask=causal_mask(key_positions, query_positions, dtype),
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **forward_kwargs,
    )
    return out.logits[0].float(), out


def _settle(cache: DynamicCache) -> None:
    """The stitch `cache` still owes (`stitch_cache(deferred=True)`), written where nothing has written it yet."""
    pending = getattr(cache, "pending", None)
    if pending is not None:
        cache.pending = None
        if not pending.written:
            pending.run()


def _forward_in_c(
    model: torch.nn.Module,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
) -> torch.Tensor | None:
    """The forward's last-token logits [1, V] through `kvrag.cpu.prefill` (a bfloat16 model on CPU, the whole forward in
    one C call, bitwise the model's), the cache's views grown over the tokens it wrote; None where it does not take
    the call."""
    layers = cache.layers
    if not layers or not all(isinstance(layer, GrowingLayer) and layer.keys.shape[0] == 1 for layer in layers):
        return None
    filled, n = layers[0].keys.shape[-2], input_ids.shape[-1]
    if not all(layer.keys.shape[-2] == filled and layer._in_room(filled + n) for layer in layers):
        return None
    keys = [layer._keys[0] for layer in layers]
    values = [layer._values[0] for layer in layers]
    pending = getattr(cache, "pending", None)
    logits = cpu.prefill_forward(model, keys, values, filled, input_ids, query_positions, key_positions, pending)
    _settle(cache)  # written by the C call where it was taken; else now
    if logits is not None:
        for layer in layers:
            layer.keys, layer.values = layer._keys[:, :, : filled + n], layer._values[:, :, : filled + n]
    return logits


@torch.inference_mode()
def full_prefill(
    model: torch.nn.Module,
    ids: Sequence[int] | torch.Tensor,
    *,
    logits_to_keep: int = 1,
    cache: DynamicCache | None = None,
    shared: int = 0,
) -> Prefill:
    """The reference: one plain forward over the whole prompt, nothing reused.

    With `cache` (a full prefill's cache whose first `shared` tokens are those of `ids`), their KV is
    copied from it and only the rest is run: prefix caching, the same attention up to rounding.
    """
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    n = input_ids.shape[1]
    shared = shared if cache is not None else 0
    fresh = DynamicCache()
    if cache is not None and shared:
        fresh = DynamicCache(
            ddp_cache_data=[
                (layer.keys[:, :, :shared].clone(), layer.values[:, :, :shared].clone()) for layer in cache.layers
            ]
        )
    out = model(
        input_ids=input_ids[:, shared:],
        position_ids=torch.arange(shared, n, device=device).view(1, -1) if shared else None,
        **with_cache(model, fresh),
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return Prefill(logits=out.logits[0].float(), cache=fresh, next_position=n, recomputed_tokens=0)
