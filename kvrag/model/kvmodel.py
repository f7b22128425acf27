"""The old path of `KVModel`, kept for code that imports it from here: the facade lives in `kvrag.kvmodel` (above
the layers it drives) and the model runtime under it in `kvrag.model.runtime`. Imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

# where the names this module had now live, looked up in this order
_HOMES = ("kvrag.kvmodel", "kvrag.model.runtime", "kvrag.answer")


def __getattr__(name: str) -> Any:
    if not name.startswith("__"):
        for home in _HOMES:
            module = importlib.import_module(home)
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
