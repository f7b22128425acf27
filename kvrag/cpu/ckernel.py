"""The decode kernels in C, built here on first use (`kvrag.cpu.cbuild`): a decoded token's attention
(`csrc/decode_attention.c`, which the torch step calls too), the whole decode step's library (`csrc/decode_step.c`,
bound in `kvrag.cpu.cstep`), the rotation that re-positions stored keys and the stitch of a reused cache
(`csrc/rotate_keys.c`), and the streaming read `kvrag.lab.roofline` calibrates the memory's read rate with
(`csrc/stream_read.c`). The bfloat16 prefill kernels are `kvrag.cpu.cbf16`'s, the paged write `kvrag.cpu.cpaged`'s.

torch runs one token's grouped-query attention over a long cache at a third to a quarter of what a core can
read: its products for so few query rows, and its softmax, are not made for that shape. The kernel reads each
key and value once, in 16-lane float32 vectors, and splits the cache into blocks across the threads
(flash-decoding). Where there is no compiler, or the build or the load fails, `available()` is False and the
decode step keeps torch's attention (the same tokens, slower).

The rotation reads each stored key once and writes it once into its slot of the stitched cache (torch's
elementwise passes read and write it three times); where the kernel is missing, re-positioning stays on torch.
A stitch (`stitch_plan`, then `Stitch.run`) writes the prefix and every chunk, keys rotated and values copied,
in one call with streaming stores; the whole bfloat16 forward in C (`cbf16.prefill_layers`) takes it instead and
writes each layer's just before that layer's attention.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

from kvrag.cpu.cbuild import build

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "decode_attention.c", "rotate_keys.c", "decode_step.c", "decode_quantized.c", "quantize_weights.c",
        "stream_read.c",
    )
)
BLOCK = 256  # the kernel's block of cache slots
MAX_TOKENS = 8  # tokens one call of the C decode step takes (`DecodeStep.steps`)
MAX_GROUP, MAX_HEAD_DIM = 8, 256
_FUNCTIONS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_ROTATIONS = {torch.float32: "rotate_keys_f32", torch.bfloat16: "rotate_keys_bf16"}
_STITCHES = {torch.float32: "stitch_f32", torch.bfloat16: "stitch_bf16"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = build("kvrag-kernels", SOURCES)
    if library is None:
        return None
    pointer = ctypes.c_void_p
    for name in _FUNCTIONS.values():
        function = getattr(library, name)
        function.argtypes = [pointer, pointer, pointer, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        function.argtypes += [ctypes.c_long, ctypes.c_float, pointer, pointer, ctypes.c_int]
        function.restype = None
    for name in _ROTATIONS.values():
        function = getattr(library, name)
        function.argtypes = [pointer] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int] * 2 + [ctypes.c_long] * 2
        function.argtypes += [ctypes.c_int]
        function.restype = None
    for name in _STITCHES.values():
        function = getattr(library, name)
        function.argtypes = [pointer] * 7 + [ctypes.c_long] * 2 + [ctypes.c_int] * 3 + [pointer] * 2
        function.argtypes += [ctypes.c_long] * 3 + [ctypes.c_int] * 2
        function.restype = ctypes.c_int
    library.decode_steps.argtypes = [pointer, pointer, pointer, ctypes.c_long, pointer, ctypes.c_long, pointer]
    library.decode_steps.argtypes += [pointer, ctypes.c_long, pointer, ctypes.c_int]
    library.decode_steps.restype = ctypes.c_int
    library.decode_rows.argtypes = [pointer] * 5 + [ctypes.c_long] + [pointer] * 4 + [ctypes.c_int]
    library.decode_rows.restype = ctypes.c_int
    for name in ("int8_available", "int4_available"):
        getattr(library, name).argtypes, getattr(library, name).restype = [], ctypes.c_int
    for name in ("quantize_int8_rows", "quantize_int4_rows"):
        function = getattr(library, name)
        function.argtypes = [pointer, ctypes.c_int, ctypes.c_long, ctypes.c_long] + [pointer] * 3 + [ctypes.c_int]
        function.restype = ctypes.c_int
    library.stream_read.argtypes = [pointer, ctypes.c_long, ctypes.c_int]
    library.stream_read.restype = ctypes.c_float
    return library


def stream_read(buffer: torch.Tensor) -> float | None:
    """The sum of a contiguous CPU float32 buffer of a multiple of 64 elements, read front to back by the threads
    (`kernels/stream_read.c`): what `kvrag.lab.roofline` times for the memory's read rate. None without the kernels."""
    library = _library()
    if library is None:
        return None
    cpu_float = buffer.dtype == torch.float32 and buffer.device.type == "cpu"
    if not cpu_float or not buffer.is_contiguous() or buffer.numel() % 64:
        raise ValueError("stream_read takes a contiguous CPU float32 buffer of a multiple of 64 elements")
    return float(library.stream_read(buffer.data_ptr(), buffer.numel() * 4, torch.get_num_threads()))


