"""`kvrag bench-answers`: whole answers on the built-in study sets, each strategy through the engine a user runs.

The study decodes its rows as one batch, so it times each row's first token but not its whole answer. Here every
item's answer of every strategy is one `KVRAG.answer` over the item's chunks (their KV stored first, untimed; the
retrieval scores kvrag's embedder gives; greedy to the first line break), one after another in one process: its
first token, its whole answer and whether it is right (the study's scoring). `default` is the model's shipped
default, parts included. Medians a family and over every item; a warm-up answer of each strategy first.

A plain strategy name decodes over the model's own weights (`kvrag bench-answers` loads the model so, whatever
its shipped decode weights); one ending in `_int8` or `_int4` (`default_int8`) is that strategy decoded over
quantized weights (`kvrag.cpu.decode_weights`, on for its answers only); its `same` counts the items whose answer is
word for word the one the strategy gives over the model's own weights (listed too).

A name ending in `@doc` (after any `_int8`/`_int4`: `default@doc`) answers over the chunks encoded in their
document's context (`KVModel.encode_in_context`): an item's chunks of one document (`Chunk.document`), in the item's
order, each behind that document's earlier chunks; kept in a store of their own, at the keys of their texts.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from kvrag.cache.store import MemoryStore
from kvrag.cpu import decode_weights
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.lab.study import load_items
from kvrag.lab.study import model_name as _model_name
from kvrag.model.kvmodel import KVModel

STRATEGIES = ("full_prefill_top1", "full_prefill_top3", "default")


def whole_answers(
    kv: KVModel,
    *,
    data: str = "builtin:all",
    limit: int = 10,
    seed: int = 0,
    strategies: Sequence[str] = STRATEGIES,
    max_new_tokens: int = 48,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time and score every strategy's whole answer on the items of `data` (see the module docstring)."""
    items, _ = load_items(data, limit=limit, seed=seed)
    embedder = Embedder()
    rag = KVRAG(kv, embedder=embedder, store=MemoryStore())
    in_context = KVRAG(kv, embedder=embedder, store=MemoryStore()) if any(map(_in_context, strategies)) else None
    options = dict(max_new_tokens=max_new_tokens, stop=["\n"])
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for n, item in enumerate(items):
        texts = [c.text for c in item.chunks]
        rag.store_kv(texts)
        if in_context is not None:
            store_in_context(in_context, item.chunks)
        vectors = torch.as_tensor(rag.embedder.embed(texts))
        scores = (vectors @ torch.as_tensor(rag.embedder.embed([item.question]))[0]).tolist()
        if n == 0:  # untimed: the first answer of each strategy builds kernels and buffers
            for strategy in strategies:
                _answer(in_context if _in_context(strategy) else rag, strategy, item.question, texts, scores, options)
        for strategy in strategies:
            engine = in_context if _in_context(strategy) else rag
            answer = _answer(engine, strategy, item.question, texts, scores, options)
            rows.append(
                {
                    "item": item.id,
                    "family": item.family,
                    "strategy": strategy,
                    "parts": len(answer.parts),
                    "composed": answer.composed,
                    "correct": item.is_correct(answer.text),
                    "ttft_s": answer.stats.ttft_s,
                    "answer_s": answer.stats.total_s,
                    "new_tokens": answer.stats.new_tokens,
                    "text": answer.text,
                    "abstained": answer.abstained,
                    "reason": answer.stats.reason,
                    "signals": answer.stats.signals,
                    "order": answer.stats.order,
                }
            )
        log(f"{n + 1}/{len(items)} items, {time.perf_counter() - t0:.0f} s")
    return {
        "model": _model_name(kv),
        "threads": torch.get_num_threads(),
        "data": data,
        "limit": limit,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "summary": summary(rows, strategies),
        "rows": rows,
    }


def _in_context(strategy: str) -> bool:
    return strategy.endswith("@doc")


