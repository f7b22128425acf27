"""The default a query runs with when it names no strategy: `kvrag tune`'s choice, kept beside the index manifest.

This module reads and writes that one small JSON file; measuring and choosing live in kvrag.study.agreement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvrag.errors import IndexLoadError, KVRAGError
from kvrag.index import write_atomic
from kvrag.pickers import get_picker
from kvrag.strategies import get_strategy

TUNED = "kvrag-tuned.json"  # the chosen default, beside the index manifest


def save_default(folder: str | Path, choice: dict[str, Any]) -> Path:
    """Write the chosen default beside the index manifest, atomically."""
    path = Path(folder) / TUNED
    write_atomic(path, (json.dumps(choice, indent=1) + "\n").encode("utf-8"))
    return path


def load_default(folder: str | Path) -> dict[str, Any] | None:
    """The default saved by `kvrag tune` in an index folder ({strategy, picker, budget}), or None; a file that
    names no registered strategy, picker or valid budget is refused with an IndexLoadError."""
    path = Path(folder) / TUNED
    if not path.is_file() or path.is_symlink():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        strategy, picker, budget = saved["strategy"], saved.get("picker"), float(saved["budget"])
        get_strategy(strategy)
        if picker is not None:
            get_picker(picker)
        if not 0 < budget <= 1:
            raise ValueError(f"budget {budget}")
    except (OSError, ValueError, KeyError, TypeError, KVRAGError) as err:
        raise IndexLoadError(
            f"{path} is not a default written by `kvrag tune` ({err}): delete it or run kvrag tune again"
        ) from None
    return {"strategy": strategy, "picker": picker, "budget": budget}
