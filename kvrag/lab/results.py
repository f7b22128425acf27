"""The README's results table, made from committed runs only: each named model's study on a draw no choice was made
on (`docs/study/models/<run>/results.json`) and its bench (`docs/bench/<run>/bench.json`).

`python -m kvrag.lab.results` prints the table; a test checks that the README holds exactly what it prints, so the
README's figures are the runs' figures.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# (model as shown, study run, bench run), under docs/study/models/ and docs/bench/
RUNS = (
    ("Qwen2.5-Coder-1.5B (`qwen2.5-coder-1.5b`, bfloat16)", "q15-seed3", "q15-fp"),
    ("Qwen2.5-Coder-0.5B (`qwen2.5-coder-0.5b`, bfloat16)", "q05-seed3", "q05-fp"),
    ("SmolLM2-135M (embedded, float32)", "s135-seed3", "s135-fp"),
)
BASELINES = (("full_prefill_top1 @ 0.05", "top chunk"), ("full_prefill_top3 @ 0.05", "top three"))


def _study(run: str) -> dict[str, Any]:
    return json.loads((ROOT / "docs" / "study" / "models" / run / "results.json").read_text())


def _bench(run: str) -> dict[str, Any] | None:
    path = ROOT / "docs" / "bench" / run / "bench.json"
    return json.loads(path.read_text()) if path.exists() else None


def _all(study: dict[str, Any]) -> dict[str, Any]:
    """The study's group of every item."""
    return next(g for g in study["groups"] if g["family"] == "all")


def _draw(command: str) -> str:
    """The run's "--limit N --seed S", as its command gave them."""
    return " ".join(re.findall(r"--(?:limit|seed) \S+", command))


def _cell(accuracy: float, ttft_s: float | None) -> str:
    return f"{100 * accuracy:.0f}% ({ttft_s:.2f} s)" if ttft_s is not None else f"{100 * accuracy:.0f}%"


def study_row(name: str, run: str) -> str:
    """The draw, then right answers and the median first token of full prefill, the two baselines and the
    default."""
    study = _study(run)
    rows = study["strategies"]
    full = _all(study)["full_prefill_accuracy"]
    default = next(r for label, r in rows.items() if label.startswith("default"))
    cells = [f"{_all(study)['n']} (`{_draw(study['command'])}`)", _cell(full, default["full_prefill_ttft_s"])]
    cells += [_cell(rows[label]["accuracy"], rows[label]["ttft_s"]) for label, _ in BASELINES]
    cells.append(f"**{_cell(default['accuracy'], default['ttft_s'])}**")
    return f"| {name} | {' | '.join(cells)} |"


def bench_row(name: str, run: str, context: int = 4000) -> str | None:
    """Full prefill's and the default's first token and 32-token answer at about `context` tokens."""
    bench = _bench(run)
    if bench is None:
        return None
    size = min(bench["ttft"], key=lambda s: abs(s["context_tokens"] - context))
    ttft, answer = size["ttft_s"], size.get("answer_s", {})
    default = next(k for k in ttft if k.startswith("default"))
    cells = [f"{size['context_tokens']:,}", f"{ttft['full_prefill']:.2f} s", f"{ttft[default]:.2f} s"]
    cells.append(f"{ttft['full_prefill'] / ttft[default]:.1f}x")
    if "full_prefill" in answer and default in answer:
        cells.append(f"{answer['full_prefill']:.2f} s, {answer[default]:.2f} s")
    else:
        cells.append("-")
    return f"| {name} | {' | '.join(cells)} |"


# (model as shown, run) with docs/study/heldout/<run>-choose.json and <run>-judge.json: `kvrag bench-answers` on each
# half of the held-out sets (kvrag.lab.heldout), merged by `python -m kvrag.lab.heldout --merge`
HELDOUT = (
    ("Qwen2.5-Coder-0.5B (`qwen2.5-coder-0.5b`, bfloat16)", "q05"),
    ("Qwen2.5-Coder-1.5B (`qwen2.5-coder-1.5b`, bfloat16)", "q15"),
)
HELDOUT_ROWS = (
    ("full_prefill", "full prefill"),
    ("full_prefill_top1", "top chunk"),
    ("full_prefill_top3", "top three"),
    ("target_recompute", "target_recompute"),
    ("target_only:gap+parts", "the earlier default"),
    ("default", "the plan by need, chunks encoded alone"),
    ("default@doc", "the default"),
)
SHIPPED = "default@doc"  # the default as a new index answers: the plan by need over chunks encoded in their document


