"""From study records to results: per family and variant, per strategy row, with intervals and paired tests.

Writes `results.json` (schema in docs/study.md), `table.md` (one table per family and variant, shaped like
the study's) and two PNG plots (retention by strategy per family; retention against budget).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvrag.lab.study.metrics import bootstrap_diff, mcnemar, token_f1, wilson
from kvrag.lab.study.rows import Row, StudyConfig
from kvrag.plan.strategies import get_strategy

SCHEMA = "kvrag-study/1"
BASELINE = "target_recompute"


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _median(values: Iterable[float | None]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _agreement_f1(record: dict[str, Any]) -> float | None:
    """Token F1 of a row's answer with full prefill's (from the texts when the record predates the field)."""
    if "agreement_f1" in record:
        return record["agreement_f1"]
    return token_f1(record["text"], [record["full_prefill_text"]]) if "full_prefill_text" in record else None


def _row_records(records: list[dict[str, Any]], row: Row) -> dict[str, dict[str, Any]]:
    """item id -> the record of this row (a budget-free strategy's one record serves every budget)."""
    budget_free = not get_strategy(row.strategy).budgeted
    return {
        r["item"]: r
        for r in records
        if r["strategy"] == row.strategy
        and r["picker"] == row.picker
        and bool(r.get("lead")) == row.lead
        and bool(r.get("default")) == row.default
        and ("parts" in r) == row.parts  # a "+parts" record carries its number of parts
        and (budget_free or r["budget"] == row.budget)
    }


def _baseline(rows: Sequence[Row], row: Row) -> Row | None:
    """The target_recompute row this row is tested against: same picker when there is one, same budget."""
    candidates = [r for r in rows if r.strategy == BASELINE]
    for r in candidates:
        if r.picker == (row.picker or "retriever"):
            return Row(r.strategy, r.picker, row.budget)
    return Row(candidates[0].strategy, candidates[0].picker, row.budget) if candidates else None


def summarize_group(records: list[dict[str, Any]], rows: Sequence[Row]) -> dict[str, Any]:
    """Metrics of every row over one group of items."""
    items: dict[str, dict[str, Any]] = {}
    for r in records:
        items.setdefault(r["item"], r)
    dependent = {i for i, r in items.items() if not r["closed_book_correct"] and r["full_prefill_correct"]}
    out_rows = []
    by_row = {row: _row_records(records, row) for row in rows}
    for row in rows:
        mine = by_row[row]
        if not mine:
            continue
        entry = _row_entry(row, mine, dependent)
        base = _baseline(rows, row)
        theirs = by_row.get(base) if base else None
        if theirs is None and base is not None:
            theirs = _row_records(records, base)
        if theirs and base is not None and base != row:
            entry["vs_target_recompute"] = _paired(base, mine, theirs, [i for i in mine if i in dependent])
        out_rows.append(entry)
    n = len(items)
    closed_agrees = [bool(r["closed_book_agrees"]) for r in items.values() if r.get("closed_book_agrees") is not None]
    full = sum(r["full_prefill_correct"] for r in items.values())
    closed = sum(r["closed_book_correct"] for r in items.values())
    return {
        "n": n,
        "closed_book_accuracy": closed / n if n else None,
        "closed_book_agreement": sum(closed_agrees) / len(closed_agrees) if closed_agrees else None,
        "closed_book_accuracy_ci": wilson(closed, n),
        "full_prefill_accuracy": full / n if n else None,
        "full_prefill_accuracy_ci": wilson(full, n),
        "n_context_dependent": len(dependent),
        "rows": out_rows,
    }


def _row_entry(row: Row, mine: dict[str, dict[str, Any]], dependent: set[str]) -> dict[str, Any]:
    """One row's metrics over its items (`mine`: item -> record); `dependent`: the context-dependent items."""
    right = sum(r["correct"] for r in mine.values())
    agreed = [bool(r["agrees"]) for r in mine.values() if r.get("agrees") is not None]  # older records lack it
    cd = [i for i in mine if i in dependent]
    kept = sum(mine[i]["correct"] for i in cd)
    own_cd = [i for i, r in mine.items() if not r["closed_book_correct"] and r["own_order_full_prefill_correct"]]
    return {
        "label": row.label,
        "strategy": row.strategy,
        "picker": row.picker,
        "budget": row.budget,
        "budget_free": not get_strategy(row.strategy).budgeted,
        "lead": row.lead,
        "n": len(mine),
        "accuracy": right / len(mine),
        "accuracy_ci": wilson(right, len(mine)),
        "f1": _mean(r["f1"] for r in mine.values()),
        # how often the answer is full prefill's (given order), normalized as scoring is: no gold needed
        "agreement": sum(agreed) / len(agreed) if agreed else None,
        "agreement_ci": wilson(sum(agreed), len(agreed)) if agreed else None,
        "agreed": sum(agreed),
        "n_agreement": len(agreed),
        "agreement_own_order": _mean(r.get("agrees_own_order") for r in mine.values()),
        "agreement_f1": _mean(_agreement_f1(r) for r in mine.values()),
        "n_context_dependent": len(cd),
        "retention": kept / len(cd) if cd else None,
        "retention_ci": wilson(kept, len(cd)) if cd else None,
        "retained": kept,
        "own_order_full_prefill_accuracy": _mean(r["own_order_full_prefill_correct"] for r in mine.values()),
        "retention_own_order": _mean(mine[i]["correct"] for i in own_cd),
        "n_context_dependent_own_order": len(own_cd),
        "kl": _mean(r["kl"] for r in mine.values()),
        "kl_median": _median(r["kl"] for r in mine.values()),  # none for "+parts" rows: no one prompt to force
        "gold_ll_delta": _mean(r["gold_ll_delta"] for r in mine.values()),
        "target_kv_distance": _mean(r.get("target_kv_distance") for r in mine.values()),
        "picker_accuracy": _mean(r["picker_correct"] for r in mine.values()),
        # of the chunks an answer needs, the share its plan read (set recall; older records lack it)
        "targets_read": _mean(r.get("targets_read") for r in mine.values()),
        "picked_recall": _mean(r.get("picked_recall") for r in mine.values()),
        "recomputed_fraction": _mean(r["recomputed_fraction"] for r in mine.values()),
        "extra_token_layers": _mean(r["extra_token_layers"] for r in mine.values()),
        "ttft_s": statistics.median(r["ttft_s"] for r in mine.values()),
        "full_prefill_ttft_s": statistics.median(r["full_prefill_ttft_s"] for r in mine.values()),
        "answer_s": _median(r.get("answer_s") for r in mine.values()),  # whole answers ("+parts" rows record it)
        "parts": _mean(r.get("parts") for r in mine.values()),
        "vs_target_recompute": None,
    }


def _paired(
    base: Row, mine: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]], cd: list[str]
) -> dict[str, Any]:
    """Paired tests of a row against its baseline: retention over the context-dependent items `cd`, accuracy
    over every shared item, agreement with full prefill."""
    paired = [i for i in cd if i in theirs]
    a, b = [bool(mine[i]["correct"]) for i in paired], [bool(theirs[i]["correct"]) for i in paired]
    only_this, only_base, p = mcnemar(a, b)
    both = [i for i in mine if i in theirs]
    _, _, p_all = mcnemar([bool(mine[i]["correct"]) for i in both], [bool(theirs[i]["correct"]) for i in both])
    diff = bootstrap_diff([float(x) for x in a], [float(y) for y in b]) if paired else None
    agree = [i for i in both if mine[i].get("agrees") is not None and theirs[i].get("agrees") is not None]
    _, _, p_agree = mcnemar([bool(mine[i]["agrees"]) for i in agree], [bool(theirs[i]["agrees"]) for i in agree])
    return {
        "baseline": base.label,
        "n_pairs": len(paired),
        "only_this": only_this,
        "only_baseline": only_base,
        "p_mcnemar": p,
        "retention_diff": diff[0] if diff else None,
        "retention_diff_ci": [diff[1], diff[2]] if diff else None,
        "p_mcnemar_all_items": p_all,
        "p_mcnemar_agreement": p_agree if agree else None,
    }


