"""The torch decode step's pieces, shared by the eager step (`kvrag.cpu.decode.FastDecoder.step`) and the compiled
one (`compiled`: each layer's step and the head through torch.compile, made once a process)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from kvrag.cpu import ckernel

BLOCK = 256  # cache slots an attention block of the compiled step reads (docs/performance.md, "Decoding")


def kernel_takes(keys: list[torch.Tensor], values: list[torch.Tensor], group: int) -> bool:
    """Whether the C kernel attends over this cache (its layers' buffers are alike: the first ones say)."""
    return ckernel.supports(keys[0], group) and ckernel.supports(values[0], group)


def _dot(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [in] times weight [out, in] as a reduction over each row (summed in float32), for inductor to generate."""
    out = (weight.float() * x.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def split_heads(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    d: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's stacked q, k and v [(Hq + 2 Hkv) d] as q [Hq, d], k and v [Hkv, d]: q and k normalized per
    head where the model does (qwen3) and rotated."""
    q = qkv[: heads * d].view(heads, d)
    k = qkv[heads * d : (heads + kv_heads) * d].view(kv_heads, d)
    v = qkv[(heads + kv_heads) * d :].view(kv_heads, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)  # type: ignore[arg-type]
    return rope(q, cos, sin), rope(k, cos, sin), v


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., d] with rows cos, sin [d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' RMSNorm: in float32, then back to the input dtype before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _layer_step(
    x: torch.Tensor,
    norm_in: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    o_w: torch.Tensor,
    norm_post: torch.Tensor,
    gate_up_w: torch.Tensor,
    down_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
    kernel: bool = False,
) -> torch.Tensor:
    """One decoder layer for one token, as `FastDecoder.step`'s loop body.

    The token's key and value go to slot `slot` ([1]) of keys/values [H_kv, T, d], and it attends to slots
    0..slot. With `kernel`, the C kernel does both (`kvrag::decode_attention`, an op inductor calls as it is),
    over the whole buffer. Else keys/values are whole blocks of BLOCK slots of the cache and attention is split
    by blocks (flash-decoding): each block's scores, softmax and weighted values on their own, then the blocks'
    partial results merged by their maxima, so every key and value is read once and each core takes whole
    blocks. Slots after `slot` may hold anything (they are masked out before any arithmetic reads them).
    """
    kv_heads, span, d = keys.shape
    h = rms_norm(x, norm_in, eps)
    q, k, v = split_heads(_dot(qkv_w, h, qkv_b), heads, kv_heads, d, q_norm, k_norm, eps, cos, sin)
    if kernel:
        out = torch.ops.kvrag.decode_attention(q, k, v, keys, values, slot, scale)  # [H, d] float32
    else:
        keys.index_copy_(1, slot, k[:, None])
        values.index_copy_(1, slot, v[:, None])
        blocks, group = span // BLOCK, heads // kv_heads
        grouped = (q.view(kv_heads, 1, group, 1, d) * scale).float()  # the query rows of each kv head
        scores = (grouped * keys.view(kv_heads, blocks, 1, BLOCK, d).float()).sum(-1)  # [H_kv, S, G, B]
        seen = torch.arange(span, device=keys.device).view(blocks, 1, BLOCK) <= slot  # [S, 1, B]
        scores = torch.where(seen, scores, float("-inf"))
        top = scores.amax(-1)  # [H_kv, S, G]: every block holds a seen slot, so this is finite
        weights = torch.exp(scores - top[..., None])
        mass = weights.sum(-1)  # [H_kv, S, G]
        weighted = weights[..., None] * values.view(kv_heads, blocks, 1, BLOCK, d).float()
        partial = torch.where(seen[..., None], weighted, 0.0).sum(-2)  # [H_kv, S, G, d]
        rescale = torch.exp(top - top.amax(1, keepdim=True))  # [H_kv, S, G]
        out = (partial * rescale[..., None]).sum(1) / (mass * rescale).sum(1)[..., None]  # [H_kv, G, d]
    x = x + _dot(o_w, out.to(x.dtype).reshape(heads * d))
    gate, up = _dot(gate_up_w, rms_norm(x, norm_post, eps)).chunk(2)
    return x + _dot(down_w, F.silu(gate) * up)


def _head_step(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    return _dot(lm_head, rms_norm(x, norm, eps)).float()


@functools.cache
def compiled() -> tuple[Any, Any]:
    """The compiled layer step and head, made once a process (compiled code is kept per function and its shapes,
    so every decoder of every model shares them)."""
    return torch.compile(_layer_step, dynamic=False), torch.compile(_head_step, dynamic=False)
