"""A transformers module made a subclass whose forward runs one of kvrag's prefill kernels (`kvrag.norm`,
`kvrag.mlp`). The subclass is made only for a class whose forward is, word for word, its llama counterpart's (so
a transformers release that changes one leaves it as it is), and is named `Prefill<name>` in the kvrag module
that makes it, which also looks it up by that name for an unpickler (a model saved whole loads again).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch


def checked_subclass(
    name: str, taken: dict[str, str], reference: str, forward: Callable[[type], Callable[..., Any]], module: str
) -> type | None:
    """`Prefill<name>`, the subclass of transformers' class `name` (from the module `taken[name]`) with the forward
    `forward(base)`, defined as if in `module`; None where `name` is not taken or its forward is not
    `reference`'s, word for word."""
    if name not in taken:
        return None
    base = getattr(importlib.import_module(taken[name]), name)
    llama = getattr(importlib.import_module(taken[reference]), reference)
    try:
        if inspect.getsource(base.forward) != inspect.getsource(llama.forward):
            return None
    except (OSError, TypeError):  # no source to compare (an install of compiled files only): left as it is
        return None
    attributes = {"forward": forward(base), "__module__": module, "__qualname__": f"Prefill{name}"}
    return type(f"Prefill{name}", (base,), attributes)


def swap(modules: Iterable[torch.nn.Module], prefill_class: Callable[[str], type | None]) -> int:
    """Make each module its `prefill_class` where there is one; how many were."""
    taken = 0
    for m in modules:
        cls = prefill_class(type(m).__name__)
        if cls is not None:
            m.__class__ = cls
            taken += 1
    return taken
