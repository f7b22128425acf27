"""A transformers module made a subclass whose forward runs one of kvrag's prefill kernels (`kvrag.cpu.norm`,
`kvrag.cpu.mlp`). The subclass is made only for a class whose forward is, word for word, its llama counterpart's (so
a transformers release that changes one leaves it as it is), and is named `Prefill<name>` in the kvrag module
that makes it, which also looks it up by that name for an unpickler (a model saved whole loads again).
"""

from __future__ import annotations

import functools
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


def by_name(name: str, prefill_class: Callable[[str], type | None], module: str) -> type:
    """`Prefill<...>` by its name, for a module's `__getattr__` (where an unpickler looks a class up: a model saved
    whole loads in a fresh process); AttributeError for any other name."""
    cls = prefill_class(name.removeprefix("Prefill")) if name.startswith("Prefill") else None
    if cls is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return cls


def classes(
    taken: dict[str, str], reference: str, forward: Callable[[type], Callable[..., Any]], module: str
) -> tuple[Callable[[str], type | None], Callable[[str], type]]:
    """What a kvrag module that swaps transformers' classes defines: its `prefill_class(name)` (`checked_subclass`,
    made once a name) and its module `__getattr__` (`by_name`)."""

    @functools.cache
    def prefill_class(name: str) -> type | None:
        return checked_subclass(name, taken, reference, forward, module)

    def module_getattr(name: str) -> type:
        return by_name(name, prefill_class, module)

    return prefill_class, module_getattr
