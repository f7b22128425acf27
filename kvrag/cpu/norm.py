"""A bfloat16 prefill's RMSNorms on CPU in one pass (`kvrag.cpu.cbf16.prefill_rms_norm`).

transformers' RMSNorm runs five or six torch operations over a prefill's whole [tokens, dim] tensor, each a pass
through memory with its own dispatch; in a 4k `target_recompute` forward the 61 norms cost about 10 of the 44 ms
left outside the attention and the linear layers (docs/performance.md). A model kvrag loads on CPU with
bfloat16 weights has each llama, mistral, qwen2 or qwen3 RMSNorm (`TAKEN`) made a subclass of its own class
(`Prefill` before its name, importable from here, so a model saved whole loads again), whose forward sends two
or more bfloat16 tokens to the kernel and everything else to the module's own forward. The kernel rounds where
the module rounds; its mean sums in another order, so an output can differ from the module's by one bfloat16
step.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.cpu import cbf16
from kvrag.cpu.swap import classes, swap

# The norms taken: transformers' classes that copy llama's RMSNorm (each checked word for word when first taken,
# so a transformers release that changes one leaves it as it is).
TAKEN = {
    "LlamaRMSNorm": "transformers.models.llama.modeling_llama",
    "MistralRMSNorm": "transformers.models.mistral.modeling_mistral",
    "Qwen2RMSNorm": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3RMSNorm": "transformers.models.qwen3.modeling_qwen3",
}


def _forward(base: type) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        out = None
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)):
            out = cbf16.prefill_rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return out if out is not None else base.forward(self, hidden_states)

    return forward


# `prefill_class(name)`: `Prefill<name>`, the subclass of transformers' norm `name` whose forward runs the kernel (None
# where `name` is not taken, or its forward is not llama's); `__getattr__`: the classes by name, where an unpickler
# looks them up (a model saved whole loads in a fresh process)
prefill_class, __getattr__ = classes(TAKEN, "LlamaRMSNorm", _forward, __name__)


def is_prefill_norm(module: torch.nn.Module) -> bool:
    """Whether `use_prefill_norms` made this module's class."""
    name = type(module).__name__
    return name.startswith("Prefill") and type(module) is prefill_class(name.removeprefix("Prefill"))


def use_prefill_norms(model: torch.nn.Module) -> int:
    """Make the model's taken norms (`TAKEN`) with bfloat16 weights on CPU their `prefill_class` (hooked modules and
    subclasses are left as they are); how many were. Nothing where the kernel is not built here."""
    norms = [
        m
        for m in model.modules()
        if TAKEN.get(type(m).__name__) == type(m).__module__
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
        and not (m._forward_hooks or m._forward_pre_hooks)
    ]
    if not norms or not cbf16.prefill_linear_available():
        return 0
    return swap(norms, prefill_class)
