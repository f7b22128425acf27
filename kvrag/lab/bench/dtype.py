"""`kvrag bench-dtype`: what computing in bfloat16 (or float16) costs in quality, against float32 on the same
weights, end to end: each model encodes its own chunk KV, stitches, recomputes and decodes in its dtype.

Per built-in study item (api_docs, open_qa and dialogue, as `kvrag study` loads them) and per strategy:
- the first-token KL of the low-precision distribution against float32's (nats, over the whole vocabulary);
- whether its greedy answer (to the first line break, normalized as the study scores answers) is float32's;
- whether each dtype's answer is float32 full prefill's, so the low precision's effect on the agreement a user
  tunes for reads as a paired difference (McNemar's exact test), with 95% Wilson intervals.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from kvrag.lab.bench.storage import kl_divergence, builtin_items
from kvrag.lab.study.metrics import mcnemar, normalize, wilson
from kvrag.kvmodel import KVModel

STRATEGIES = ("full_prefill", "reuse", "target_recompute")


def dtype_quality(
    reference: KVModel,
    low: KVModel,
    *,
    limit: int = 20,
    strategies: Sequence[str] = STRATEGIES,
    max_new_tokens: int = 32,
    small: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure `low` (a lower-precision copy of `reference`'s model) against `reference` over `limit` built-in
    items a family; see the module docstring. `small` cuts items short (a check on a tiny model)."""
    a, b = reference.fingerprint, low.fingerprint
    if (a.architecture, a.weights, a.shape) != (b.architecture, b.weights, b.shape):
        raise ValueError("the two models must be the same weights, loaded in two dtypes")
    source, items = builtin_items(limit, max_chars=100 if small else None, small=small)
    names = {"reference": a.dtype, "low": b.dtype}
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for n, (question, texts, target) in enumerate(items):
        encoded = {"reference": reference.encode(texts), "low": low.encode(texts)}
        row: dict[str, Any] = {"question": question, "strategies": {}}
        answers: dict[str, dict[str, str]] = {}
        for strategy in strategies:
            out: dict[str, Any] = {}
            logits = {}
            for side, kv in (("reference", reference), ("low", low)):
                logits[side] = kv.prefill(question, encoded[side], strategy=strategy, target=target).prefill.logits[-1]
                answer = kv.answer(
                    question,
                    encoded[side],
                    strategy=strategy,
                    target=target,
                    max_new_tokens=max_new_tokens,
                    stop=("\n",),
                )
                answers.setdefault(side, {})[strategy] = answer.text
            out["first_token_kl"] = kl_divergence(logits["reference"].float(), logits["low"].float())
            out["same_answer"] = normalize(answers["low"][strategy]) == normalize(answers["reference"][strategy])
            row["strategies"][strategy] = out
        if "full_prefill" in strategies:
            full = normalize(answers["reference"]["full_prefill"])
            for strategy in strategies:
                for side in ("reference", "low"):
                    row["strategies"][strategy][f"{side}_agrees_with_full_prefill"] = (
                        normalize(answers[side][strategy]) == full
                    )
        rows.append(row)
        log(f"item {n + 1}/{len(items)} ({time.perf_counter() - t0:.0f} s)")
    return {
        "source": source,
        "items": len(items),
        "dtypes": names,
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
        "summary": {s: _summary(rows, s) for s in strategies},
        "rows": rows,
    }


def _summary(rows: Sequence[dict[str, Any]], strategy: str) -> dict[str, Any]:
    cells = [r["strategies"][strategy] for r in rows]
    kls = [c["first_token_kl"] for c in cells]
    same = sum(c["same_answer"] for c in cells)
    out: dict[str, Any] = {
        "first_token_kl": {"mean": statistics.fmean(kls), "median": statistics.median(kls), "max": max(kls)},
        "finite": all(math.isfinite(x) for x in kls),
        "same_answer": same / len(cells),
        "same_answer_ci": wilson(same, len(cells)),
    }
    if "reference_agrees_with_full_prefill" in cells[0]:
        a = [c["reference_agrees_with_full_prefill"] for c in cells]
        b = [c["low_agrees_with_full_prefill"] for c in cells]
        only_ref, only_low, p = mcnemar(a, b)
        out["agreement_with_float32_full_prefill"] = {
            "reference": sum(a) / len(a),
            "reference_ci": wilson(sum(a), len(a)),
            "low": sum(b) / len(b),
            "low_ci": wilson(sum(b), len(b)),
            "only_reference": only_ref,
            "only_low": only_low,
            "mcnemar_p": p,
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    """The summary as a markdown table."""
    low, ref = result["dtypes"]["low"], result["dtypes"]["reference"]
    lines = [
        f"{low} against {ref}: {result['items']} items ({result['source']}), greedy answers of up to "
        f"{result['max_new_tokens']} tokens to the first line break, {result['threads']} threads",
        "",
        f"| strategy | first-token KL mean (median, max) | {low} answer = {ref} answer | agreement with {ref} full "
        f"prefill: {ref} | {low} | McNemar p |",
        "|---|---|---|---|---|---|",
    ]
    for strategy, s in result["summary"].items():
        kl = s["first_token_kl"]
        lo, hi = s["same_answer_ci"]
        agree = s.get("agreement_with_float32_full_prefill")
        if agree:
            cols = (
                f"{agree['reference']:.1%} [{agree['reference_ci'][0]:.1%}, {agree['reference_ci'][1]:.1%}] | "
                f"{agree['low']:.1%} [{agree['low_ci'][0]:.1%}, {agree['low_ci'][1]:.1%}] | {agree['mcnemar_p']:.3f}"
            )
        else:
            cols = "- | - | -"
        lines.append(
            f"| {strategy} | {kl['mean']:.4f} ({kl['median']:.4f}, {kl['max']:.4f}) | "
            f"{s['same_answer']:.1%} [{lo:.1%}, {hi:.1%}] | {cols} |"
        )
    return "\n".join(lines)
