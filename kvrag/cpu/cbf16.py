"""The bfloat16 prefill kernels, on CPUs with AVX512-BF16 (built apart, at the first bfloat16 model or prefill that
needs them): attention (`csrc/prefill_attention.c`), linear layers (`csrc/prefill_linear.c`), RMSNorms
(`csrc/prefill_norm.c`), the rotary embedding (`csrc/prefill_rotary.c`), SiLU(gate) * up (`csrc/prefill_silu.c`)
and the whole forward over them (`csrc/prefill_layers.c`), which writes a stitch (`kvrag.cpu.ckernel.Stitch`) a
layer at a time. Each returns None where it does not take the call, and the torch module computes it."""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from kvrag.cpu.cbuild import build
from kvrag.cpu.ckernel import Stitch
from kvrag.cpu.cstep import DecodeStep

# built apart, at a bfloat16 prefill's first attention or linear layer: its build takes seconds, and float32 models
# never need it
PREFILL_SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "prefill_attention.c", "prefill_linear.c", "prefill_norm.c", "prefill_rotary.c", "prefill_silu.c",
        "prefill_layers.c", "rotate_keys.c",  # the last for the stitch the whole forward runs a layer at a time
    )
)

@functools.cache
def _prefill_library() -> ctypes.CDLL | None:
    """The bfloat16 prefill attention, where the CPU has AVX512-BF16 (else None)."""
    library = build("kvrag-prefill", PREFILL_SOURCES)
    if library is None or not library.prefill_attention_available():
        return None
    pointer, long, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.prefill_attention_bf16.argtypes = [pointer, long, long, pointer, pointer, long, long, pointer, int_]
    library.prefill_attention_bf16.argtypes += [long, int_]
    library.prefill_attention_bf16.argtypes += [pointer, long, long, int_, int_, int_, ctypes.c_float, int_]
    library.prefill_attention_bf16.restype = ctypes.c_int
    library.prefill_linear_bf16.argtypes = [pointer, long, long, long, pointer, long, pointer, pointer, long, pointer]
    library.prefill_linear_bf16.argtypes += [int_]
    library.prefill_linear_bf16.restype = ctypes.c_int
    library.prefill_linear_one_bf16.argtypes = [pointer, long, pointer, long, pointer, pointer, int_]
    library.prefill_linear_one_bf16.restype = ctypes.c_int
    library.prefill_linear_scratch.argtypes = [long, long]
    library.prefill_linear_scratch.restype = long
    library.prefill_rms_norm_bf16.argtypes = [pointer, long, pointer, pointer, long, long, long, ctypes.c_float, int_]
    library.prefill_rms_norm_bf16.restype = ctypes.c_int
    library.prefill_rotary_bf16.argtypes = [pointer, long, long, long, pointer, long, long, long, pointer, pointer]
    library.prefill_rotary_bf16.argtypes += [long, long, pointer, long, long, long, pointer, long, long, long]
    library.prefill_rotary_bf16.argtypes += [long, long, long, long, int_, int_]
    library.prefill_rotary_bf16.restype = ctypes.c_int
    library.prefill_silu_mul_bf16.argtypes = [pointer, long, pointer, long, pointer, long, long, long, int_]
    library.prefill_silu_mul_bf16.restype = ctypes.c_int
    library.prefill_layers_bf16.argtypes = [pointer, pointer, pointer, long, long, pointer, long, pointer, pointer]
    library.prefill_layers_bf16.argtypes += [pointer, pointer, pointer] + [pointer] * 7 + [long, int_, int_]
    library.prefill_layers_bf16.restype = ctypes.c_int
    return library