def heldout_row(name: str, half: str, run: dict[str, Any]) -> str:
    """Right answers and median first token of each baseline and the default on one half; what the default declined."""
    import statistics

    rows = run["rows"]
    items = sorted({r["item"] for r in rows})
    cells = [half, str(len(items))]
    for strategy, _ in HELDOUT_ROWS:
        mine = [r for r in rows if r["strategy"] == strategy]
        if not mine:
            cells.append("-")
            continue
        cell = _cell(sum(r["correct"] for r in mine) / len(mine), statistics.median(r["ttft_s"] for r in mine))
        cells.append(f"**{cell}**" if strategy == SHIPPED else cell)
    default = [r for r in rows if r["strategy"] == SHIPPED]
    absent = [r for r in default if r["family"].endswith("_absent")]
    present = [r for r in default if not r["family"].endswith("_absent")]
    cells.append(f"{sum(r['abstained'] for r in absent)}/{len(absent)}, {sum(r['abstained'] for r in present)}/{len(present)}")
    return f"| {name} | {' | '.join(cells)} |"


def heldout_table() -> list[str]:
    lines = [
        "Right answers and median first token on data held out by source (`kvrag bench-answers --data "
        "kvrag/data/heldout/HALF.jsonl --limit 48`, 24 on the 1.5B; the default's thresholds, its encoding and "
        "each model's prompt header chosen on the choose half, the judge half played no part; the default's chunks are "
        "encoded in their document's context, as a new index's are; every column of the 1.5B asks under its header, "
        "which invites \"The documents do not say.\"; first tokens are medians of runs that shared the two cores with "
        "other work):",
        "",
        "| model | half | items | " + " | ".join(label for _, label in HELDOUT_ROWS)
        + " | the default declined: unanswerable, answerable |",
        "|---|---|---|" + "---|" * (len(HELDOUT_ROWS) + 1),
    ]
    for name, run in HELDOUT:
        for half, sources in (("judge", "Debian package records, chat B"), ("choose", "PyPI METADATA, chat A")):
            path = ROOT / "docs" / "study" / "heldout" / f"{run}-{half}.json"
            if path.exists():
                lines.append(heldout_row(name, f"{half} ({sources})", json.loads(path.read_text())))
    return lines


def table() -> str:
    """The README's two tables: quality per model on the study's fresh draw, speed per model from the bench."""
    lines = [
        *heldout_table(),
        "",
        "Right answers and median first token on the eight built-in sets (`kvrag study --data builtin:all`, a draw "
        "no choice was made on; the default then was each model's one-chunk plan, `target_only` with the `gap` picker "
        "and parts):",
        "",
        "| model | items (draw) | full prefill | full prefill, top chunk | full prefill, top three | that default |",
        "|---|---|---|---|---|---|",
        *(study_row(name, study_run) for name, study_run, _ in RUNS),
    ]
    benches = [(name, bench_row(name, run)) for name, _, run in RUNS]
    benches = [(name, row) for name, row in benches if row is not None]
    if benches:
        machine = _bench(next(run for name, _, run in RUNS if any(name == b for b, _ in benches)))["machine"]
        lines += [
            "",
            f"Time to first token and to a 32-token answer (`kvrag bench`; {machine.get('cpu', machine['platform'])}, "
            f"{machine['threads']} threads; each model's default as it ships: the plan by need on the Qwen models, "
            "one chunk on the 135M):",
            "",
            "| model | context tokens | full prefill, first token | the default, first token | speed-up | "
            "32-token answer: full prefill, the default |",
            "|---|---|---|---|---|---|",
            *(row for _, row in benches),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
