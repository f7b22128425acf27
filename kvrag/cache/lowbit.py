"""Low-bit stored KV: keys a scale per channel over the chunk's tokens, values a scale per token over its channels.

Keys have outlier channels (a few head dimensions far larger than the rest, the same in every token: KIVI,
arXiv 2402.02750), so a key's scale follows one channel over tokens; values have no such channels and follow one
token. Along the quantized axis, groups of at most a format's group size, each with a float16 scale and minimum
(asymmetric), 2**bits levels; codes are packed eight at a time into `bits` bytes, the first code in the lowest bits
(at 4 bits, two codes a byte, low nibble first). This module packs and unpacks tensors; what an entry holds is
`codec`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_HALF_MAX = float(torch.finfo(torch.float16).max)


@dataclass(frozen=True)
class Format:
    """A low-bit storage dtype: bits and group sizes for keys and values, and the layout name entries carry.

    `layout` changes whenever anything here changes meaning: an entry of another layout is a miss.
    """

    layout: str
    key_bits: int
    value_bits: int
    key_group: int = 64  # the most tokens one key scale and minimum cover
    value_group: int = 64  # the most channels one value scale and minimum cover


# int4: keys and values at 4 bits, a little over a quarter of bfloat16 (the scales add about 14% to the codes); k4v3:
# keys at 4 bits (their error moves attention's weights), values at 3 (theirs averages out in its sums), each scale
# over 128 tokens or channels, under a quarter of bfloat16 (docs/models.md, "Stored KV, chosen per model").
FORMATS = {
    "int4": Format("int4/1", key_bits=4, value_bits=4),
    "k4v3": Format("k4v3/1", key_bits=4, value_bits=3, key_group=128, value_group=128),
}


def value_bytes(name: str) -> float:
    """About the bytes a stored value of format `name` takes, keys and values alike, the groups' scales and minima
    included (a full group of each: a plan's estimate, not an entry's exact size)."""
    f = FORMATS[name]
    return ((f.key_bits + 32 / f.key_group) + (f.value_bits + 32 / f.value_group)) / 16


def groups(length: int, group: int) -> tuple[int, int]:
    """(groups, values a group) along an axis of `length`: as few groups as `group` allows, of equal size."""
    n = -(-length // group)
    return n, -(-length // n) if n else 1


def packed_bytes(count: int, bits: int) -> int:
    """Bytes `count` codes of `bits` bits take."""
    return -(-count * bits // 8)


def quantize(x: torch.Tensor, *, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` [..., N] in `bits` bits along its last axis: (codes, scale, minimum).

    codes: uint8 [..., packed_bytes(n*g, bits)]; scale, minimum: float16 [..., n]. A value reads back as
    code * scale + minimum, within half a scale of itself: the minimum is rounded down and the scale up to float16,
    so [minimum, minimum + top * scale] still holds the group (beyond float16's range, values are clipped to it).
    """
    length = x.shape[-1]
    n, g = groups(length, group)
    top = (1 << bits) - 1
    x = x.float()
    if n * g > length:  # padded with the last value: no group's minimum or maximum moves
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], n * g - length)], dim=-1)
    x = x.reshape(*x.shape[:-1], n, g).clamp(-_HALF_MAX, _HALF_MAX)  # [..., n, g]
    minimum = _rounded(x.amin(dim=-1), down=True)  # [..., n] float16, <= the group's least value
    step = (x.amax(dim=-1) - minimum.float()) / top
    scale = _rounded(step.clamp(2.0**-24, _HALF_MAX), down=False)  # [..., n] float16, >= the step
    codes = ((x - minimum.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, top)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-2], n * g)
    return _pack(codes, bits), scale.contiguous(), minimum.contiguous()


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, length: int, *, bits: int, group: int
) -> torch.Tensor:
    """float32 [..., length] from `quantize`'s output; ValueError when the shapes are not of one `length` axis."""
    n, g = groups(length, group)
    lead = tuple(scale.shape[:-1])
    if (
        codes.dtype != torch.uint8
        or scale.dtype != torch.float16
        or minimum.dtype != torch.float16
        or tuple(scale.shape) != (*lead, n)
        or tuple(minimum.shape) != (*lead, n)
        or tuple(codes.shape) != (*lead, packed_bytes(n * g, bits))
    ):
        shapes = f"{tuple(codes.shape)}, {tuple(scale.shape)}"
        raise ValueError(f"{bits}-bit tensors of shapes {shapes} are not {length} long")
    q = _unpack(codes, bits, n * g)
    x = q.reshape(*lead, n, g).float() * scale.float()[..., None] + minimum.float()[..., None]
    return x.reshape(*lead, n * g)[..., :length]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., C] (each below 2**bits) packed into packed_bytes(C, bits) bytes a row."""
    count = codes.shape[-1]
    pad = -count % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
    eight = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int32)  # 8 codes fill `bits` bytes (24 bits at most)
    shifts = torch.arange(8, dtype=torch.int32) * bits
    word = (eight << shifts).sum(dim=-1, dtype=torch.int32)  # [..., C/8]
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(bits)], dim=-1).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], -1)[..., : packed_bytes(count, bits)].contiguous()


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` codes of `_pack`'s bytes, uint8 [..., count]."""
    pad = -packed.shape[-1] % bits
    if pad:
        packed = torch.cat([packed, packed.new_zeros(*packed.shape[:-1], pad)], dim=-1)
    parts = packed.reshape(*packed.shape[:-1], -1, bits).to(torch.int32)
    word = (parts << (torch.arange(bits, dtype=torch.int32) * 8)).sum(dim=-1, dtype=torch.int32)
    shifts = torch.arange(8, dtype=torch.int32) * bits
    codes = ((word[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


def _rounded(x: torch.Tensor, *, down: bool) -> torch.Tensor:
    """`x` (float32) in float16, rounded toward -inf (`down`) or +inf instead of to the nearest."""
    h = x.to(torch.float16)
    wrong = h.float() > x if down else h.float() < x
    toward = torch.full_like(h, float("-inf") if down else float("inf"))
    return torch.where(wrong, torch.nextafter(h, toward), h)
