"""What a study runs and keeps: its rows (strategy, picker, budget, lead, parts), its configuration, an item's
references, and the probe that keeps what it measured."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from transformers import DynamicCache

from kvrag.errors import InvalidRequestError
from kvrag.plan.defaults import shipped_default
from kvrag.plan.pickers import get_picker
from kvrag.plan.probe import Probe
from kvrag.plan.strategies import get_strategy

# "name:picker" runs a target strategy with that picker only; a bare target strategy runs once per --pickers;
# "name@lead" (after any picker) runs it over chunks encoded behind the neutral lead (KVModel(lead=...));
# "default" runs the model's shipped default (kvrag.plan.defaults), whatever it is for the model in use
DEFAULT = "default"
# "ROW+parts" answers with the row's strategy a part at a time (kvrag.plan.parts' splitter; a question it cannot
# split is answered whole), each part scored against the chunks by the embedder on its own
PARTS = "+parts"
DEFAULT_STRATEGIES = (
    "full_prefill_top1",
    "full_prefill_top3",
    "reuse",
    "reorder",
    "insert_full_kv",
    "spread",
    "target_recompute",
    "target_recompute:oracle",
    "token_select",
    "attention_select",
)
DEFAULT_PICKERS = ("retriever",)

@dataclass(frozen=True, slots=True)
class Row:
    """One line of the study's table: a strategy, the picker that chose its target, a budget."""

    strategy: str
    picker: str | None
    budget: float
    lead: bool = False  # chunks encoded behind the neutral lead instead of right behind the prefix
    default: bool = False  # the row named "default": the model's shipped default (strategy, picker, budget)
    parts: bool = False  # "+parts": the question split by kvrag.plan.parts and answered a part at a time

    @property
    def label(self) -> str:
        label = self.strategy + (f" ({self.picker})" if self.picker and self.strategy != "attention_select" else "")
        label += " +lead" if self.lead else ""
        label = f"default = {label}" if self.default else label
        return label + (" +parts" if self.parts else "")


@dataclass(slots=True)
class StudyConfig:
    strategies: Sequence[str] = DEFAULT_STRATEGIES
    pickers: Sequence[str] = DEFAULT_PICKERS
    budgets: Sequence[float] = (0.05,)
    max_new_tokens: int = 32  # answers end at the first line break (see StudyRunner._generate)
    kl_top_k: int = 64
    # What a row named "default" runs: the shipped default of the model in use ({strategy, picker, budget});
    # `run_study` sets it from the model (`for_model`).
    default: dict[str, Any] | None = None

    def for_model(self, weights: str) -> StudyConfig:
        """This config with `default` set to the shipped default of the model whose weights id is `weights`."""
        return self if self.default is not None else replace(self, default=shipped_default(weights))

    def rows(self) -> list[Row]:
        """Every (strategy, picker, budget) to run: target strategies once per picker; budget-free ones once."""
        for picker in self.pickers:
            get_picker(picker)
        rows = []
        for spec in self.strategies:
            spec, parts = (spec.removesuffix(PARTS), True) if spec.endswith(PARTS) else (spec, False)
            if spec == DEFAULT:
                row = self._default_row()
                row = replace(row, parts=parts or row.parts)
                rows += [row] if row not in rows else []
                continue
            body, _, encoding = spec.partition("@")
            if encoding not in ("", "lead"):
                raise InvalidRequestError(f"'{spec}': the only encoding a row may name is @lead")
            name, _, fixed = body.partition(":")
            strategy = get_strategy(name)
            pickers: list[str | None] = [None]
            if fixed:
                get_picker(fixed)
                if not strategy.needs_target or strategy.picker:
                    raise InvalidRequestError(f"'{spec}': only a strategy that takes any picker can be given one")
                pickers = [fixed]
            elif strategy.picker:
                pickers = [strategy.picker]
            elif strategy.needs_target:
                pickers = list(self.pickers)
            budgets = self.budgets if strategy.budgeted else self.budgets[:1]
            lead = encoding == "lead"
            new = [Row(name, p, float(b), lead, parts=parts) for p in pickers for b in budgets]
            rows += [row for row in new if row not in rows]
        return rows

    def _default_row(self) -> Row:
        if self.default is None:  # names checked before the model is known: the row is made once it is
            return Row(DEFAULT, None, float(self.budgets[0]), default=True)
        d = self.default
        budget = float(d.get("budget") or self.budgets[0])
        return Row(d["strategy"], d.get("picker"), budget, default=True, parts=d.get("parts") == "auto")


@dataclass(slots=True)
class Reference:
    """Greedy generation from a plain prompt (full prefill in one order, or closed book)."""

    text: str
    tokens: list[int]
    correct: bool
    f1: float
    gold_ll: float
    ttft_s: float | None  # None: its prefill continued another order's (see StudyRunner._item)
    top_ids: list[list[int]]
    top_logp: list[list[float]]
    cache: Any = None  # the prompt's cache, while this process holds it (for KV distances)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in REFERENCE_FIELDS}


REFERENCE_FIELDS = ("text", "tokens", "correct", "f1", "gold_ll", "ttft_s", "top_ids", "top_logp")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two sequences share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def order_name(order: Sequence[int] | None) -> str:
    return "closed" if order is None else ",".join(map(str, order))


def keeping_probe(into: list[tuple[list[int], Any]]) -> type[Probe]:
    """A Probe class that appends every full prefill it makes (token ids, cache) to `into`."""

    class KeepingProbe(Probe):
        def full_prefill_made(self, ids: list[int], cache: DynamicCache) -> None:
            into.append((ids, cache))

    return KeepingProbe

