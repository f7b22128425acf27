"""Agreement with full prefill on a user's own index and questions, and choosing a default from it.

    kvrag agree --index IDX --questions queries.txt --out DIR     # measure only
    kvrag tune  --index IDX --questions queries.txt --out DIR     # measure, choose, save with the index

No gold answers are needed: for every question the engine retrieves exactly as a user's query does, answers
once with full prefill over the retrieved chunks (the reference) and once with each candidate (strategy,
picker, budget), and a candidate agrees when its greedy answer, normalized as the study scores answers, is
the reference's. The choice is the candidate whose agreement reaches the floor at the lowest median time to
the first token; full prefill itself (agreement 1 by definition) is the fallback when none does.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvrag.errors import EmptyInputError, InvalidRequestError, KVRAGError
from kvrag.lab.study.metrics import mcnemar, normalize, token_f1, wilson
from kvrag.plan.defaults import load_default, save_default
from kvrag.plan.pickers import get_picker
from kvrag.plan.request import check_budget
from kvrag.plan.strategies import get_strategy

DEFAULT_CANDIDATES = (
    "reuse",
    "reorder",
    "target_recompute",
    "target_in_place",
    "top2_recompute",
    "target_spread",
    "token_select",
    "target_only",
    "target_only:likelihood",  # the chunk of the retriever's best three behind which the question is most likely
    "target_only:gap",  # the retriever's pick where its score leads clearly, else the likelihood's (the default's)
    "top3_exact",  # full_prefill_top3's answers, at the cost of two chunks and the suffix
)
DEFAULT_BUDGETS = (0.05, 0.2)
DEFAULT_FLOOR = 0.9


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration a query may run with."""

    strategy: str
    picker: str | None
    budget: float

    @property
    def label(self) -> str:
        picker = f" ({self.picker})" if self.picker else ""
        budget = f" @ {self.budget:g}" if get_strategy(self.strategy).budgeted else ""
        return f"{self.strategy}{picker}{budget}"


def candidates(specs: Sequence[str], budgets: Sequence[float]) -> list[Candidate]:
    """Candidates of "name" or "name:picker" specs: budgeted strategies once per budget, budget-free ones once."""
    out: list[Candidate] = []
    for spec in specs:
        name, _, picker = spec.partition(":")
        strategy = get_strategy(name)
        if picker:
            get_picker(picker)
            if not strategy.needs_target or strategy.picker:
                raise InvalidRequestError(f"'{spec}': only a strategy that takes any picker can be given one")
        chosen = (picker or strategy.picker or "retriever") if strategy.needs_target else None
        for budget in budgets if strategy.budgeted else budgets[:1]:
            budget = check_budget(budget)
            candidate = Candidate(name, chosen, budget)
            if candidate not in out:
                out.append(candidate)
    return out


def read_questions(path: str | Path) -> list[str]:
    """One question a line (a query log); blank lines and lines starting with # are skipped. JSONL lines with a
    "question" field are read too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KVRAGError(f"cannot read the questions file {path}: {err}") from None
    questions = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict) and isinstance(row.get("question"), str):
                line = row["question"].strip()
        if line:
            questions.append(line)
    if not questions:
        raise EmptyInputError(f"{path} holds no question: write one question a line")
    return questions


def measure(
    rag: Any,
    questions: Sequence[str],
    configs: Sequence[Candidate],
    *,
    top_k: int = 5,
    max_new_tokens: int = 32,
    on_question: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Every candidate's agreement with full prefill over the retrieved chunks, its time to first token, per question.

    Answers are greedy and end at the first line break (a small model goes on with invented turns), as in the
    study. Returns the per-question records and one summary row a candidate.
    """
    records = []
    settings = dict(top_k=top_k, max_new_tokens=max_new_tokens, stop=("\n",))
    for n, question in enumerate(questions):
        reference = rag.query(question, strategy="full_prefill", **settings)
        row: dict[str, Any] = {
            "question": question,
            "sources": [s.id for s in reference.sources],
            "full_prefill_text": reference.text,
            "full_prefill_ttft_s": reference.stats.ttft_s,
            "answers": {},
        }
        for config in configs:
            answer = rag.query(
                question, strategy=config.strategy, picker=config.picker, budget=config.budget, **settings
            )
            row["answers"][config.label] = {
                "text": answer.text,
                "agrees": normalize(answer.text) == normalize(reference.text),
                "f1": token_f1(answer.text, [reference.text]),
                "ttft_s": answer.stats.ttft_s,
                "target": answer.stats.target,
                "recomputed_fraction": answer.stats.recomputed_fraction,
            }
        records.append(row)
        if on_question:
            on_question(n)
    return {"questions": records, "rows": summarize(records, configs)}


