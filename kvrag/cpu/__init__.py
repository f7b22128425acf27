"""kvrag's CPU engine: an optional accelerator for llama-family models on CPU, behind this one door.

The core (`kvrag.model`, `kvrag.run`) calls only the functions below; every one of them either takes the work and
returns its result, or declines (None or False) and the caller's torch path runs, giving the same tokens. What is
behind the door (see README.md beside this file): module swaps for a bfloat16 prefill (attention without copying
the kv heads, linear layers, RMSNorms, rotary, the MLP's SiLU(gate) * up), a decode step in C or compiled, the key
rotation and the stitch of a reused cache in one pass, a whole bfloat16 prefill in one C call, and a paged write for
serving engines. The C sources are in `csrc/`, built once per machine (`cbuild`) on first use.

Where torch is faster it steps aside: on a CPU with AMX-BF16 a bfloat16 prefill is left to torch
(`bf16_prefill_kernels_preferred`). Switch it off per model with `install(model, enabled=False)`, which
`KVModel(..., cpu_kernels=False)` and the CLI's `--no-cpu-kernels` call: nothing is swapped, nothing is built,
and every answer runs on transformers' forward.

What the engine keeps for a model (its switches, its fast decoder, the model's lock) is one `ModelState` per model
object (`kvrag.cpu.state`), never an attribute of the model. A runtime takes it with `attach`: the first runtime on
a model object sets the switches, and a later one asking for others is refused, naming them (they belong to the
model, so granting them would change the first one's).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from kvrag.cpu import ckernel, cpaged, state
from kvrag.cpu import decode as _decode
from kvrag.cpu import prefill as _prefill
from kvrag.cpu.attention import GQA_SDPA, use_gqa_sdpa
from kvrag.cpu.ckernel import MAX_TOKENS, Stitch
from kvrag.cpu.room import Room
from kvrag.cpu.linear import use_prefill_linears
from kvrag.cpu.mlp import use_prefill_mlps
from kvrag.cpu.norm import use_prefill_norms
from kvrag.cpu.rotary import use_prefill_rotary
from kvrag.cpu.state import ModelState

__all__ = [
    "GQA_SDPA",
    "MAX_TOKENS",
    "ModelState",
    "Room",
    "Stitch",
    "attach",
    "available",
    "bf16_prefill_kernels_preferred",
    "compile_decoding",
    "decode_room",
    "decode_weights",
    "decoder_of",
    "enabled",
    "install",
    "native_bfloat16",
    "paged_write",
    "prefill_forward",
    "prefill_may_take",
    "rotate_keys",
    "state_of",
    "stitch_plan",
    "weights_read",
]


def state_of(model: Any) -> ModelState:
    """What the engine keeps for `model` (`kvrag.cpu.state.ModelState`): its switches, its decoder, its lock."""
    return state.of(model)


def attach(
    model: Any, *, cpu_kernels: bool = True, compile_decode: bool = False, decode_weights: str = "model"
) -> ModelState:
    """`model`'s state for a runtime built with these arguments (`kvrag.model.runtime.ModelRuntime`'s).

    The first runtime on a model object sets them: the engine's modules installed or not (`install`), the compiled
    step asked for or not, the weights the C step reads (quantized at its first decoded token, or at once by
    `decode_weights`). A later runtime on the same object shares the state, its lock included, and must ask for
    what the model has now: asking for other settings raises InvalidRequestError naming them, since changing them
    would change every other runtime's on the model (give it its own copy of the model instead).

    Raises:
        ValueError: `decode_weights` is not one of "model", "int8", "int4".
        InvalidRequestError: another runtime uses the model with other settings.
    """
    _decode.weights_kind(decode_weights)
    held = state.of(model)
    with held.lock:
        if held.claimed:
            held.check(cpu_kernels=cpu_kernels, compile_decode=compile_decode, decode_weights=decode_weights)
            return held
        install(model, enabled=cpu_kernels)
        held.compile_decode, held.decode_weights = compile_decode, decode_weights
        held.claimed = True
    return held


def install(model: Any, enabled: bool = True) -> bool:
    """Put the CPU engine's modules into `model` (each swap is a no-op where it does not apply: another device,
    dtype or architecture), or with `enabled=False` keep the model as transformers made it and have every function
    here decline for it. Call once, before the model's first forward. True where the engine is on for `model`."""
    state.of(model).kernels = bool(enabled)
    if enabled:
        c_prefill = bf16_prefill_kernels_preferred()
        use_gqa_sdpa(model, c_attention=c_prefill)  # sdpa without copying kv heads on CPU, bitwise the same
        if c_prefill:
            use_prefill_linears(model)  # bfloat16 prefills' linear layers on the CPU's dot products
            use_prefill_norms(model)  # and their RMSNorms in one pass
            use_prefill_rotary(model)  # and their rotary embeddings, bitwise the same
            use_prefill_mlps(model)  # and their MLPs' SiLU(gate) * up in one pass
    return bool(enabled)