def _token_rows(x: torch.Tensor, weight: torch.Tensor, least: int = 2) -> torch.Tensor | None:
    """x [..., D] as its tokens' rows [tokens, D] where a prefill kernel takes x with this weight: both bfloat16 on
    CPU, D the weight's last size, `least` tokens or more, each row contiguous; else None."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or x.dim() < 2
        or weight.dim() < 1
        or x.shape[-1] != weight.shape[-1]
    ):
        return None
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.shape[0] >= least and rows.stride(-1) == 1 else None


def prefill_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' RMSNorm of bfloat16 x [..., D] (two or more tokens, CPU) with a bfloat16 weight [D], in one
    pass (`kernels/prefill_norm.c`): the module's roundings, its mean summed in another order. None where it does
    not take the call (another dtype or device, one token, no AVX512-BF16 or no compiler)."""
    rows = _token_rows(x, weight)
    library = _prefill_library() if rows is not None and weight.dim() == 1 and weight.is_contiguous() else None
    if library is None:
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    status = library.prefill_rms_norm_bf16(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[-1], rows.shape[0],
        x.shape[-1], eps, torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"prefill_rms_norm: the kernel refused a shape it was checked to take ({status})")
    return out


def prefill_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` for bfloat16 gate and up [..., F] of two or more tokens on CPU, in one pass
    (`kernels/prefill_silu.c`): torch's roundings, its exp another one within an ulp, so an output can differ from
    torch's by one bfloat16 step, rarely. None where it does not take the call (another dtype or device, one token,
    other shapes, rows not contiguous, no AVX512-BF16 or no compiler)."""
    if gate.shape != up.shape:
        return None
    gates, ups = _token_rows(gate, up), _token_rows(up, gate)
    library = _prefill_library() if gates is not None and ups is not None else None
    if library is None:
        return None
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    status = library.prefill_silu_mul_bf16(
        gates.data_ptr(), gates.stride(0), ups.data_ptr(), ups.stride(0), out.data_ptr(), gate.shape[-1],
        gates.shape[0], gate.shape[-1], torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"prefill_silu_mul: the kernel refused a shape it was checked to take ({status})")
    return out


def prefill_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` for bfloat16 q [B, H, n, D] and k [B, H_kv, n, D] (two or
    more tokens, CPU, rows of D contiguous) with cos and sin [B or 1, n, D], in one pass a tensor
    (`kernels/prefill_rotary.c`): bitwise transformers' result, laid out as the projections were ([B, n, H, D] in
    memory). None where it does not take the call (another dtype or device, one token, other shapes, no
    AVX512-BF16 or no compiler)."""
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (q, k, cos, sin)):
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.stride() != sin.stride():
        return None
    batch, heads, n, d = q.shape
    if (
        n < 2
        or k.shape[0] != batch
        or k.shape[2:] != (n, d)
        or cos.shape[0] not in (1, batch)
        or cos.shape[1:] != (n, d)
        or any(t.stride(-1) != 1 for t in (q, k, cos))
        or not (2 <= d <= 256 and d % 2 == 0)
    ):
        return None
    library = _prefill_library()
    if library is None:
        return None
    kv_heads = k.shape[1]
    q_out = torch.empty(batch, n, heads, d, dtype=torch.bfloat16).transpose(1, 2)
    k_out = torch.empty(batch, n, kv_heads, d, dtype=torch.bfloat16).transpose(1, 2)
    status = library.prefill_rotary_bf16(
        q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], cos.data_ptr(), sin.data_ptr(),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), q_out.data_ptr(), *q_out.stride()[:3],
        k_out.data_ptr(), *k_out.stride()[:3], batch, heads, kv_heads, n, d, torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"prefill_rotary: the kernel refused a shape it was checked to take ({status})")
    return q_out, k_out


def prefill_layers_available() -> bool:
    """Whether `prefill_layers` runs here (a CPU with AVX512-BF16 and a compiler that built it)."""
    library = _prefill_library()
    return library is not None and bool(library.prefill_layers_available())


def prefill_layers(
    step: DecodeStep,
    tokens: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    filled: int,
    stitch: Stitch | None = None,
) -> torch.Tensor | None:
    """A bfloat16 prefill of `tokens` (two or more) through every layer of the C step's model and its head, in one
    call (`kernels/prefill_layers.c`): the last token's logits [V] bfloat16. Token i sits at logical position
    query_positions[i] with the rotary rows cos[i], sin[i] ([n, d] bfloat16), its key and value go to slot
    filled + i of each layer's keys and values ([H_kv, capacity, d] bfloat16, contiguous), and it sees the slots j
    whose logical position key_positions[j] is at most its own (the mask `kvrag.model.recompute.causal_mask` makes; both
    int64, key_positions [filled + n]). None where it does not take the call (no kernel, another dtype or shape, a
    token outside the vocabulary, a cache of other layers or without room).

    `stitch`: the filled slots' stitch, not yet written (`stitch_plan` over these same layers): each layer's
    written just before its attention, by the same kernel, and `stitch.written` set where the call is taken; where
    it is not, the caller writes it (`stitch.run()`) before anything reads the cache."""
    library = _prefill_library()
    arrays = step._arrays(keys, values) if library is not None else None
    n = len(tokens)
    rows = (n, step.head_dim)
    if (
        arrays is None
        or step.dtype != torch.bfloat16
        or n < 2
        or not all(0 <= t < step.vocab for t in tokens)
        or not 0 <= filled <= keys[0].shape[1] - n
        or any(t.shape != rows or t.dtype != torch.bfloat16 or not t.is_contiguous() for t in (cos, sin))
        or key_positions.shape != (filled + n,)
        or query_positions.shape != (n,)
        or any(t.dtype != torch.int64 or not t.is_contiguous() for t in (key_positions, query_positions))
    ):
        return None
    if stitch is not None and not _stitches_these(stitch, keys, values):
        stitch.run()  # written first, the usual way
        stitch = None
    pieces = stitch.arguments if stitch is not None else (None,) * 7 + (0,)
    rot = stitch.cos.shape[1] if stitch is not None else 0
    logits = torch.empty(step.vocab, dtype=torch.bfloat16)
    status = library.prefill_layers_bf16(
        ctypes.byref(step.model), arrays[0], arrays[1], keys[0].shape[1], filled, (ctypes.c_long * n)(*tokens), n,
        cos.data_ptr(), sin.data_ptr(), key_positions.data_ptr(), query_positions.data_ptr(), logits.data_ptr(),
        *pieces, rot, torch.get_num_threads(),
    )
    if stitch is not None and status == 0:
        stitch.written = True  # where the call was refused part way, the caller writes it all (the same bytes)
    if status == -1:
        raise MemoryError("prefill_layers: no memory for the forward's scratch")
    return logits if status == 0 else None


def _stitches_these(stitch: Stitch, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
    """Whether `stitch` writes into exactly these layers' keys and values ([H_kv, capacity, d] each), a layer at a
    time as the C forward calls it."""
    out_keys, out_values = stitch.out_keys, stitch.out_values
    return (
        out_keys.dtype == torch.bfloat16
        and out_keys.shape[0] == len(keys)
        and out_keys.shape[1:] == keys[0].shape
        and out_values.shape[1:] == values[0].shape
        and out_keys.stride()[1:] == keys[0].stride()
        and out_values.stride()[1:] == values[0].stride()
        and all(out_keys[i].data_ptr() == k.data_ptr() for i, k in enumerate(keys))
        and all(out_values[i].data_ptr() == v.data_ptr() for i, v in enumerate(values))
    )


def prefill_linear_available() -> bool:
    """Whether `prefill_linear` runs here (a CPU with AVX512-BF16 and a compiler that built it)."""
    return _prefill_library() is not None


class _Scratch(threading.local):
    """A thread's buffer for the inputs `prefill_linear` lays out, grown as needed and kept between calls."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.int32)


