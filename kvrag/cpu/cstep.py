"""The decode step in C (`csrc/decode_step.c`): every layer and the head of a llama-family model for one token, a
token and its prompt-lookup drafts, or the next token of several answers decoded side by side, in one call over a
`kvrag.cpu.decode.FastDecoder`'s weights; optionally over int8 copies of the products' weights
or int4 (`csrc/decode_quantized.c`, `DecodeStep.quantize`). Built with the decode kernels (`kvrag.cpu.ckernel`)."""

from __future__ import annotations

import ctypes
import time

import torch

from kvrag.cpu import ckernel
from kvrag.cpu.ckernel import MAX_GROUP, MAX_HEAD_DIM, MAX_TOKENS


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("norm_in", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "norm_post", "gate_up", "down")
    ]


class _Int8Rows(ctypes.Structure):
    _fields_ = [("values", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p)]


class _LayerInt8(ctypes.Structure):
    _fields_ = [(name, _Int8Rows) for name in ("qkv", "o", "gate_up", "down")]


class _StepModel(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in ("layers", "dim", "ffn", "heads", "kv_heads", "head_dim", "vocab")]
    _fields_ += [("bf16", ctypes.c_long), ("eps", ctypes.c_double), ("scale", ctypes.c_double)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("embed", "norm", "lm_head")]
    _fields_ += [("layer", ctypes.POINTER(_LayerWeights)), ("int8_layer", ctypes.POINTER(_LayerInt8))]
    _fields_ += [("int8_head", _Int8Rows), ("int_bits", ctypes.c_long)]


INT8_GROUP = 64  # the columns of a weight row that share one scale (`csrc/decode_quantized.c`), int8 and int4
BITS = (8, 4)  # the quantized weights the C step reads


