"""A bfloat16 prefill's gated MLP on CPU with SiLU(gate) * up in one pass (`kvrag.cpu.cbf16.prefill_silu_mul`).

transformers' gated MLP computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: between the projections, SiLU
and the product are two torch operations over the whole [tokens, intermediate] tensors. A model kvrag loads on
CPU with bfloat16 weights has each llama, mistral, qwen2 or qwen3 MLP with SiLU (`TAKEN`) made a subclass of its
own class (`Prefill` before its name, importable from here, so a model saved whole loads again), whose forward
sends two or more bfloat16 tokens' gate and up to the kernel and everything else to the module's own forward.
The kernel rounds where torch rounds; its exp is not torch's, so an output can differ by one bfloat16 step.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.cpu import cbf16
from kvrag.cpu.swap import classes, swap

# The MLPs taken: transformers' classes that copy llama's (each checked word for word when first taken, so a
# transformers release that changes one leaves it as it is).
TAKEN = {
    "LlamaMLP": "transformers.models.llama.modeling_llama",
    "MistralMLP": "transformers.models.mistral.modeling_mistral",
    "Qwen2MLP": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3MLP": "transformers.models.qwen3.modeling_qwen3",
}
SILU = ("SiLU", "SiLUActivation")  # the activations' class names in torch and transformers


def _forward(base: type) -> Any:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.gate_proj.weight.requires_grad):
            return base.forward(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = cbf16.prefill_silu_mul(gate, up)
        return self.down_proj(hidden if hidden is not None else self.act_fn(gate) * up)

    return forward


# `prefill_class(name)`: `Prefill<name>`, the subclass of transformers' MLP `name` whose forward runs the kernel (None
# where `name` is not taken, or its forward is not llama's); `__getattr__`: the classes by name, where an unpickler
# looks them up (a model saved whole loads in a fresh process)
prefill_class, __getattr__ = classes(TAKEN, "LlamaMLP", _forward, __name__)


def use_prefill_mlps(model: torch.nn.Module) -> int:
    """Make the model's taken MLPs (`TAKEN`, SiLU-gated) with bfloat16 weights on CPU their `prefill_class` (hooked
    modules and subclasses are left as they are); how many were. Nothing where the kernel is not built here."""
    mlps = [
        m
        for m in model.modules()
        if TAKEN.get(type(m).__name__) == type(m).__module__
        and type(getattr(m, "act_fn", None)).__name__ in SILU
        and m.gate_proj.weight.device.type == "cpu"
        and m.gate_proj.weight.dtype == torch.bfloat16
        and not (m._forward_hooks or m._forward_pre_hooks)
    ]
    if not mlps or not cbf16.prefill_linear_available():
        return 0
    return swap(mlps, prefill_class)
