"""The default a query runs with when it names no strategy.

First `kvrag tune`'s choice, kept beside the index manifest; else the default shipped for the model: on each
named model (`kvrag models`) the plan that won the built-in study on it (docs/study.md, docs/models.md), on any
other model the study's recipe, target_recompute. A default may also say how a question is split
(`"parts": "auto"`: kvrag.plan.parts' splitter, a question it cannot split answered whole). This module reads and
writes the one small JSON file and knows the shipped defaults; measuring and choosing live in
kvrag.lab.study.agreement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvrag.errors import IndexLoadError, KVRAGError
from kvrag.files import write_atomic
from kvrag.model import catalog
from kvrag.model.loading import EMBEDDED_WEIGHTS
from kvrag.plan.pickers import get_picker
from kvrag.plan.strategies import get_strategy

TUNED = "kvrag-tuned.json"  # the chosen default, beside the index manifest
# The study's recipe: move the picked target next to the question and recompute it.
RECIPE: dict[str, Any] = {"strategy": "target_recompute", "picker": None, "budget": 0.05}
# The embedded 135M's: one chunk (the retriever's pick where its score leads clearly, else the model's likelihood's),
# questions split into parts; chosen on the built-in sets (docs/study.md, docs/models.md). The plan by need was not
# measured on it: it stays.
EMBEDDED: dict[str, Any] = {"strategy": "target_only", "picker": "gap", "budget": 0.05, "parts": "auto"}
# Qwen2.5-Coder-0.5B-Instruct's: the plan by need (kvrag.plan.need: one chunk, several, or "the documents do not
# say", from the model's likelihood of the question behind every retrieved chunk), questions split into parts where
# kvrag's splitter can; chosen on the held-out choose half and judged on the judge half (docs/study.md).
QWEN_05B: dict[str, Any] = {"strategy": "by_need", "picker": None, "budget": 0.05, "parts": "auto"}
# Qwen2.5-Coder-1.5B-Instruct's: the 0.5B's, carried over from the smaller model of the same family (no run of the
# 1.5B chose it; docs/models.md).
QWEN_15B: dict[str, Any] = dict(QWEN_05B)
SHIPPED: dict[str, dict[str, Any]] = {
    EMBEDDED_WEIGHTS: EMBEDDED,
    catalog.QWEN_05B.weights: QWEN_05B,
    catalog.QWEN_15B.weights: QWEN_15B,
}
PARTS = ("auto",)  # what a default's "parts" may say (absent: answer whole)


def shipped_default(weights: str) -> dict[str, Any]:
    """The default kvrag ships for a model, by its weights id: strategy, picker, budget and maybe parts."""
    return dict(SHIPPED.get(weights, RECIPE))


def default_parts(default: dict[str, Any] | None) -> str | None:
    """How a default splits questions ("auto"), or None: answer whole."""
    return (default or {}).get("parts")


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
        parts = saved.get("parts")
        if parts is not None and parts not in PARTS:
            raise ValueError(f"parts {parts!r}")
        get_strategy(strategy)
        if picker is not None:
            get_picker(picker)
        if not 0 < budget <= 1:
            raise ValueError(f"budget {budget}")
    except (OSError, ValueError, KeyError, TypeError, KVRAGError) as err:
        raise IndexLoadError(
            f"{path} is not a default written by `kvrag tune` ({err}): delete it or run kvrag tune again"
        ) from None
    return {"strategy": strategy, "picker": picker, "budget": budget} | ({"parts": parts} if parts else {})
