"""4-bit stored KV: keys a scale per channel over the chunk's tokens, values a scale per token over its channels.

Keys have outlier channels (a few head dimensions far larger than the rest, the same in every token: KIVI,
arXiv 2402.02750), so a key's scale follows one channel over tokens; values have no such channels and follow one
token. Along the quantized axis, groups of at most `GROUP`, each with a float16 scale and minimum (asymmetric),
sixteen levels, two codes a byte. This module packs and unpacks tensors; what an entry holds is `codec`'s.
"""

from __future__ import annotations

import torch

# The layout this module writes: an entry of another is a miss. Bump when anything below changes meaning.
LAYOUT = "int4/1"
GROUP = 64  # the most values one scale and minimum cover
LEVELS = 15  # codes 0..15
_HALF_MAX = float(torch.finfo(torch.float16).max)


def groups(length: int) -> tuple[int, int]:
    """(groups, values a group) along an axis of `length`: as few groups as GROUP allows, of equal size."""
    n = -(-length // GROUP)
    return n, -(-length // n) if n else 1


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` [..., N] in 4 bits along its last axis: (codes, scale, minimum).

    codes: uint8 [..., ceil(n*g/2)], low nibble first; scale, minimum: float16 [..., n]. A value reads back as
    code * scale + minimum, within half a scale of itself: the minimum is rounded down and the scale up to float16,
    so [minimum, minimum + 15 scale] still holds the group (beyond float16's range, values are clipped to it).
    """
    length = x.shape[-1]
    n, g = groups(length)
    x = x.float()
    if n * g > length:  # padded with the last value: no group's minimum or maximum moves
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], n * g - length)], dim=-1)
    x = x.reshape(*x.shape[:-1], n, g).clamp(-_HALF_MAX, _HALF_MAX)  # [..., n, g]
    minimum = _rounded(x.amin(dim=-1), down=True)  # [..., n] float16, <= the group's least value
    step = (x.amax(dim=-1) - minimum.float()) / LEVELS
    scale = _rounded(step.clamp(2.0**-24, _HALF_MAX), down=False)  # [..., n] float16, >= the step
    codes = ((x - minimum.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, LEVELS)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-2], n * g)
    if (n * g) % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], dim=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scale.contiguous(), minimum.contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, length: int) -> torch.Tensor:
    """float32 [..., length] from `quantize`'s output; ValueError when the shapes are not of one `length` axis."""
    n, g = groups(length)
    lead = tuple(scale.shape[:-1])
    if (
        codes.dtype != torch.uint8
        or scale.dtype != torch.float16
        or minimum.dtype != torch.float16
        or tuple(scale.shape) != (*lead, n)
        or tuple(minimum.shape) != (*lead, n)
        or tuple(codes.shape) != (*lead, -(-n * g // 2))
    ):
        raise ValueError(f"int4 tensors of shapes {tuple(codes.shape)}, {tuple(scale.shape)} are not {length} long")
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*lead, 2 * codes.shape[-1])[..., : n * g]
    x = q.reshape(*lead, n, g).float() * scale.float()[..., None] + minimum.float()[..., None]
    return x.reshape(*lead, n * g)[..., :length]


def _rounded(x: torch.Tensor, *, down: bool) -> torch.Tensor:
    """`x` (float32) in float16, rounded toward -inf (`down`) or +inf instead of to the nearest."""
    h = x.to(torch.float16)
    wrong = h.float() > x if down else h.float() < x
    toward = torch.full_like(h, float("-inf") if down else float("inf"))
    return torch.where(wrong, torch.nextafter(h, toward), h)