_scratch = _Scratch()


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for bfloat16 x [..., K] and weight [N, K] on CPU, on the CPU's bfloat16 dot
    products (`kernels/prefill_linear.c`): float32 sums, rounded once. A token's outputs are bitwise the same
    whatever the other tokens, one token alone included (its own product, the outputs across the lanes: a
    prefill's last token through the output head). None where it does not take the call (another dtype or
    device, an odd K, a weight whose rows are not contiguous, no AVX512-BF16 or no compiler)."""
    rows = _token_rows(x, weight, least=1)
    if (
        rows is None
        or weight.dim() != 2
        or weight.shape[1] % 2
        or weight.stride() != (weight.shape[1], 1)
        or (
            bias is not None
            and (bias.shape != (weight.shape[0],) or bias.dtype != torch.bfloat16 or bias.device != x.device)
        )
    ):
        return None
    library = _prefill_library()
    if library is None:
        return None
    M, (N, K) = rows.shape[0], weight.shape
    bias32 = bias.float().contiguous() if bias is not None else None
    out = torch.empty((*x.shape[:-1], N), dtype=torch.bfloat16)
    if M == 1:
        status = library.prefill_linear_one_bf16(
            rows.data_ptr(), K, weight.data_ptr(), N, bias32.data_ptr() if bias32 is not None else None,
            out.data_ptr(), torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"prefill_linear: the kernel refused a shape it was checked to take ({status})")
        return out
    size = library.prefill_linear_scratch(M, K)
    if _scratch.buffer.numel() < size:
        _scratch.buffer = torch.empty(size, dtype=torch.int32)
    status = library.prefill_linear_bf16(
        rows.data_ptr(),
        M,
        K,
        rows.stride(0),
        weight.data_ptr(),
        N,
        bias32.data_ptr() if bias32 is not None else None,
        out.data_ptr(),
        N,
        _scratch.buffer.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"prefill_linear: the kernel refused a shape it was checked to take ({status})")
    return out


_MASK_KINDS = {torch.bool: 1, torch.bfloat16: 2, torch.float32: 3}


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> torch.Tensor | None:
    """Attention of query [B, H, n, D] over key, value [B, H_kv, T, D] (bfloat16, CPU) under a mask [B or 1, 1,
    n, T], boolean (True: attend) or additive (bfloat16 or float32, every value 0 or the lowest), or with none
    (`causal`: token i of n sees keys up to T - n + i; else every key): [B, n, H, D] bfloat16, as transformers'
    attention functions return it. None where the kernel does not take these tensors: another dtype or device,
    an additive mask with other values (found in a pass over the mask, before any attention), a head size that
    is not a multiple of 32 or above 128, more than 8 query heads a kv head, no AVX512-BF16, no compiler.
    Long by design: each refusal checked in turn, then one C call; the checks are what the kernel takes."""
    if (
        query.dim() != 4
        or query.device.type != "cpu"
        or not all(t.dtype == torch.bfloat16 for t in (query, key, value))
        or key.shape != value.shape
        or key.stride() != value.stride()
        or query.shape[0] != key.shape[0]
        or query.shape[-1] != key.shape[-1]
        or any(t.stride(-1) != 1 for t in (query, key))
    ):
        return None
    batch, heads, n, d = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if d % 32 or d > 128 or heads % kv_heads or not 1 <= heads // kv_heads <= 8 or n < 1 or keys < 1:
        return None
    kind = 0
    if mask is not None:
        kind = _MASK_KINDS.get(mask.dtype, -1)
        if (
            kind < 0
            or mask.dim() != 4
            or mask.shape[0] not in (1, batch)
            or mask.shape[1] != 1
            or mask.shape[2:] != (n, keys)
            or mask.stride(-1) != 1
        ):
            return None
    library = _prefill_library()
    if library is None:
        return None
    out = torch.empty(batch, n, heads, d, dtype=torch.bfloat16)
    for b in range(batch):
        rows = mask[b if mask.shape[0] > 1 else 0, 0] if mask is not None else None
        status = library.prefill_attention_bf16(
            query[b].data_ptr(),
            query.stride(1),
            query.stride(2),
            key[b].data_ptr(),
            value[b].data_ptr(),
            key.stride(1),
            key.stride(2),
            rows.data_ptr() if rows is not None else None,
            kind,
            rows.stride(0) if rows is not None else 0,
            int(causal and rows is None),
            out[b].data_ptr(),
            n,
            keys,
            heads,
            kv_heads,
            d,
            scale,
            torch.get_num_threads(),
        )
        if status == -2:
            return None  # an additive mask with a bias in it: the caller's own attention adds it
        if status == -3:
            raise MemoryError(f"prefill_attention: no memory to pack the values of {keys} keys x {kv_heads} kv heads")
        if status:
            raise RuntimeError(f"prefill_attention: the kernel refused a shape it was checked to take ({status})")
    return out