def summarize(records: Sequence[dict[str, Any]], configs: Sequence[Candidate]) -> list[dict[str, Any]]:
    """One row a candidate: agreement with its 95% interval, median time to first token, speed-up, and a paired
    test against target_recompute (retriever) when it is a candidate."""
    full_ttft = statistics.median(r["full_prefill_ttft_s"] for r in records)
    baseline = next((c.label for c in configs if c.strategy == "target_recompute" and c.picker == "retriever"), None)
    rows = []
    for config in configs:
        agrees = [r["answers"][config.label]["agrees"] for r in records]
        ttft = statistics.median(r["answers"][config.label]["ttft_s"] for r in records)
        lo, hi = wilson(sum(agrees), len(agrees))
        test = None
        if baseline and baseline != config.label:
            theirs = [r["answers"][baseline]["agrees"] for r in records]
            only_this, only_base, p = mcnemar(agrees, theirs)
            test = {"baseline": baseline, "only_this": only_this, "only_baseline": only_base, "p_mcnemar": p}
        rows.append(
            {
                **asdict(config),
                "label": config.label,
                "n": len(agrees),
                "agreed": sum(agrees),
                "agreement": sum(agrees) / len(agrees),
                "agreement_ci": [lo, hi],
                "agreement_f1": statistics.mean(r["answers"][config.label]["f1"] for r in records),
                "ttft_s": ttft,
                "full_prefill_ttft_s": full_ttft,
                "speedup": full_ttft / ttft if ttft else None,
                "recomputed_fraction": statistics.mean(
                    r["answers"][config.label]["recomputed_fraction"] for r in records
                ),
                "vs_target_recompute": test,
            }
        )
    return rows


def choose(rows: Sequence[dict[str, Any]], floor: float) -> dict[str, Any]:
    """The fastest candidate whose agreement reaches `floor`; full prefill when none does."""
    reaching = [r for r in rows if r["agreement"] >= floor and r["strategy"] != "full_prefill"]
    if reaching:
        best = min(reaching, key=lambda r: (r["ttft_s"], -r["agreement"]))
        kept = ("strategy", "picker", "budget", "agreement", "agreement_ci", "ttft_s")
        return {**{k: best[k] for k in kept}, "reached_floor": True}
    return {
        "strategy": "full_prefill",
        "picker": None,
        "budget": 1.0,
        "agreement": 1.0,
        "agreement_ci": [1.0, 1.0],
        "ttft_s": rows[0]["full_prefill_ttft_s"] if rows else None,
        "reached_floor": False,
    }


# -- the command -------------------------------------------------------------------------------------------


