"""A bfloat16 prefill's rotary embedding on CPU in one pass (`kvrag.cpu.cbf16.prefill_rotary`).

transformers' attention modules (llama, mistral, qwen2, qwen3, gemma and others) rotate their queries and keys
through `apply_rotary_pos_emb`, six torch operations over each tensor, each a pass with its own dispatch. Each
such module carries its own handle on that function (`module._kernel_funcs["rotary_pos_emb"]`, the hook the
`kernels` library swaps kernels through), so a model kvrag loads on CPU with bfloat16 weights has that handle's
forward made `prefill_forward`: two or more bfloat16 tokens go to the kernel, everything else to transformers'
function. The kernel rounds where torch rounds, so its output is bitwise transformers'; a model whose function
computes anything else (a partial rotation, another layout) is found by one small comparison before anything is
switched, and left as it is.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from kvrag.cpu import cbf16

HOOK = "rotary_pos_emb"  # the name transformers gives the function among a module's `_kernel_funcs`


def prefill_forward(
    self: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of a module's rotary handle: the kernel where it takes the call, else transformers' own."""
    out = None
    if not (args or kwargs.get("unsqueeze_dim", 1) != 1 or (torch.is_grad_enabled() and q.requires_grad)):
        out = cbf16.prefill_rotary(q, k, cos, sin)
    return out if out is not None else type(self).forward(self, q, k, cos, sin, *args, **kwargs)


def _same_as_transformers(handle: Any) -> bool:
    """Whether the kernel gives bitwise what this handle's own function gives, on a few random rows."""
    g = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(1, 3, 2, 4, 32, generator=g)).bfloat16()[:, :, 0].transpose(1, 2)  # [1, 4, 3, 32], strided
    k = (4 * torch.randn(1, 2, 3, 32, generator=g)).bfloat16()
    cos, sin = (torch.randn(1, 3, 32, generator=g).bfloat16() for _ in range(2))
    try:
        want = type(handle).forward(handle, q, k, cos, sin)
    except (RuntimeError, TypeError, ValueError):  # a function of other arguments: not the one the kernel computes
        return False
    got = cbf16.prefill_rotary(q, k, cos, sin)
    return got is not None and all(torch.equal(a, b) for a, b in zip(got, want))


def use_prefill_rotary(model: torch.nn.Module) -> int:
    """Make every attention module's rotary handle run `prefill_forward` where the model's weights are bfloat16 on
    CPU; how many were. Nothing where the kernel is not built here, the modules have no handle (a transformers
    release before it, or a model that rotates otherwise), or the handle computes something else."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype != torch.bfloat16:
        return 0
    handles = [
        m.__dict__["_kernel_funcs"][HOOK]
        for m in model.modules()
        if isinstance(m.__dict__.get("_kernel_funcs"), dict) and HOOK in m.__dict__["_kernel_funcs"]
    ]
    handles = [h for h in handles if "forward" not in h.__dict__]  # one `kernels` has swapped is left as it is
    if not handles or not cbf16.prefill_linear_available():
        return 0
    checked: dict[type, bool] = {}  # a model's handles share their function's class
    taken = 0
    for handle in handles:
        cls = type(handle)
        if cls not in checked:
            checked[cls] = _same_as_transformers(handle)
        if checked[cls]:
            handle.forward = types.MethodType(prefill_forward, handle)
            taken += 1
    return taken