@functools.cache
def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags (/proc/cpuinfo's `flags`, or `Features` on Arm), or None where they cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    line = next((x for x in lines if x.startswith(("flags", "Features"))), None)
    return None if line is None else set(line.partition(":")[2].split())


@functools.cache
def bf16_prefill_kernels_preferred() -> bool:
    """Whether a bfloat16 prefill runs faster in kvrag's C kernels (the AVX512-BF16 dot product) than in torch's.
    Not on a CPU with AMX-BF16: torch's bfloat16 matrix products run on its matrix unit there (oneDNN), several times
    faster than the kernels (the measurements: docs/performance.md). There the prefill is left to torch; the decode
    step and the rotation stay kvrag's."""
    flags = _cpu_flags()
    return flags is None or "amx_bf16" not in flags


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16, AMX-BF16, or Arm's BF16), so that a model
    computes in bfloat16 at least as fast as in float32. Where it does not (a CPU with AVX2 alone), torch's bfloat16
    matrix products run several times slower than its float32 ones (docs/performance.md, "A CPU without bfloat16"):
    a named model converted to bfloat16 then computes in float32 (`ModelRuntime.from_pretrained`, dtype "auto").
    True where the flags cannot be read (the model computes in the dtype it was converted to)."""
    flags = _cpu_flags()
    return flags is None or bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def enabled(model: Any) -> bool:
    """Whether the CPU engine may take `model`'s work (True unless `install(model, enabled=False)` said so)."""
    return state.of(model).kernels


def available() -> bool:
    """Whether the C kernels built and loaded on this machine (a C compiler, Linux)."""
    return ckernel.available()


def compile_decoding(model: torch.nn.Module) -> bool:
    """Decode `model` through the compiled step from its next decoded token on (`decode.compile_decoding`); False
    where it is not taken."""
    return enabled(model) and _decode.compile_decoding(model)


def decode_weights(model: torch.nn.Module, kind: str = "model") -> bool:
    """Decode `model` over its own weights ("model") or quantized copies ("int8", "int4") from its next decoded token
    on (`decode.decode_weights`); False where the C step does not take them (the model's own weights decode)."""
    return enabled(model) and _decode.decode_weights(model, kind)


def weights_read(model: torch.nn.Module) -> str:
    """What decoding `model` reads now: "int8" or "int4" copies through the C step, else "model" (its own weights)."""
    return _decode.weights_read(model) if enabled(model) else "model"


def decoder_of(model: torch.nn.Module) -> _decode.FastDecoder | None:
    """The model's fast decode step, or None where the engine does not take the model (transformers decodes)."""
    return _decode.decoder_of(model) if enabled(model) else None


def decode_room(model: torch.nn.Module, tokens: int) -> int:
    """Free cache slots to keep after a prompt for `tokens` decoded ones (more where the compiled step reads whole
    blocks)."""
    return _decode.decode_room(model, tokens) if enabled(model) else tokens


def rotate_keys(
    model: Any, out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """Rotate `keys` into `out` in one pass in C; False where it declines (the caller rotates with torch).
    `model` may be None (a serving engine's worker that holds only the rotary module)."""
    return (model is None or enabled(model)) and ckernel.rotate_keys(out, keys, cos, sin)


def stitch_plan(model: Any, keys: torch.Tensor, values: torch.Tensor, parts: list, cos: torch.Tensor,
                sin: torch.Tensor) -> Stitch | None:
    """A stitch of the prefix and the kept pieces, prepared (not run); None where it declines."""
    if model is not None and not enabled(model):
        return None
    return ckernel.stitch_plan(keys, values, parts, cos, sin)


def prefill_may_take(model: Any, cache: torch.Tensor) -> bool:
    """Whether a forward over a cache like `cache` may run in one C call for `model`."""
    return enabled(model) and _prefill.may_take(cache)


def prefill_forward(model: torch.nn.Module, *args: Any) -> torch.Tensor | None:
    """A whole prefill's forward in one C call (`prefill.forward`); None where it declines."""
    return _prefill.forward(model, *args) if enabled(model) else None


def paged_write(*args: Any, **kwargs: Any) -> bool:
    """Write stored pieces into a serving engine's paged blocks in one pass (`cpaged.paged_write`); False where the
    kernel is missing (the caller writes with its own op)."""
    return cpaged.paged_write(*args, **kwargs)