def run_tune(
    rag: Any,
    questions: Sequence[str],
    out: str | Path,
    *,
    configs: Sequence[Candidate],
    floor: float = DEFAULT_FLOOR,
    top_k: int = 5,
    max_new_tokens: int = 32,
    save: bool = False,
    command: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Measure, write results.json, table.md and agreement.png in `out`, choose; with `save`, keep the choice
    with the index (`rag.path`), where the engine and `kvrag ask` use it from then on."""
    from tqdm.auto import tqdm

    if not 0 < floor <= 1:
        raise InvalidRequestError(f"the agreement floor must be in (0, 1], got {floor!r}")
    if save and rag.path is None:
        raise InvalidRequestError("this engine has no index folder to save the default in")
    out = Path(out)
    bar = tqdm(total=len(questions), desc="tune", unit="question", disable=not progress)
    t0 = time.perf_counter()
    try:
        measured = measure(
            rag, questions, configs, top_k=top_k, max_new_tokens=max_new_tokens, on_question=lambda n: bar.update(1)
        )
    finally:
        bar.close()
    choice = choose(measured["rows"], floor)
    results = {
        "schema": "kvrag-agreement/1",
        "command": command,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "index": str(rag.path) if rag.path else None,
        "model": asdict(rag.kvmodel.fingerprint),
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "floor": floor,
        "run_s": time.perf_counter() - t0,
        "choice": {**choice, "floor": floor, "n": len(questions), "top_k": top_k},
        **measured,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "table.md").write_text(markdown(results), encoding="utf-8")
    plot(results, out / "agreement.png")
    if save:
        results["saved"] = str(save_default(rag.path, results["choice"]))
        rag.defaults = load_default(rag.path)
    return results


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    n = rows[0]["n"] if rows else 0
    lines = [
        f"# Agreement with full prefill: {n} questions, top {results['top_k']}",
        "",
        f"Command: `{results['command']}`",
        "",
        "Agreement: the candidate's greedy answer (to the first line break, normalized) is full prefill's over the "
        "same retrieved chunks; 95% Wilson intervals. `vs TR`: exact McNemar p against target_recompute "
        "(retriever), paired by question.",
        "",
        "| candidate | agrees [CI] | F1 with FP | ttft s | full prefill ttft s | speed-up | recomputed | vs TR: +/−, p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["agreement_ci"]
        vs = r["vs_target_recompute"]
        test = "-" if not vs else f"+{vs['only_this']}/−{vs['only_baseline']}, p={vs['p_mcnemar']:.3g}"
        lines.append(
            f"| {r['label']} | {100 * r['agreement']:.1f} ({r['agreed']}/{r['n']}) [{100 * lo:.1f}, {100 * hi:.1f}] "
            f"| {r['agreement_f1']:.2f} | {r['ttft_s']:.3f} | {r['full_prefill_ttft_s']:.3f} | {r['speedup']:.1f}x "
            f"| {100 * r['recomputed_fraction']:.1f}% | {test} |"
        )
    c = results["choice"]
    picker = f" ({c['picker']})" if c["picker"] else ""
    verdict = (
        f"**Choice:** `{c['strategy']}`{picker} at budget {c['budget']:g}: "
        f"agreement {100 * c['agreement']:.1f}% at {c['ttft_s']:.3f} s to the first token."
    )
    if not c["reached_floor"]:
        verdict += f" No candidate reached the {100 * results['floor']:.0f}% floor: full prefill is the default."
    return "\n".join(lines + ["", verdict]) + "\n"


def plot(results: dict[str, Any], path: Path) -> Path:
    """Agreement (with its interval) against time to first token, one point a candidate, the floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    markers = "osD^v<>pPX*h"
    for i, r in enumerate(results["rows"]):
        lo, hi = r["agreement_ci"]
        y = 100 * r["agreement"]
        yerr = [[max(0.0, y - 100 * lo)], [max(0.0, 100 * hi - y)]]  # never negative at 0% or 100%
        ax.errorbar(r["ttft_s"], y, yerr=yerr, fmt=markers[i % len(markers)], capsize=3, label=r["label"])
    if results["rows"]:
        ax.axvline(results["rows"][0]["full_prefill_ttft_s"], color="grey", linestyle=":", label="full prefill")
    ax.axhline(100 * results["floor"], color="red", linestyle="--", label="floor")
    ax.set_xlabel("median time to first token, s")
    ax.set_ylabel("agreement with full prefill, %")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