def report_rows(config: StudyConfig) -> list[Row]:
    """The rows of the tables: every run row, budget-free ones repeated at every budget."""
    rows: list[Row] = []
    for row in config.rows():
        budgets = [row.budget] if get_strategy(row.strategy).budgeted else config.budgets
        budgets = [row.budget] if row.default else budgets
        rows += [Row(row.strategy, row.picker, float(b), row.lead, row.default, row.parts) for b in budgets]
    return rows


def summarize(records: list[dict[str, Any]], config: StudyConfig) -> dict[str, Any]:
    """Groups per family and variant (plus each family's variants together, plus everything)."""
    rows = report_rows(config)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["family"], r["variant"] or "all")].append(r)
    families = {f for f, _ in groups}
    out = []
    for family in sorted(families):
        variants = sorted(v for f, v in groups if f == family)
        if len(variants) > 1:
            groups[(family, "all")] = [r for v in variants for r in groups[(family, v)]]
            variants.append("all")
        for variant in variants:
            out.append({"family": family, "variant": variant, **summarize_group(groups[(family, variant)], rows)})
    overall = summarize_group(records, rows) if records else {"rows": []}
    if len(families) > 1:
        out.append({"family": "all", "variant": "all", **overall})
    strategies = {f"{r['label']} @ {r['budget']:g}": r for r in overall["rows"]}
    return {"groups": out, "strategies": strategies}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    """One table per family and variant at every budget."""
    lines = [f"# kvrag study: {results['model']['name']}", "", f"Command: `{results['command']}`", ""]
    lines.append(
        f"{results['data']['items']} items, computed in {results['compute_s'] / 60:.1f} min "
        f"({results['data']['cached_items']} from the cache of an earlier run), {results['threads']} threads. "
        "Accuracy and retention in %, with 95% Wilson intervals; retention is over the context-dependent items "
        "(closed book wrong, full prefill in the given order right). `FP own order`: full prefill in the "
        "strategy's own order. `agrees with FP`: the greedy answer, normalized, is the one full prefill gives in the given order (no gold needed; strict: a reworded answer does not agree); `F1 with FP`: token F1 between the two. KL: teacher-forced over the own-order full prefill's answer. `vs TR`: paired "
        "exact McNemar p on the context-dependent items against target_recompute (same picker)."
    )
    for group in results["groups"]:
        lines += [
            "",
            f"## {group['family']} / {group['variant']}",
            "",
            f"{group['n']} items; closed book {_pct(group['closed_book_accuracy'])}% (agrees with full prefill "
            f"{_pct(group.get('closed_book_agreement'))}%), full prefill {_pct(group['full_prefill_accuracy'])}%, "
            f"{group['n_context_dependent']} context-dependent.",
            "",
            "| strategy | budget | accuracy [CI] | retention (kept/n) [CI] | agrees with FP [CI] | FP own order | KL "
            "| F1 with FP | Δ log-lik | target KV dist | picker acc | targets read | recomputed | ttft s "
            "| vs TR: +/−, p | p agree |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        if group["n"]:
            lo, hi = group["closed_book_accuracy_ci"]
            cb_agree = group.get("closed_book_agreement")
            lines.append(
                f"| closed book (baseline) | any | {_pct(group['closed_book_accuracy'])} [{_pct(lo)}, {_pct(hi)}] "
                f"| 0.0 (by definition) | {_pct(cb_agree)} | - | - | - | - | - | - | - | 0.0 | - | - | - |"
            )
        shown: set[str] = set()
        for r in group["rows"]:
            if r["budget_free"] and r["label"] in shown:
                continue  # one line: it ran once and is the same at every budget
            shown.add(r["label"])
            budget = "any" if r["budget_free"] else f"{r['budget']:g}"
            ci = r["accuracy_ci"]
            ret = "-"
            if r["retention"] is not None:
                lo, hi = r["retention_ci"]
                ret = f"{_pct(r['retention'])} ({r['retained']}/{r['n_context_dependent']}) [{_pct(lo)}, {_pct(hi)}]"
            vs = r["vs_target_recompute"]
            test = "-" if not vs else f"+{vs['only_this']}/−{vs['only_baseline']}, p={vs['p_mcnemar']:.3g}"
            p_agree = "-" if not vs or vs.get("p_mcnemar_agreement") is None else f"{vs['p_mcnemar_agreement']:.3g}"
            agree = "-"
            if r.get("agreement") is not None:
                lo, hi = r["agreement_ci"]
                agree = f"{_pct(r['agreement'])} [{_pct(lo)}, {_pct(hi)}]"
            lines.append(
                f"| {r['label']} | {budget} | {_pct(r['accuracy'])} [{_pct(ci[0])}, {_pct(ci[1])}] | {ret} | {agree} "
                f"| {_pct(r['own_order_full_prefill_accuracy'])} | {_num(r['kl'])} | {_num(r.get('agreement_f1'), 2)} "
                f"| {_num(r['gold_ll_delta'], 2)} "
                f"| {_num(r['target_kv_distance'])} | {_pct(r['picker_accuracy'])} | {_pct(r.get('targets_read'))} "
                f"| {_pct(r['recomputed_fraction'])} "
                f"| {_num(r['ttft_s'])} | {test} | {p_agree} |"
            )
    return "\n".join(lines) + "\n"


def bars(groups: Sequence[dict[str, Any]], metric: str, budget: float, path: Path) -> Path:
    """One panel a group: `metric` ("retention" or "agreement") of every row at `budget`, with its 95% interval."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.5), squeeze=False)
    for ax, group in zip(axes[0], groups):
        rows = [r for r in group["rows"] if r["budget"] == budget and r.get(metric) is not None]
        values = [100 * r[metric] for r in rows]
        # an interval's bound can sit a rounding error inside its point: never a negative bar
        errors = [
            [max(0.0, 100 * (r[metric] - r[f"{metric}_ci"][0])) for r in rows],
            [max(0.0, 100 * (r[f"{metric}_ci"][1] - r[metric])) for r in rows],
        ]
        ax.bar(range(len(rows)), values, yerr=errors, capsize=3, color="#4c72b0")
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=60, ha="right", fontsize=8)
        ax.set_ylim(0, 105)
        count = group.get("n_context_dependent") if metric == "retention" else group.get("n")
        what = "context-dependent" if metric == "retention" else "items"
        ax.set_title(f"{group['family']} ({count} {what})")
        ax.set_ylabel(f"{metric} % at budget {budget:g}" + (" (with full prefill)" if metric == "agreement" else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """retention_by_strategy.png, agreement_by_strategy.png and retention_vs_budget.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_family: dict[str, dict[str, Any]] = {}
    for g in results["groups"]:  # one panel a family: its "all" group, or its only variant
        if g["family"] != "all" and (g["family"] not in by_family or g["variant"] == "all"):
            by_family[g["family"]] = g
    groups = list(by_family.values()) or results["groups"]
    if not groups:  # no item finished (a report of a cache that holds none): nothing to draw
        return []
    budgets = sorted({r["budget"] for g in groups for r in g["rows"]})
    main = 0.05 if 0.05 in budgets else budgets[0] if budgets else 0.05
    paths = [
        bars(groups, "retention", main, out / "retention_by_strategy.png"),
        bars(groups, "agreement", main, out / "agreement_by_strategy.png"),
    ]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.5), squeeze=False)
    for ax, group in zip(axes[0], groups):
        by_label: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in group["rows"]:
            if r["retention"] is not None:
                by_label[r["label"]].append((r["budget"], 100 * r["retention"]))
        for label, points in by_label.items():
            points.sort()
            style = "--" if any(r["budget_free"] for r in group["rows"] if r["label"] == label) else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
        if len(budgets) > 1:
            ax.set_xscale("log")
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
            ax.minorticks_off()
        ax.set_xlabel("budget (fraction of context tokens)")
        ax.set_ylabel("retention %")
        ax.set_ylim(0, 105)
        ax.set_title(group["family"])
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths.append(out / "retention_vs_budget.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write(results: dict[str, Any], out: Path) -> list[Path]:
    """results.json, table.md and the plots in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "table.md").write_text(markdown(results), encoding="utf-8")
    return [out / "results.json", out / "table.md", *plots(results, out)]
