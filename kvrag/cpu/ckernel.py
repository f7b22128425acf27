"""Small C kernels for CPU hot paths, built here on first use: a whole decode step (`kernels/decode_step.c`,
`DecodeStep`), its attention (`kernels/decode_attention.c`, which the torch step calls too) and the rotation
that re-positions stored keys (`kernels/rotate_keys.c`), and the streaming read `kvrag.lab.roofline` calibrates the
memory's read rate with (`kernels/stream_read.c`).

The decode step runs every layer and the head of a llama-family model for one token in one call: its
vector-matrix products read each weight row in order, which lets the cores stream the weights near the memory
bandwidth, and nothing runs in Python between the layers (`kvrag.cpu.decode` says when it is used). The same
call takes up to MAX_TOKENS consecutive tokens (a token and its prompt-lookup drafts): each weight row and each
block of cached keys and values is read once for all of them, and each token's sums run as they would alone,
so its logits are its single step's, bit for bit.

torch runs one token's grouped-query attention over a long cache at a third to a quarter of what a core can
read: its products for so few query rows, and its softmax, are not made for that shape. The kernel reads each
key and value once, in 16-lane float32 vectors, and splits the cache into blocks across the threads
(flash-decoding). It is compiled once per machine with the system's C compiler (`cc`, or `$CC`), for this
CPU (`-march=native`), into kvrag's cache folder, and loaded with ctypes; it links the OpenMP runtime torch
already loaded, so its threads are torch's. Where there is no compiler, or the build or the load fails,
`available()` is False and the decode step keeps torch's attention (the same tokens, slower).

The rotation reads each stored key once and writes it once into its slot of the stitched cache (torch's
elementwise passes read and write it three times); where the kernel is missing, re-positioning stays on torch.
A stitch (`stitch_plan`, then `Stitch.run`) writes the prefix and every chunk, keys rotated and values copied,
in one call with streaming stores; the whole bfloat16 forward in C (`prefill_layers`) takes it instead and writes
each layer's just before that layer's attention.

A bfloat16 prefill's attention (`kernels/prefill_attention.c`, `prefill_attention`), its linear layers
(`kernels/prefill_linear.c`, `prefill_linear`, which `kvrag.cpu.linear` calls) and its RMSNorms
(`kernels/prefill_norm.c`, `prefill_rms_norm`, which `kvrag.cpu.norm` calls) are built apart, on CPUs with
AVX512-BF16, at the first bfloat16 model or prefill that needs them.

The paged write (`kernels/paged_write.c`, `paged_write`, built apart: it needs the compiler's _Float16) puts a
stored piece's keys and values into a serving engine's paged blocks in one pass, converted to the cache's dtype
and the keys rotated on the way; vLLM's connector uses it where it writes what vLLM's own op writes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in ("decode_attention.c", "rotate_keys.c", "decode_step.c", "stream_read.c")
)
# built apart, at a bfloat16 prefill's first attention or linear layer: its build takes seconds, and float32 models
# never need it
PREFILL_SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "prefill_attention.c", "prefill_linear.c", "prefill_norm.c", "prefill_rotary.c", "prefill_silu.c",
        "prefill_layers.c", "rotate_keys.c",  # the last for the stitch the whole forward runs a layer at a time
    )
)
BLOCK = 256  # the kernel's block of cache slots
MAX_TOKENS = 8  # tokens one call of the C decode step takes (`DecodeStep.steps`)
MAX_GROUP, MAX_HEAD_DIM = 8, 256
# Compiled with -ffast-math (the vector exp, reassociated sums) but linked without it: linked in, it would add
# a constructor that flushes subnormal floats to zero for the whole process.
COMPILE = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-c")
LINK = ("-shared", "-fopenmp")
_FUNCTIONS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_ROTATIONS = {torch.float32: "rotate_keys_f32", torch.bfloat16: "rotate_keys_bf16"}
_STITCHES = {torch.float32: "stitch_f32", torch.bfloat16: "stitch_bf16"}


def _cpu_id() -> str:
    """What the build depends on besides the source: the CPU's model and flags (-march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n".join(lines)


