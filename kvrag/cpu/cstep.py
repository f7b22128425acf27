"""The decode step in C (`csrc/decode_step.c`): every layer and the head of a llama-family model for one token, or a
token and its prompt-lookup drafts, in one call over a `kvrag.cpu.decode.FastDecoder`'s weights. Built with the
decode kernels (`kvrag.cpu.ckernel`)."""

from __future__ import annotations

import ctypes

import torch

from kvrag.cpu import ckernel
from kvrag.cpu.ckernel import MAX_GROUP, MAX_HEAD_DIM, MAX_TOKENS


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
