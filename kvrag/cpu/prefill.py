"""A bfloat16 prefill's whole forward in one C call on CPU (`kernels/prefill_layers.c`), where the model's own
forward would run kvrag's kernels module by module.

A model kvrag loads on CPU with bfloat16 weights already runs its prefill's norms, products, rotations, attention
and SiLU in kvrag's C kernels (`kvrag.cpu.linear`, `kvrag.cpu.norm`, `kvrag.cpu.rotary`, `kvrag.cpu.attention`,
`kvrag.cpu.mlp`);
what is left around them is transformers' forward in Python, about a dozen module calls a layer and torch's
small operations (the residual sums, the cache's write), while the second core waits. `forward` runs the same
kernels in the same order from C over the decoder's weights (`kvrag.cpu.decode`: q, k and v stacked in one
product, gate and up in another), so its logits and the cache it writes are the model forward's, bit for bit
(tested on llama, mistral, qwen2 and qwen3). It takes the call only where that holds: a llama, mistral, qwen2 or
qwen3 model whose every module is the one kvrag made (any other, or a hook anywhere, and the model's forward
runs), one prompt of two or more tokens, a cache with room for them, the last token's logits. It takes the tokens'
logical positions where the model's forward takes kvrag's 4-D mask (`kvrag.model.recompute.causal_mask`, made from
the same positions): which keys each token sees is worked out once, in C, for every layer.
"""

from __future__ import annotations

import torch

from kvrag.cpu import attention, cbf16, ckernel, cstep, mlp, norm, rotary
from kvrag.cpu import decode as fastdecode
from kvrag.cpu.linear import PrefillLinear

# The decoder layers taken, by class name: those whose forward is llama's (norm, attention, residual, norm, MLP,
# residual), qwen3's with its q/k norms over each head.
TAKEN = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def forward(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    filled: int,
    input_ids: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    stitch: ckernel.Stitch | None = None,
) -> torch.Tensor | None:
    """The last token's logits [1, V] float32 of the model's forward over `input_ids` ([1, n]) at the logical
    positions `query_positions` ([n]), each token seeing the keys whose logical position (`key_positions`,
    [filled + n]) is at most its own (`kvrag.model.recompute.causal_mask`), with a cache whose layers' keys and values are
    `keys[l]`, `values[l]` ([H_kv, capacity, d], the first `filled` slots filled), the tokens' keys and values
    written into slots filled.. as that forward writes them; None where this path does not take the call (then the
    caller runs the model's forward; the filled slots are as they were, the room past them may have been written).

    `stitch`: the filled slots' stitch, not yet written (`kvrag.model.recompute.stitch_cache(deferred=True)`): the C call
    writes each layer's just before its attention (`cbf16.prefill_layers`); where it is not taken the caller
    writes it (`stitch.written` is False)."""
    taken = _step(model)
    if taken is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or query_positions.shape != input_ids.shape[1:]:
        return None  # one prompt; the rest is the C call's to check
    decoder, step = taken
    probe = decoder.embed[:1][None]  # the rotary module reads only its dtype and device
    cos, sin = model.model.rotary_emb(probe, query_positions.view(1, -1))  # the model's own rows, scaling included
    logits = cbf16.prefill_layers(
        step, input_ids[0].tolist(), cos[0].contiguous(), sin[0].contiguous(), key_positions.contiguous(),
        query_positions.contiguous(), keys, values, filled, stitch,
    )
    return logits.float()[None] if logits is not None else None


def may_take(cache: torch.Tensor) -> bool:
    """Whether a forward over a cache like `cache` may run here in C (bfloat16 on a CPU with the kernel; the model
    is checked at the call)."""
    return cache.dtype == torch.bfloat16 and cache.device.type == "cpu" and cbf16.prefill_layers_available()


def _step(model: torch.nn.Module) -> tuple[fastdecode.FastDecoder, cstep.DecodeStep] | None:
    """The model's decoder and its C step's weights where this path takes the model as it is now; else None."""
    first = next(model.parameters(), None)
    if (
        first is None
        or first.dtype != torch.bfloat16
        or first.device.type != "cpu"
        or torch.is_grad_enabled()
        or getattr(model.config, "_attn_implementation", None) != attention.GQA_SDPA
        or not cbf16.prefill_layers_available()
    ):
        return None
    decoder = fastdecode.decoder_of(model)
    step = decoder.native if decoder is not None else None
    if decoder is None or step is None or step.dtype != torch.bfloat16 or not _kernels_throughout(model, decoder):
        return None
    return decoder, step


def _kernels_throughout(model: torch.nn.Module, decoder: fastdecode.FastDecoder) -> bool:
    """Whether the model's forward would run kvrag's kernels everywhere this path runs them, and nothing else: every
    module the one kvrag made, no hook anywhere. The modules' classes, in one walk over the model, are checked
    against the last classes that passed (kept on the decoder): the walk and the hooks at every prefill, the
    classes one by one only when they changed."""
    from torch.nn.modules import module as torch_module

    if any(
        hooks
        for hooks in (
            torch_module._global_forward_hooks,
            torch_module._global_forward_pre_hooks,
            torch_module._global_backward_hooks,
            torch_module._global_backward_pre_hooks,
        )
    ):
        return False
    classes, stack = [], [model]
    while stack:  # every module, as `modules()` walks them, without its generators
        m = stack.pop()
        if m._forward_hooks or m._forward_pre_hooks:
            return False
        classes.append(type(m))
        stack.extend(child for child in m._modules.values() if child is not None)
    if tuple(classes) != decoder.prefill_classes:
        if not _kvrag_modules(model):
            return False
        decoder.prefill_classes = tuple(classes)
    for layer in model.model.layers:  # the rotary handles are no modules: checked each time
        handle = layer.self_attn.__dict__.get("_kernel_funcs", {}).get(rotary.HOOK)
        if getattr(getattr(handle, "forward", None), "__func__", None) is not rotary.prefill_forward:
            return False
    return True


def _kvrag_modules(model: torch.nn.Module) -> bool:
    """Whether every module of the forward is the one kvrag made (its class): the decoder layers taken, kvrag's
    norms, MLPs and linears."""
    inner = model.model
    if not (norm.is_prefill_norm(inner.norm) and type(model.lm_head) is PrefillLinear):
        return False
    for layer in inner.layers:
        attn, block = layer.self_attn, layer.mlp
        if not (
            type(layer).__name__ in TAKEN
            and norm.is_prefill_norm(layer.input_layernorm)
            and norm.is_prefill_norm(layer.post_attention_layernorm)
            and type(block) is mlp.prefill_class(type(block).__name__.removeprefix("Prefill"))
            and all(type(getattr(attn, name, None)) is PrefillLinear for name in ATTENTION_LINEARS)
            and all(type(getattr(block, name, None)) is PrefillLinear for name in MLP_LINEARS)
            and all(
                norm.is_prefill_norm(getattr(attn, name)) for name in ("q_norm", "k_norm") if hasattr(attn, name)
            )
        ):
            return False
    return True