def store_in_context(rag: KVRAG, chunks: Sequence[Any]) -> None:
    """Store an item's chunks' KV encoded in their documents' context, at the keys of their texts (a study item's
    chunks, `kvrag.lab.study.data.Chunk`: a document's chunks in the item's order)."""
    documents: dict[str, list[int]] = {}
    for i, chunk in enumerate(chunks):
        documents.setdefault(chunk.document, []).append(i)
    groups = list(documents.values())
    encoded = rag.kvmodel.encode_in_context([[chunks[i].text for i in group] for group in groups])
    for group, kvs in zip(groups, encoded):
        for i, kv in zip(group, kvs):
            rag.source.put(rag.source.key(kv.token_ids.tolist()), kv)


def _answer(rag: KVRAG, strategy: str, question: str, texts: list[str], scores: list[float],
            options: dict[str, Any]) -> Any:
    """One answer of `strategy` (a name ending in `_int8` or `_int4`: decoded over those weights)."""
    base, kind = quantized(strategy.removesuffix("@doc"))
    if kind != "model" and not decode_weights(rag.kvmodel.model, kind):
        raise ValueError(f"{strategy}: the C decode step does not take {kind} weights for this model on this machine")
    try:
        return rag.answer(question, texts, scores=scores, **_strategy(base), **options)
    finally:
        if kind != "model":
            decode_weights(rag.kvmodel.model, "model")


def quantized(strategy: str) -> tuple[str, str]:
    """A bench strategy name as (the strategy, the decode weights): "default_int4" is ("default", "int4")."""
    for kind in ("int8", "int4"):
        if strategy.endswith("_" + kind):
            return strategy.removesuffix("_" + kind), kind
    return strategy, "model"


def _strategy(name: str) -> dict[str, Any]:
    """The request's options of a bench name: "default", a strategy, "strategy:picker", either with "+parts" (the
    question split by kvrag's splitter, as a default with `"parts": "auto"` does)."""
    name, parts = (name.removesuffix("+parts"), {"parts": "auto"}) if name.endswith("+parts") else (name, {})
    if name == "default":
        return parts
    strategy, _, picker = name.partition(":")
    return {"strategy": strategy, **({"picker": picker} if picker else {}), **parts}


def summary(rows: Sequence[dict[str, Any]], strategies: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per family (and "all"), per strategy: items, right, median first token and whole answer, tokens."""
    families = sorted({r["family"] for r in rows}) + ["all"]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for family in families:
        out[family] = {}
        for strategy in strategies:
            mine = [r for r in rows if r["strategy"] == strategy and family in ("all", r["family"])]
            if not mine:
                continue
            out[family][strategy] = {
                "items": len(mine),
                "right": sum(r["correct"] for r in mine),
                "ttft_s": statistics.median(r["ttft_s"] for r in mine),
                "answer_s": statistics.median(r["answer_s"] for r in mine),
                "new_tokens": statistics.median(r["new_tokens"] for r in mine),
            }
            base = quantized(strategy.removesuffix("@doc"))[0] + ("@doc" if _in_context(strategy) else "")
            if base != strategy and base in strategies:
                own = {r["item"]: r["text"] for r in rows if r["strategy"] == base}
                out[family][strategy]["same"] = sum(r["text"] == own.get(r["item"]) for r in mine)
    return out


def markdown(result: dict[str, Any]) -> str:
    """The summary as a table: a row a family, for each strategy right / first token / whole answer."""
    strategies = list(next(iter(result["summary"].values())))
    head = " | ".join(f"{s}: right, first token, answer" for s in strategies)
    lines = [
        f"# Whole answers: {result['model']}, {result['threads']} threads",
        "",
        f"{result['data']}, {result['limit']} items a set, seed {result['seed']}; greedy to the first line break, at "
        f"most {result['max_new_tokens']} tokens; medians in seconds.",
        "",
        f"| family | {head} |",
        "|---|" + "---|" * len(strategies),
    ]
    for family, by in result["summary"].items():
        cells = [
            f"{v['right']}/{v['items']}, {v['ttft_s']:.3f}, {v['answer_s']:.3f}"
            + (f" ({v['same']} same)" if "same" in v else "")
            if (v := by.get(s))
            else "-"
            for s in strategies
        ]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