def int8_rows_torch(
    weight: torch.Tensor, rows_at_once: int = 8192
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [R, C] (C a multiple of INT8_GROUP) as int8 values [R, C], float32 scales [R, C / INT8_GROUP] and
    the offsets the kernel subtracts for its unsigned inputs (128 times the scale times the group's sum of values):
    each group of INT8_GROUP columns of a row divided by its largest magnitude over 127 and rounded to the nearest
    integer (symmetric; a group of zeros has scale 1). Converted a slice of rows at a time (the lm_head of a large
    vocabulary would otherwise take a float32 copy of itself). The reference `int8_rows` is held to, bit for bit."""
    rows, columns = weight.shape
    groups = columns // INT8_GROUP
    values = torch.empty(rows, columns, dtype=torch.int8)
    scales = torch.empty(rows, groups, dtype=torch.float32)
    offsets = torch.empty(rows, groups, dtype=torch.float32)
    for start in range(0, rows, rows_at_once):
        block = weight[start : start + rows_at_once].float().view(-1, groups, INT8_GROUP)
        scale = block.abs().amax(-1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        quantized = (block / scale).round_().clamp_(-127, 127)
        values[start : start + rows_at_once] = quantized.view(-1, columns)
        scales[start : start + rows_at_once] = scale.view(-1, groups)
        offsets[start : start + rows_at_once] = 128.0 * scale.view(-1, groups) * quantized.sum(-1)
    return values, scales, offsets


def int4_rows_torch(
    weight: torch.Tensor, rows_at_once: int = 8192
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [R, C] (C a multiple of 128) as 4-bit values two to a byte [R, C / 2] (uint8; in each 128 columns,
    byte i holds column i in its low half and column 64 + i in its high half), float16 scales and float16 minimums
    [R, C / INT8_GROUP]: each group of INT8_GROUP columns of a row as the nearest of 16 evenly spaced levels from its
    least to its largest weight (w = scale u + minimum, u 0 to 15; a group of one value has scale 1), the levels
    taken from the float16 scale and minimum the kernel reads. The reference `int4_rows` is held to, bit for bit."""
    rows, columns = weight.shape
    groups = columns // INT8_GROUP
    values = torch.empty(rows, columns // 2, dtype=torch.uint8)
    scales = torch.empty(rows, groups, dtype=torch.float16)
    minimums = torch.empty(rows, groups, dtype=torch.float16)
    for start in range(0, rows, rows_at_once):
        block = weight[start : start + rows_at_once].float().view(-1, groups, INT8_GROUP)
        least = block.amin(-1, keepdim=True).half()
        scale = ((block.amax(-1, keepdim=True) - least.float()) / 15.0).half()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        levels = ((block - least.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
        levels = levels.view(-1, columns // 128, 2, 64)  # each 128 columns: the low 64 and the high 64
        values[start : start + rows_at_once] = (levels[:, :, 0] | (levels[:, :, 1] << 4)).view(-1, columns // 2)
        scales[start : start + rows_at_once] = scale.view(-1, groups)
        minimums[start : start + rows_at_once] = least.view(-1, groups)
    return values, scales, minimums


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`int8_rows_torch`'s values, scales and offsets, bit for bit, made in C with the threads where the kernels built
    (`csrc/quantize_weights.c`: one pass over the weights), else by it."""
    made = _quantized_in_c(weight, 8)
    return made if made is not None else int8_rows_torch(weight)


def int4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`int4_rows_torch`'s values, scales and minimums, bit for bit, made in C with the threads where the kernels
    built (`csrc/quantize_weights.c`), else by it."""
    made = _quantized_in_c(weight, 4)
    return made if made is not None else int4_rows_torch(weight)


def _quantized_in_c(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`weight` quantized by the C kernel, or None where it does not take it (no kernels, not a contiguous float32
    or bfloat16 CPU matrix whose columns the groups divide)."""
    library = ckernel._library()
    if (
        library is None
        or weight.dim() != 2
        or weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or weight.shape[1] % (INT8_GROUP if bits == 8 else 2 * INT8_GROUP)
    ):
        return None
    weight = weight.detach().contiguous()
    rows, columns = weight.shape
    groups = columns // INT8_GROUP
    if bits == 8:
        made = (torch.empty(rows, columns, dtype=torch.int8), torch.empty(rows, groups), torch.empty(rows, groups))
        function = library.quantize_int8_rows
    else:
        made = (
            torch.empty(rows, columns // 2, dtype=torch.uint8),
            torch.empty(rows, groups, dtype=torch.float16),
            torch.empty(rows, groups, dtype=torch.float16),
        )
        function = library.quantize_int4_rows
    status = function(
        weight.data_ptr(), int(weight.dtype == torch.bfloat16), rows, columns, *(t.data_ptr() for t in made),
        max(1, torch.get_num_threads()),
    )
    if status != 0:
        raise RuntimeError(f"quantize_int{bits}_rows refused a [{rows}, {columns}] weight (status {status})")
    return made


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
        self._cache: dict[tuple, tuple[ctypes.Array, ctypes.Array] | None] = {}  # cache seen: its arrays
        self._decoder = decoder
        self._quantized: dict[int, tuple[ctypes.Array, list[torch.Tensor], _Int8Rows]] = {}  # bits: made on first use
        self.made_s: dict[int, float] = {}  # bits: the seconds its copies took to make (`kvrag bench-decode` says)

    def quantized_takes(self, bits: int) -> str | None:
        """Why the C step's `bits`-bit products (8 or 4) do not take this model (None where they do): the CPU's
        integer dot products (AVX512-VNNI, or AVX2's byte products), and every product's input width a
        multiple of 64 (int8) or 128 (int4)."""
        if bits not in BITS:
            raise ValueError(f"quantized decoding reads 8- or 4-bit weights, not {bits}")
        widths = {"hidden size": self.model.dim, "heads x head_dim": self.heads * self.head_dim}
        widths["intermediate size"] = self.model.ffn
        multiple = INT8_GROUP if bits == 8 else 2 * INT8_GROUP
        odd = [f"{name} {width}" for name, width in widths.items() if width % multiple]
        if odd:
            return f"{', '.join(odd)} not a multiple of {multiple}"
        available = self._library.int8_available if bits == 8 else self._library.int4_available
        if not available():
            return f"this CPU has neither AVX512-VNNI nor AVX2 (the int{bits} products' integer dot products)"
        return None

    def quantize(self, bits: int | None) -> bool:
        """Read the products' weights (q/k/v, o, gate/up, down, the head) as `bits`-bit groups, 8 or 4, from the
        next step on (quantized here on the first call for those bits: `int8_rows`, `int4_rows`), or with None the
        model's own weights again. True where the step now reads `bits`-bit weights; False where
        `quantized_takes` says why not (the step then reads the model's weights)."""
        if bits is None or self.quantized_takes(bits) is not None:
            self.model.int8_layer, self.model.int_bits = None, 0
            return False
        if bits not in self._quantized:
            started = time.perf_counter()
            self._quantized[bits] = self._made(bits)
            self.made_s[bits] = time.perf_counter() - started
        structs, _, head = self._quantized[bits]
        self.model.int8_layer, self.model.int8_head, self.model.int_bits = structs, head, bits
        return True

    @property
    def reads_bits(self) -> int | None:
        """The bits of the weights the step reads, 8 or 4 (`quantize`), or None: the model's own."""
        return int(self.model.int_bits) if self.model.int8_layer else None

    def quantized_bytes(self, bits: int) -> int:
        """Bytes of the `bits`-bit weights, scales and offsets a step reads (made by `quantize`)."""
        return sum(t.nbytes for t in self._quantized[bits][1])

    def _made(self, bits: int) -> tuple[ctypes.Array, list[torch.Tensor], _Int8Rows]:
        """The products' weights quantized: the C structs and the tensors they point into (kept alive)."""
        kept: list[torch.Tensor] = []
        convert = int8_rows if bits == 8 else int4_rows

        def rows(weight: torch.Tensor) -> _Int8Rows:
            values, scales, offsets = convert(weight)
            kept.extend((values, scales, offsets))
            return _Int8Rows(values.data_ptr(), scales.data_ptr(), offsets.data_ptr())

        structs = (_LayerInt8 * len(self._decoder.layers))()
        for struct, layer in zip(structs, self._decoder.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(struct, name, rows(getattr(layer, name).weight))
        return structs, kept, rows(self._decoder.lm_head.weight)

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
        library = ckernel._library()  # looked up at the call: a test may take the kernels away
        return cls(decoder, library) if library is not None else None

    def takes(self, cos: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Whether the step reads and writes this cache (per layer [H_kv, capacity, d] in the weights' dtype,
        contiguous, one capacity) with these rotary rows. The cache's tensors are checked once: a decode asks at
        every token of the same buffers."""
        if not (cos.dtype == self.dtype and cos.is_contiguous() and cos.shape == (self.head_dim,)):
            return False
        return self._arrays(keys, values) is not None

    def _arrays(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array] | None:
        """The layers' key and value pointers as C arrays, made once a cache (the last MAX_TOKENS caches are kept:
        answers decoded side by side ask for theirs at every step); None where the step does not take its
        tensors."""
        seen = (tuple(t.data_ptr() for t in (*keys, *values)), keys[0].shape, values[-1].shape)
        if seen in self._cache:
            return self._cache[seen]
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
        if len(self._cache) >= MAX_TOKENS:
            del self._cache[next(iter(self._cache))]
        self._cache[seen] = arrays
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
        self._check(tokens, cos, sin)
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

    def rows(
        self,
        tokens: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
        filled: list[int],
    ) -> torch.Tensor:
        """Logits [K, V] float32 of K = len(tokens) tokens of K answers decoded side by side (1 to MAX_TOKENS), in
        one pass over the weights: token j extends caches[j] (its keys and values per layer, which `takes` must
        take) at slot filled[j], with rotary rows cos[j], sin[j] ([K, d]), and attends to that cache's slots
        0..filled[j]. Bit for bit the logits of a step of each token alone. Two tokens on one cache must be at
        consecutive slots (a token and its draft)."""
        count = len(tokens)
        if not 1 <= count <= MAX_TOKENS or len(caches) != count or len(filled) != count:
            raise ValueError(f"decode rows: {count} tokens, {len(caches)} caches, {len(filled)} slots (1 to "
                             f"{MAX_TOKENS} of each, as many of each)")
        self._check(tokens, cos, sin)
        arrays, capacities = [], []
        for (keys, values), slot in zip(caches, filled):
            pointers = self._arrays(keys, values)
            capacity = keys[0].shape[1]
            if pointers is None or not 0 <= slot < capacity:
                raise ValueError(f"decode rows: slot {slot} of a cache of {capacity} this step does not take")
            arrays.append(pointers)
            capacities.append(capacity)
        logits = torch.empty(count, self.vocab, dtype=torch.float32)
        pointer_rows = ctypes.c_void_p * count
        status = self._library.decode_rows(
            ctypes.byref(self.model),
            pointer_rows(*(ctypes.addressof(a[0]) for a in arrays)),
            pointer_rows(*(ctypes.addressof(a[1]) for a in arrays)),
            (ctypes.c_long * count)(*capacities),
            (ctypes.c_long * count)(*tokens),
            count,
            cos.data_ptr(),
            sin.data_ptr(),
            (ctypes.c_long * count)(*filled),
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("decode rows: no memory for the step's scratch")
        return logits

    def _check(self, tokens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> None:
        if not all(0 <= t < self.vocab for t in tokens):
            raise ValueError(f"decode step: tokens {tokens} outside a vocabulary of {self.vocab}")
        rows = (len(tokens), self.head_dim)
        if any(t.shape != rows or t.dtype != self.dtype or not t.is_contiguous() for t in (cos, sin)):
            raise ValueError(
                f"decode step: rotary rows {tuple(cos.shape)}, {tuple(sin.shape)}, not {rows} {self.dtype}"
            )