def _build(name: str, sources: tuple[Path, ...]) -> ctypes.CDLL | None:
    """The shared library of `sources`, built once per machine (source, flags and CPU) into kvrag's cache folder
    and loaded; None where there is no compiler that works."""
    compiler = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not compiler or not all(s.exists() for s in sources) or platform.system() != "Linux":
        return None
    headers = sorted(sources[0].parent.glob("*.h"))  # what the sources include
    source = b"".join(s.read_bytes() for s in (*sources, *headers))
    digest = hashlib.sha256(source + " ".join(COMPILE + LINK).encode() + _cpu_id().encode()).hexdigest()[:16]
    from kvrag.model.catalog import default_cache_dir

    target = default_cache_dir() / "kernels" / f"{name}-{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # built apart, renamed: concurrent builds
                built = Path(scratch) / target.name
                objects = [str(Path(scratch) / s.with_suffix(".o").name) for s in sources]
                for source_file, obj in zip(sources, objects):
                    subprocess.run(
                        [*compiler, *COMPILE, str(source_file), "-o", obj], check=True, capture_output=True, timeout=300
                    )
                subprocess.run(
                    [*compiler, *LINK, *objects, "-o", str(built), "-lm"], check=True, capture_output=True, timeout=120
                )
                os.replace(built, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):  # no compiler that works, a cache folder not writable, noexec
        return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = _build("kvrag-kernels", SOURCES)
    if library is None:
        return None
    pointer = ctypes.c_void_p
    for name in _FUNCTIONS.values():
        function = getattr(library, name)
        function.argtypes = [pointer, pointer, pointer, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        function.argtypes += [ctypes.c_long, pointer, pointer, ctypes.c_int]
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
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of one token's query heads q [H, d] (float32, scaled) over slots 0..n-1 of keys and values
    [H_kv, capacity, d] (contiguous, float32 or bfloat16; `supports` says which): [H, d] float32.

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
    return decode_attention(q.float() * scale, keys, values, n + 1)


@_decode_attention_op.register_fake
def _(q, k, v, keys, values, slot, scale):  # type: ignore[no-untyped-def]
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("norm_in", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "norm_post", "gate_up", "down")
    ]


class _StepModel(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in ("layers", "dim", "ffn", "heads", "kv_heads", "head_dim", "vocab")]
    _fields_ += [("bf16", ctypes.c_long), ("eps", ctypes.c_double), ("scale", ctypes.c_double)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("embed", "norm", "lm_head")]
    _fields_ += [("layer", ctypes.POINTER(_LayerWeights))]


