"""Several study runs side by side, one column a run (`kvrag study-compare RUN ... --out DIR`).

Each run is a folder `kvrag study` wrote (its results.json); the runs are usually one data set on several models,
so the table reads as "every figure per model". This module reads those files and writes compare.md and
compare_accuracy.png; it never runs a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from kvrag.errors import InvalidRequestError

CLOSED, FULL = "closed book", "full prefill"


def load_runs(folders: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Each folder's results.json, with the folder kept under "folder"."""
    if len(folders) < 1:
        raise InvalidRequestError("give at least one study folder (each holds the results.json kvrag study wrote)")
    runs = []
    for folder in map(Path, folders):
        path = folder / "results.json"
        try:
            results = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InvalidRequestError(
                f"{path} is not a study's results ({err}): run `kvrag study --out {folder}`"
            ) from None
        if not isinstance(results, dict) or "groups" not in results or "model" not in results:
            raise InvalidRequestError(f"{path} is not a study's results.json: it has no groups or model")
        runs.append({**results, "folder": str(folder)})
    return runs


def run_name(run: dict[str, Any]) -> str:
    """A run's column heading: its model's name, and the data seed where the command gives one."""
    name = str(run["model"].get("name") or run["folder"])
    command = run.get("command", "")
    seed = command.split("--seed", 1)[1].split()[0] if "--seed" in command else None
    return f"{name} (seed {seed})" if seed else name


def table(runs: Sequence[dict[str, Any]], budget: float = 0.05) -> dict[tuple[str, str], dict[str, list[Any]]]:
    """(family, variant) -> row label -> one cell a run: (accuracy, CI, first token s, n) or None."""
    out: dict[tuple[str, str], dict[str, list[Any]]] = {}
    for i, run in enumerate(runs):
        for group in run["groups"]:
            rows = out.setdefault((group["family"], group["variant"]), {})
            n = group["n"]
            if not n:
                continue
            _cell(rows, CLOSED, i, len(runs))[:] = [
                group["closed_book_accuracy"],
                group["closed_book_accuracy_ci"],
                None,
                n,
            ]
            _cell(rows, FULL, i, len(runs))[:] = [
                group["full_prefill_accuracy"],
                group["full_prefill_accuracy_ci"],
                _full_prefill_ttft(group),
                n,
            ]
            for r in group["rows"]:
                if r["budget"] != budget and not r["budget_free"]:
                    continue
                cell = _cell(rows, r["label"], i, len(runs))
                if cell:
                    continue  # a budget-free row repeats at every budget
                cell[:] = [r["accuracy"], r["accuracy_ci"], r["ttft_s"], r["n"]]
    return out


def _cell(rows: dict[str, list[Any]], label: str, i: int, n: int) -> list[Any]:
    cells = rows.setdefault(label, [[] for _ in range(n)])
    return cells[i]


def _full_prefill_ttft(group: dict[str, Any]) -> float | None:
    """Full prefill's first token over every chunk (the mean every row records beside its own)."""
    values = [r.get("full_prefill_ttft_s") for r in group["rows"] if r.get("full_prefill_ttft_s") is not None]
    return values[0] if values else None


def markdown(runs: Sequence[dict[str, Any]], budget: float = 0.05) -> str:
    names = [run_name(r) for r in runs]
    lines = [
        "# kvrag study: runs side by side",
        "",
        "Accuracy in % with its 95% Wilson interval, then the median first token in seconds, one column a run; "
        f"budgeted strategies at budget {budget:g}. The runs:",
        "",
    ]
    for name, run in zip(names, runs):
        lines.append(f"- **{name}**: `{run.get('command', '')}` ({run['data']['items']} items, {run['folder']})")
    for (family, variant), rows in table(runs, budget).items():
        lines += ["", f"## {family} / {variant}", "", "| strategy | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for label, cells in rows.items():
            lines.append(f"| {label} | " + " | ".join(_format(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _format(cell: list[Any]) -> str:
    if not cell:
        return "-"
    accuracy, (lo, hi), ttft, n = cell
    time = f", {ttft:.3f} s" if ttft is not None else ""
    return f"{100 * accuracy:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]{time} (n {n})"


def plot(runs: Sequence[dict[str, Any]], path: Path, budget: float = 0.05) -> Path:
    """One panel a (family, variant): every row's accuracy, one bar a run, with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = table(runs, budget)
    names = [run_name(r) for r in runs]
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 3.6 * len(groups)), squeeze=False)
    width = 0.8 / len(runs)
    for ax, ((family, variant), rows) in zip(axes[:, 0], groups.items()):
        labels = list(rows)
        for i, name in enumerate(names):
            xs, ys, errs = [], [], [[], []]
            for x, label in enumerate(labels):
                cell = rows[label][i]
                if cell:
                    accuracy, (lo, hi), _, _ = cell
                    xs.append(x + (i - (len(runs) - 1) / 2) * width)
                    ys.append(100 * accuracy)
                    errs[0].append(100 * (accuracy - lo))
                    errs[1].append(100 * (hi - accuracy))
            ax.bar(xs, ys, width, yerr=errs, capsize=2, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("accuracy %")
        ax.set_ylim(0, 105)
        ax.set_title(f"{family} / {variant}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(folders: Sequence[str | Path], out: str | Path, budget: float = 0.05) -> list[Path]:
    """compare.md and compare_accuracy.png for the runs in `folders`, written in `out`."""
    runs = load_runs(folders)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(markdown(runs, budget), encoding="utf-8")
    return [out / "compare.md", plot(runs, out / "compare_accuracy.png", budget)]
