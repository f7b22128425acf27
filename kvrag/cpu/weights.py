"""A decoder's weights as the decode steps read them: q, k and v stacked into one product, gate and up into another,
each group one buffer (on huge pages where the system has them) that the model's own modules then view, so there
is no second copy; and `Product`, the torch step's vector-matrix product split by output rows, one part a thread."""

from __future__ import annotations

from typing import Any

import torch

from kvrag.cpu import hugepages


class Product:
    """x [in] times a weight [out, in], split by output rows into `parts` batched products (one a thread).

    The parts are views of the weight, so nothing is copied, and each output is the same dot product as
    `F.linear`'s.
    """

    __slots__ = ("weight", "bias", "parts", "split")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> None:
        self.weight, self.bias = weight, bias
        self.resplit(parts)

    def resplit(self, parts: int) -> None:
        """Split into `parts` (one part when `parts` does not divide the rows)."""
        out, inner = self.weight.shape
        self.parts = parts if out % parts == 0 else 1
        self.split = self.weight.view(self.parts, out // self.parts, inner).transpose(1, 2)  # [P, in, out / P]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.expand(self.parts, 1, x.shape[-1])
        if self.bias is None:
            return torch.bmm(x, self.split).view(self.weight.shape[0])
        # the bias inside the product, as F.linear adds it (after the sum, before rounding in low precision)
        return torch.baddbmm(self.bias.view(self.parts, 1, -1), x, self.split).view(self.weight.shape[0])


def layer_projections(layer: torch.nn.Module) -> tuple[tuple[Any, ...], Any, tuple[Any, ...], Any]:
    """A decoder layer's (q, k and v), o, (gate and up) and down linears: separate modules in llama, mistral and
    qwen, one stacked module each for q/k/v and gate/up in phi3 (the same products, in the same order).
    Missing modules are None (then `supports` refuses the model)."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        return (attn.qkv_proj,), attn.o_proj, (getattr(mlp, "gate_up_proj", None),), getattr(mlp, "down_proj", None)
    qkv = tuple(getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    gate_up = tuple(getattr(mlp, n, None) for n in ("gate_proj", "up_proj"))
    return qkv, getattr(attn, "o_proj", None), gate_up, getattr(mlp, "down_proj", None)


def arranged(groups: list[tuple[torch.nn.Linear, ...]]) -> list[torch.Tensor]:
    """Each group's weights stacked by rows (q, k and v; gate and up), the groups one after the other in one
    buffer, in the order a step reads them, on huge pages where the CPU memory has them (`kvrag.cpu.hugepages`: a
    step streams its weights faster from there); the linears' own weights then view the buffer. One product a
    group here, the same values for the transformers forward, and no second copy of the weights (the old ones are
    freed as the modules let go of them). On another device the groups are only stacked."""
    weights = [[m.weight for m in group] for group in groups]
    shapes = [(sum(w.shape[0] for w in group), group[0].shape[1]) for group in weights]
    first = weights[0][0]
    if first.device.type == "cpu" and all(w.dtype == first.dtype for group in weights for w in group):
        size = [rows * inner for rows, inner in shapes]
        whole = hugepages.empty((sum(size),), first.dtype)
        fused = [part.view(shape) for part, shape in zip(whole.split(size), shapes)]
    else:
        fused = [group[0].new_empty(shape) for group, shape in zip(weights, shapes)]
    for group, linears, out in zip(weights, groups, fused):
        torch.cat([w.detach() for w in group], out=out)
        row = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight.data = out[row : row + rows]
            row += rows
    return fused


def stacked_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """The linears' biases stacked the same way (a missing one as zeros); None when none has one."""
    if all(m.bias is None for m in linears):
        return None
    fused = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears])
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        if m.bias is not None:
            m.bias.data = fused[row : row + rows]
        row += rows
    return fused