class DecodeStep:
    """A whole decode step in C (`kernels/decode_step.c`) over a `kvrag.cpu.decode.FastDecoder`'s weights: one
    call a token, no Python between the layers. `of` says whether it takes the decoder; `takes` whether it takes
    a cache."""

    def __init__(self, decoder, library: ctypes.CDLL) -> None:  # type: ignore[no-untyped-def]
        self._library = library
        layers = decoder.layers
        self.dtype = decoder.embed.dtype
        self.vocab = decoder.lm_head.weight.shape[0]
        self.heads, self.kv_heads, self.head_dim = decoder.heads, decoder.kv_heads, decoder.head_dim
        self._weights = [decoder.embed, decoder.norm, decoder.lm_head.weight]  # kept alive while C reads them
        structs = (_LayerWeights * len(layers))()
        for struct, layer in zip(structs, layers):
            for name, tensor in (
                ("norm_in", layer.norm_in),
                ("qkv", layer.qkv.weight),
                ("qkv_bias", layer.qkv.bias),
                ("q_norm", layer.q_norm),
                ("k_norm", layer.k_norm),
                ("o", layer.o.weight),
                ("norm_post", layer.norm_post),
                ("gate_up", layer.gate_up.weight),
                ("down", layer.down.weight),
            ):
                setattr(struct, name, tensor.data_ptr() if tensor is not None else None)
                self._weights.append(tensor)
        first = layers[0]
        self._layers = structs
        self.model = _StepModel(
            layers=len(layers),
            dim=decoder.embed.shape[1],
            ffn=first.down.weight.shape[1],
            heads=decoder.heads,
            kv_heads=decoder.kv_heads,
            head_dim=decoder.head_dim,
            vocab=self.vocab,
            bf16=int(self.dtype == torch.bfloat16),
            eps=decoder.eps,
            scale=decoder.scale,
            embed=decoder.embed.data_ptr(),
            norm=decoder.norm.data_ptr(),
            lm_head=decoder.lm_head.weight.data_ptr(),
            layer=structs,
        )
        self._cache: tuple[tuple, tuple[ctypes.Array, ctypes.Array] | None] | None = None  # (cache seen, arrays)

    @classmethod
    def of(cls, decoder) -> DecodeStep | None:  # type: ignore[no-untyped-def]
        """The C step over the decoder's weights, or None where it does not take them (no kernel library, a
        dtype other than float32 and bfloat16, weights not contiguous in CPU memory, a head shape the attention
        kernel does not take)."""
        tensors = [decoder.embed, decoder.norm, decoder.lm_head.weight]
        for layer in decoder.layers:
            tensors += [layer.norm_in, layer.qkv.weight, layer.o.weight, layer.norm_post]
            tensors += [layer.gate_up.weight, layer.down.weight]
            tensors += [t for t in (layer.qkv.bias, layer.q_norm, layer.k_norm) if t is not None]
        dtype = decoder.embed.dtype
        if (
            dtype not in (torch.float32, torch.bfloat16)
            or any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or decoder.head_dim % 16
            or decoder.head_dim > MAX_HEAD_DIM
            or decoder.heads % decoder.kv_heads
            or not 1 <= decoder.heads // decoder.kv_heads <= MAX_GROUP
        ):
            return None
        library = _library()
        return cls(decoder, library) if library is not None else None

    def takes(self, cos: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Whether the step reads and writes this cache (per layer [H_kv, capacity, d] in the weights' dtype,
        contiguous, one capacity) with these rotary rows. The cache's tensors are checked once: a decode asks at
        every token of the same buffers."""
        if not (cos.dtype == self.dtype and cos.is_contiguous() and cos.shape == (self.head_dim,)):
            return False
        return self._arrays(keys, values) is not None

    def _arrays(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array] | None:
        """The layers' key and value pointers as C arrays, made once a cache; None where the step does not take
        its tensors."""
        seen = (tuple(t.data_ptr() for t in (*keys, *values)), keys[0].shape, values[-1].shape)
        cache = self._cache
        if cache is not None and cache[0] == seen:
            return cache[1]
        capacity = keys[0].shape[1]
        ok = len(keys) == len(values) == self.model.layers and all(
            t.dtype == self.dtype
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.shape == (self.kv_heads, capacity, self.head_dim)
            for t in (*keys, *values)
        )
        count = len(keys)
        pointers = seen[0]
        arrays = (
            ((ctypes.c_void_p * count)(*pointers[:count]), (ctypes.c_void_p * count)(*pointers[count:])) if ok else None
        )
        self._cache = (seen, arrays)
        return arrays

    def __call__(
        self,
        token: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        filled: int,
    ) -> torch.Tensor:
        """Logits [V] float32 for `token`, as `FastDecoder.step` (`takes` must hold)."""
        return self.steps([token], cos[None], sin[None], keys, values, filled)[0]

    def steps(
        self,
        tokens: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        filled: int,
    ) -> torch.Tensor:
        """Logits [K, V] float32 of K = len(tokens) consecutive tokens (1 to MAX_TOKENS) in one pass over the
        weights: token j at slot `filled + j`, with rotary rows cos[j], sin[j] ([K, d]), attending to slots
        0..filled + j. Bit for bit the logits of K calls of one token each (`takes` must hold for cos[0])."""
        capacity, count = keys[0].shape[1], len(tokens)
        if not 1 <= count <= MAX_TOKENS or not 0 <= filled <= capacity - count:
            raise ValueError(
                f"decode step: {count} tokens from slot {filled} of {capacity} (1 to {MAX_TOKENS} tokens)"
            )
        if not all(0 <= t < self.vocab for t in tokens):
            raise ValueError(f"decode step: tokens {tokens} outside a vocabulary of {self.vocab}")
        rows = (count, self.head_dim)
        if any(t.shape != rows or t.dtype != self.dtype or not t.is_contiguous() for t in (cos, sin)):
            raise ValueError(
                f"decode step: rotary rows {tuple(cos.shape)}, {tuple(sin.shape)}, not {rows} {self.dtype}"
            )
        arrays = self._arrays(keys, values)
        if arrays is None:
            raise ValueError("decode step: a cache this step does not take (check `takes` first)")
        logits = torch.empty(count, self.vocab, dtype=torch.float32)
        status = self._library.decode_steps(
            ctypes.byref(self.model),
            arrays[0],
            arrays[1],
            capacity,
            (ctypes.c_long * count)(*tokens),
            count,
            cos.data_ptr(),
            sin.data_ptr(),
            filled,
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("decode step: no memory for the step's scratch")
        return logits


@functools.cache
def _prefill_library() -> ctypes.CDLL | None:
    """The bfloat16 prefill attention, where the CPU has AVX512-BF16 (else None)."""
    library = _build("kvrag-prefill", PREFILL_SOURCES)
    if library is None or not library.prefill_attention_available():
        return None
    pointer, long, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.prefill_attention_bf16.argtypes = [pointer, long, long, pointer, pointer, long, long, pointer, int_, long, int_]
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
    whose logical position key_positions[j] is at most its own (the mask `kvrag.run.recompute.causal_mask` makes; both
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
        and all(out_keys[l].data_ptr() == k.data_ptr() for l, k in enumerate(keys))
        and all(out_values[l].data_ptr() == v.data_ptr() for l, v in enumerate(values))
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
    is not a multiple of 32 or above 128, more than 8 query heads a kv head, no AVX512-BF16, no compiler."""
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


PAGED_SOURCES = (Path(__file__).with_name("csrc") / "paged_write.c",)
_PAGED_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@functools.cache
def _paged_library() -> ctypes.CDLL | None:
    """The paged-cache write, built apart: it needs the compiler's _Float16 (else None, and callers keep their own
    path)."""
    library = _build("kvrag-paged", PAGED_SOURCES)
    if library is None:
        return None
    pointer, long, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    for source in _PAGED_TYPES.values():
        for cache in _PAGED_TYPES.values():
            function = getattr(library, f"paged_write_{source}_{cache}")
            function.argtypes = [pointer, pointer, long, long, int_, int_, long, int_, int_, pointer, pointer]
            function.argtypes += [pointer, pointer, pointer, long, long, int_, int_, int_]
            function.restype = ctypes.c_int
    return library


def paged_write(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    slots: torch.Tensor,
    *,
    keys_transposed: bool,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    threads: int | None = None,
) -> bool:
    """Write a piece's keys and values [L, H_kv, T, D] (float32, float16 or bfloat16, CPU; a slice of an entry along
    T is fine) into L layers' paged caches at `slots` [T] (int64: block * block_size + offset), converted to the
    caches' dtype, keys rotated by one shift on the way (cos, sin: [D_rot] float32; None: no rotation, in float32
    as `rotate_keys`). Each layer's caches are [blocks, H_kv, block_size, D] views: values one row a slot, keys the
    same or, `keys_transposed`, D rows of block_size slots a head (vLLM's CPU layout); every layer's alike in shape,
    dtype and strides. False, having written nothing, where the kernel does not take these tensors."""
    if len(key_caches) != len(value_caches) or not key_caches or keys.dim() != 4 or keys.shape != values.shape:
        return False
    layers, heads, tokens, d = keys.shape
    first = key_caches[0]
    rot = cos.shape[-1] if cos is not None else 0
    caches = [*key_caches, *value_caches]
    if (
        keys.device.type != "cpu"
        or keys.dtype not in _PAGED_TYPES
        or values.dtype != keys.dtype
        or keys.stride() != values.stride()
        or keys.stride(3) != 1
        or keys.stride(2) != d
        or len(key_caches) != layers
        or first.dtype not in _PAGED_TYPES
        or first.dim() != 4
        or first.shape[1] != heads
        or first.shape[3] != d
        or any(c.dtype != first.dtype or c.shape != first.shape or c.stride() != first.stride() for c in caches)
        or first.stride(3) != 1
        or first.stride(2) != d
        or slots.dtype != torch.int64
        or slots.shape != (tokens,)
        or not slots.is_contiguous()
        or (cos is None) != (sin is None)
    ):
        return False
    if cos is not None and (
        cos.dim() != 1
        or sin.shape != cos.shape  # type: ignore[union-attr]
        or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))  # type: ignore[union-attr]
        or not 0 < rot <= d
        or rot % 2
    ):
        return False
    if tokens and not 0 <= int(slots.min()) <= int(slots.max()) < first.shape[0] * first.shape[2]:
        raise IndexError(f"paged_write: slots outside the cache's {first.shape[0]} blocks of {first.shape[2]}")
    library = _paged_library()
    if library is None:
        return False
    if not tokens:
        return True
    array = ctypes.c_void_p * layers
    key_pointers = array(*(c.data_ptr() for c in key_caches))
    value_pointers = array(*(c.data_ptr() for c in value_caches))
    function = getattr(library, f"paged_write_{_PAGED_TYPES[keys.dtype]}_{_PAGED_TYPES[first.dtype]}")
    status = function(
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        layers,
        heads,
        tokens,
        d,
        rot,
        cos.data_ptr() if cos is not None else None,
        sin.data_ptr() if sin is not None else None,
        key_pointers,
        value_pointers,
        slots.data_ptr(),
        first.stride(0),
        first.stride(1),
        first.shape[2],
        int(keys_transposed),
        threads if threads is not None else torch.get_num_threads(),
    )
    return status == 0