def supports(keys: torch.Tensor, group: int) -> bool:
    """Whether the kernel takes a cache of these keys ([H_kv, capacity, d]) and this many query heads a kv head."""
    return (
        keys.device.type == "cpu"
        and keys.dtype in _FUNCTIONS
        and keys.dim() == 3
        and keys.is_contiguous()
        and keys.shape[-1] % 16 == 0
        and keys.shape[-1] <= MAX_HEAD_DIM
        and 1 <= group <= MAX_GROUP
        and _library() is not None
    )


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n: int,
    scratch: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one token's query heads q [H, d] (float32) over slots 0..n-1 of keys and values
    [H_kv, capacity, d] (contiguous, float32 or bfloat16; `supports` says which), each score times `scale`:
    [H, d] float32. (A query in bfloat16 passed unscaled takes a third of the kernel's bfloat16 dot products of
    one scaled by a factor that is not a power of two.)

    `scratch`: a float32 buffer of at least `scratch_size` elements, reused between calls (else allocated).
    """
    library = _library()
    assert library is not None, "check kvrag.cpu.ckernel.supports first"
    kv_heads, capacity, d = keys.shape
    group = q.shape[0] // kv_heads
    if not 0 < n <= capacity or q.shape != (kv_heads * group, d) or group > MAX_GROUP:
        raise ValueError(f"decode_attention: {n} slots of a cache of {capacity}, q {tuple(q.shape)}, keys {keys.shape}")
    if (
        values.shape != keys.shape
        or values.dtype != keys.dtype
        or not (keys.is_contiguous() and values.is_contiguous())
    ):
        raise ValueError("decode_attention: keys and values must be contiguous, of one shape and dtype")
    q = q.to(torch.float32).contiguous()
    size = scratch_size(kv_heads, group, d, n)
    if scratch is None or scratch.numel() < size:
        scratch = torch.empty(size, dtype=torch.float32)
    out = torch.empty(q.shape, dtype=torch.float32)
    function: Callable[..., None] = getattr(library, _FUNCTIONS[keys.dtype])
    function(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        capacity,
        kv_heads,
        group,
        d,
        n,
        scale,
        out.data_ptr(),
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _rows_evenly_spaced(out: torch.Tensor) -> bool:
    """Whether a [L, H_kv, slots, D] cache view's rows (a layer's kv head) are evenly spaced, each [slots, D]."""
    return out.stride(3) == 1 and out.stride(2) == out.shape[3] and out.stride(0) == out.shape[1] * out.stride(1)


def rotate_keys(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Write keys [L, H_kv, T, D] rotated by one shift (cos, sin: [D_rot] float32) into `out` of keys' shape, in
    one pass: float32 or bfloat16 keys (bfloat16 rotated in float32 and rounded once), contiguous, and `out` of
    their dtype, a view whose rows ([T, D] a layer's kv head) are evenly spaced (a slice of a cache's slots).
    False, having written nothing, where the kernel does not take these tensors."""
    rot = cos.shape[-1] if cos.dim() == 1 else 0
    if (
        keys.dim() != 4
        or not keys.numel()
        or keys.device.type != "cpu"
        or keys.dtype not in _ROTATIONS
        or out.dtype != keys.dtype
        or not all(t.dtype == torch.float32 for t in (cos, sin))
        or not (keys.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
        or sin.shape != cos.shape
        or out.shape != keys.shape
        or not 0 < rot <= keys.shape[-1]
        or rot % 2
    ):
        return False
    layers, heads, tokens, d = keys.shape
    if not _rows_evenly_spaced(out):
        return False
    library = _library()
    if library is None:
        return False
    getattr(library, _ROTATIONS[keys.dtype])(
        keys.data_ptr(),
        out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        layers * heads,
        tokens,
        d,
        rot,
        tokens * d,
        out.stride(1),
        torch.get_num_threads(),
    )
    return True


class Stitch:
    """A stitch checked and laid out for the C kernel (`stitch_plan`), not yet written: `run` writes every layer now;
    `prefill_layers` takes it instead and writes each layer's slots just before that layer's attention. `written`
    says whether either has."""

    def __init__(
        self,
        out_keys: torch.Tensor,
        out_values: torch.Tensor,
        pieces: list[tuple[torch.Tensor, torch.Tensor, int, bool]],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        self.out_keys, self.out_values, self.pieces, self.cos, self.sin = out_keys, out_values, pieces, cos, sin
        self.written = False
        count = len(pieces)
        pointers = ctypes.c_void_p * count
        # the C arguments after the layout: sources, slots, counts, rotated flags, angles, how many
        self.arguments = (
            pointers(*(k.data_ptr() for k, _, _, _ in pieces)),
            pointers(*(v.data_ptr() for _, v, _, _ in pieces)),
            (ctypes.c_long * count)(*(slot for _, _, slot, _ in pieces)),
            (ctypes.c_long * count)(*(k.shape[2] for k, _, _, _ in pieces)),
            (ctypes.c_int * count)(*(int(rotated) for _, _, _, rotated in pieces)),
            cos.data_ptr(),
            sin.data_ptr(),
            count,
        )

    def run(self) -> None:
        """Every layer's slots written, in one call (the cache's lines streamed out: nothing reads them soon)."""
        library = _library()
        layers, heads, _, d = self.out_keys.shape
        status = getattr(library, _STITCHES[self.out_keys.dtype])(
            *self.arguments,
            layers * heads,
            d,
            self.out_values.shape[3],
            self.cos.shape[1],
            self.out_keys.data_ptr(),
            self.out_values.data_ptr(),
            self.out_keys.stride(1),
            self.out_values.stride(1),
            0,
            1,
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"stitch: the kernel refused a shape it was checked to take ({status})")
        self.written = True


def stitch_plan(
    out_keys: torch.Tensor,
    out_values: torch.Tensor,
    pieces: list[tuple[torch.Tensor, torch.Tensor, int, bool]],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> Stitch | None:
    """Every piece (keys [L, H_kv, m, D], values [L, H_kv, m, Dv], its first slot, whether its keys are rotated) to
    be written into a cache's keys and values ([L, H_kv, slots, D] views whose rows are evenly spaced): piece j's
    keys rotated by (cos[j], sin[j]) ([pieces, D_rot] float32, as `rotate_keys` rotates) or copied, its values
    copied. None where the kernel does not take these tensors."""
    dtype = out_keys.dtype
    if (
        not pieces
        or out_keys.dim() != 4
        or out_values.dim() != 4
        or out_keys.device.type != "cpu"
        or dtype not in _STITCHES
        or out_values.dtype != dtype
        or out_keys.shape[:3] != out_values.shape[:3]
        or not (_rows_evenly_spaced(out_keys) and _rows_evenly_spaced(out_values))
        or cos.dim() != 2
        or cos.shape != sin.shape
        or cos.shape[0] != len(pieces)
        or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))
    ):
        return None
    layers, heads, slots, d = out_keys.shape
    dv, rot = out_values.shape[3], cos.shape[1]
    if d > MAX_HEAD_DIM or not 0 < rot <= d or rot % 2:
        return None
    for keys, values, slot, _ in pieces:
        m = keys.shape[2] if keys.dim() == 4 else -1
        if not (
            keys.shape == (layers, heads, m, d)
            and values.shape == (layers, heads, m, dv)
            and keys.dtype == values.dtype == dtype
            and keys.is_contiguous()
            and values.is_contiguous()
            and 0 <= slot
            and slot + m <= slots
        ):
            return None
    if _library() is None:
        return None
    return Stitch(out_keys, out_values, pieces, cos, sin)


def scratch_size(kv_heads: int, group: int, d: int, n: int) -> int:
    """Floats of scratch the kernel needs for n slots."""
    return kv_heads * -(-n // BLOCK) * group * (d + 2)


def available() -> bool:
    """Whether the kernel built and loaded on this machine."""
    return _library() is not None


@torch.library.custom_op("kvrag::decode_attention", mutates_args=("keys", "values"))
def _decode_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """For a compiled step: the token's key and value k, v [H_kv, d] written to slot `slot` ([1]) of keys and
    values [H_kv, capacity, d], then its query heads q [H, d] (times `scale`) attending to slots 0..slot."""
    n = int(slot.item())
    keys[:, n] = k
    values[:, n] = v
    return decode_attention(q.float(), keys, values, n + 1, scale=scale)


@_decode_attention_op.register_fake
def _(q, k, v, keys, values, slot, scale):  # type: ignore[no-untyped-def]
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)
