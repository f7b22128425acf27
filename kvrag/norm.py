"""A bfloat16 prefill's RMSNorms on CPU in one pass (`kvrag.ckernel.prefill_rms_norm`).

transformers' RMSNorm runs five or six torch operations over a prefill's whole [tokens, dim] tensor, each a pass
through memory with its own dispatch; in a 4k `target_recompute` forward the 61 norms cost about a tenth of what
is left outside the attention and the linear layers (docs/performance.md). A model kvrag loads on CPU with
bfloat16 weights has each norm whose forward is llama's RMSNorm (llama, mistral, qwen2, qwen3 and the models
that copy it) made a subclass of its own class (`Prefill` before its name), whose forward sends two or more
bfloat16 tokens to the kernel and everything else to the module's own forward. The kernel rounds where the
module rounds; its mean sums in another order, so an output can differ from the module's by one bfloat16 step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from kvrag import ckernel


def _forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    out = None
    if not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)):
        out = ckernel.prefill_rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return out if out is not None else super(type(self), self).forward(hidden_states)


@functools.cache
def _llama_forward() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return inspect.getsource(LlamaRMSNorm.forward)


@functools.cache
def _takes(cls: type) -> bool:
    """Whether `cls` is an RMSNorm whose forward is llama's, word for word."""
    try:
        return inspect.getsource(cls.forward) == _llama_forward()
    except (OSError, TypeError):  # no source to read (built in, or made at run time)
        return False


@functools.cache
def prefill_class(cls: type) -> type:
    """The subclass of `cls` whose forward runs the kernel."""
    return type(f"Prefill{cls.__name__}", (cls,), {"forward": _forward, "__module__": __name__})


def is_prefill_norm(module: torch.nn.Module) -> bool:
    """Whether `use_prefill_norms` made this module's class."""
    cls = type(module)
    return cls.__module__ == __name__ and len(cls.__mro__) > 1 and prefill_class(cls.__mro__[1]) is cls


def use_prefill_norms(model: torch.nn.Module) -> int:
    """Make the model's llama-style RMSNorms with bfloat16 weights on CPU `prefill_class(their class)` (hooked
    modules are left as they are); how many were. Nothing where the kernel is not built here."""
    norms = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
        and isinstance(getattr(m, "variance_epsilon", None), float)
        and not (m._forward_hooks or m._forward_pre_hooks)
        and _takes(type(m))
    ]
    if not norms or not ckernel.prefill_linear_available():
        return 0
    for m in norms:
        m.__class__ = prefill_class(type(m))
    return len(norms)
