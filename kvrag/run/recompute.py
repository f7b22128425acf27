"""The one primitive: recompute a token set S against a stitched cache, through the model's public forward (for a
bfloat16 model on CPU, where it holds bit for bit, the same forward in one C call: `kvrag.cpu.prefill`).

The stitched sequence is prefix + chunks in `order` + suffix, logical positions 0..N-1. Tokens outside S
keep their stored KV, re-positioned by one rotation; S and the suffix go in as new input with their true
positions and a 4-D additive mask that lets query i see key j iff pos(j) <= pos(i). The cache's physical
order then differs from the logical order, which attention never sees. Every strategy is a plan for this
function; it never decides what to recompute.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrag import cpu
from kvrag.cache.kv import ChunkKV
from kvrag.compat import with_cache
from kvrag.model.rope import Repositioner
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
    """The reused KV (prefix, then the kept context tokens re-positioned) written once into a cache with `room` free slots.

    Each chunk's kept keys are rotated by its one shift straight into their slots, every layer and head in
    one pass; values are copied in. Nothing is concatenated, and the model's new tokens then go into the room.
    `key_scale` multiplies a chunk's reused keys by a factor (an attention temperature on that chunk).
    On CPU the prefix and every piece go in one call of the C kernel (`kvrag.cpu.stitch_plan`), timed as re-positioning
    (the values' copy included); elsewhere, or where it does not apply, a rotation a chunk then the copies.
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


def as_cache(keys: torch.Tensor, values: torch.Tensor, cache_class: type[DynamicCache] = DynamicCache) -> DynamicCache:
    """A DynamicCache (or subclass) holding [L, H_kv, T, D] keys and values, batch of one."""
    return cache_class(ddp_cache_data=[(keys[i].unsqueeze(0), values[i].unsqueeze(0)) for i in range(keys.shape[0])])


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
