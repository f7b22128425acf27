"""Grouped-query attention on CPU without copying the cache: transformers' sdpa, the kv heads passed as they are.

Given a 4-D mask, which every stitched prefill carries, transformers' sdpa copies each layer's cached keys and
values once for every query head of a kv head (`repeat_kv`) before it calls torch's kernel. At 8k cached tokens
that copy is about a quarter of a `reuse` prefill's forward on CPU (497 against 361 ms without it, 2 threads).
torch's CPU kernel takes the kv heads as they are (`enable_gqa=True`), with a mask too, and gives the same
outputs bitwise. kvrag registers that path as an attention implementation of its own through transformers'
AttentionInterface (`kvrag_sdpa`, masks built as sdpa's are) and switches a model loaded with sdpa to it. On other
devices, for one query token, and whenever the call carries
anything but the plain arguments, it is transformers' sdpa unchanged.

In bfloat16 on a CPU with AVX512-BF16, a prefill's attention (more than one query token) goes to
`kvrag.cpu.cbf16.prefill_attention` instead: flash attention on the CPU's bfloat16 dot products, about twice as
fast as torch's CPU flash attention, which runs bfloat16 no faster than float32 (docs/performance.md). Its
outputs are torch's bfloat16 attention's to bfloat16 rounding, not bitwise.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvrag.cpu import cbf16

GQA_SDPA = "kvrag_sdpa"
# Attention modules whose bfloat16 prefill stays on torch's kernel (`use_gqa_sdpa(model, c_attention=False)`), kept
# here by module rather than set on them; they leave the set when they are collected.
_TORCH_PREFILL: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# Arguments the sdpa path reads nothing from (the mask already holds a sliding window); anything else set
# (softcap, sinks, a position bias, ...) goes to transformers' own function.
_PLAIN = frozenset({"sliding_window", "position_ids", "cache_position", "use_cache", "output_attentions", "is_causal"})


def sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, except on CPU: a bfloat16 prefill attends through kvrag's kernel
    (`_bfloat16_prefill`), and a masked grouped-query call copies no kv head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = _bfloat16_prefill(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if out is not None:
        return out, None
    plain = (
        query.device.type == "cpu"
        and attention_mask is not None
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.shape[2] > 1  # one query token: transformers already folds the heads instead of copying
        and not kwargs.get("output_attentions", False)
        and all(k in _PLAIN or v is None for k, v in kwargs.items())
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _bfloat16_prefill(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """A bfloat16 prefill's attention on CPU through `kvrag.cpu.cbf16.prefill_attention` (the CPU's bfloat16 dot
    products, about twice torch's flash attention here); None where it does not take the call. Without a mask
    it is causal as sdpa's is (transformers' own rule, keys cut to the queries' length when there are more)."""
    if (
        query.device.type != "cpu"
        or module in _TORCH_PREFILL
        or query.dtype != torch.bfloat16
        or query.shape[2] < 2  # one query token: the decode path
        or dropout
        or kwargs.get("output_attentions", False)
        or not all(k in _PLAIN or v is None for k, v in kwargs.items())
    ):
        return None
    causal = False
    if attention_mask is None:
        flag = kwargs.get("is_causal")
        causal = bool(flag if flag is not None else getattr(module, "is_causal", True))
        if causal and key.shape[2] > query.shape[2]:
            key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cbf16.prefill_attention(query, key, value, attention_mask, scale, causal)


def use_gqa_sdpa(model: Any, c_attention: bool = True) -> None:
    """Switch a model loaded with sdpa attention to `kvrag_sdpa` (same outputs bitwise); others are left as they are.
    `c_attention=False` keeps a bfloat16 prefill's attention on torch's kernel instead of kvrag's C one."""
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "scaling"):  # an attention module of transformers
            if c_attention:
                _TORCH_PREFILL.discard(module)
            else:
                _TORCH_PREFILL.add(module)
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, sdpa_gqa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
