"""A bfloat16 prefill's linear layers on CPU through kvrag's kernel (`kvrag.cpu.cbf16.prefill_linear`).

torch's bfloat16 matmul runs a prefill's products, a few hundred tokens by a layer's weight, well below what the
CPU's bfloat16 dot-product instruction gives (docs/performance.md, "Five rounds at 4k, and where the forward
goes"). A model kvrag loads on CPU with bfloat16 weights has its plain `nn.Linear` modules made `PrefillLinear`:
the same module (its weight and bias, its state dict, `isinstance(m, nn.Linear)`), whose forward sends a
bfloat16 product on CPU to the kernel and everything else (float32, another device, autograd) to `F.linear`. One
token (a prefill's last token through the output head, a step of a decoder kvrag's C step does not take) runs as
its own product, the weight read once at about the memory's speed: 1.0 ms for the embedded model's output head
against torch's 2.3 (docs/performance.md).

The kernel sums every output in the same order whatever the number of tokens, so a token's outputs are bitwise
the same alone or among others: a chunk's KV encoded at ingest and the same tokens in a full prefill go
through the same sums. Against torch's own bfloat16 product the outputs differ by bfloat16 rounding (the sums
run in another order), as any two matmul libraries differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrag.cpu import cbf16


class PrefillLinear(torch.nn.Linear):
    """`nn.Linear` whose bfloat16 products on CPU run on kvrag's kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's own argument name)
        out = None
        if not (torch.is_grad_enabled() and (input.requires_grad or self.weight.requires_grad)):
            out = cbf16.prefill_linear(input, self.weight, self.bias)
        return out if out is not None else F.linear(input, self.weight, self.bias)


def use_prefill_linears(model: torch.nn.Module) -> int:
    """Make the model's plain bfloat16 `nn.Linear` modules on CPU `PrefillLinear` (subclasses, hooked, quantized
    or adapted ones are left as they are); how many were. Nothing where the kernel is not built here."""
    plain = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16
    ]
    if not plain or not cbf16.prefill_linear_available():
        return 0
    for m in plain:
        m.__class__ = PrefillLinear
    return len(plain)
