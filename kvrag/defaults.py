"""The default a query runs with when it names no strategy.

First `kvrag tune`'s choice, kept beside the index manifest; else the default shipped for the model: on the
embedded SmolLM2-135M the strategy that won the built-in study (docs/study.md), on any other model the
study's recipe, target_recompute. This module reads and writes the one small JSON file and knows the shipped
defaults; measuring and choosing live in kvrag.study.agreement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvrag.errors import IndexLoadError, KVRAGError
from kvrag.index import write_atomic
from kvrag.model import EMBEDDED_WEIGHTS
from kvrag.pickers import get_picker
from kvrag.strategies import get_strategy

TUNED = "kvrag-tuned.json"  # the chosen default, beside the index manifest
# The study's recipe: move the picked target next to the question and recompute it.
RECIPE: dict[str, Any] = {"strategy": "target_recompute", "picker": None, "budget": 0.05}
# The embedded model's default, from the built-in studies on it (docs/study.md): one chunk alone, whose stored KV
# is its full-prefill KV, kept more of full prefill's context-dependent answers than any repair (68.8% against
# target_recompute's 45.8%, McNemar p = 0.013), at the cost of the question; the chunk is the one of the
# retriever's best three behind which the model finds the question most likely (right against the gold answer
# on 17 more items and 2 fewer than the retriever's pick, p = 0.0007, in the fifth run). Its questions each need
# one chunk: run `kvrag tune` on questions that need several.
EMBEDDED: dict[str, Any] = {"strategy": "target_only", "picker": "likelihood", "budget": 0.05}


def shipped_default(weights: str) -> dict[str, Any]:
    """The default strategy, picker and budget kvrag ships for a model, by its weights id."""
    return dict(EMBEDDED if weights == EMBEDDED_WEIGHTS else RECIPE)


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
