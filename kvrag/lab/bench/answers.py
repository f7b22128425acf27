"""`kvrag bench-answers`: whole answers on the built-in study sets, each strategy through the engine a user runs.

The study decodes its rows as one batch, so it times each row's first token but not its whole answer. Here every
item's answer of every strategy is one `KVRAG.answer` over the item's chunks (their KV stored first, untimed; the
retrieval scores kvrag's embedder gives; greedy to the first line break, or with `to_line_break=False` to the answer's
end as `kvrag ask` decodes it, a list over several lines whole), one after another in one process: its
first token, its whole answer and whether it is right (the study's scoring). `default` is the model's shipped
default, parts included. Medians a family and over every item; a warm-up answer of each strategy first.

A plain strategy name decodes over the model's own weights (`kvrag bench-answers` loads the model so, whatever
its shipped decode weights); one ending in `_int8` or `_int4` (`default_int8`) is that strategy decoded over
quantized weights (`kvrag.cpu.decode_weights`, on for its answers only); its `same` counts the items whose answer is
word for word the one the strategy gives over the model's own weights (listed too).

After any `_int8`/`_int4`, marks after an `@`, joined by `+`, say how the chunks' KV is kept. `doc`
(`default@doc`) answers over the chunks encoded in their document's context (`KVModel.encode_in_context`): an
item's chunks of one document (`Chunk.document`), in the item's order, each behind that document's earlier chunks.
A storage dtype (`float16`, `int8`, `int4`: `default@doc+int4`) answers over entries written to a disk store in
that dtype and read back, as an index ingested with `--storage-dtype` holds them; its `same` counts the answers word
for word those over the KV kept in the model's dtype (`default_int4@doc+int4` against `default_int4@doc`). Each
kind of marks has a store of its own, the entries at the keys of their texts. `runs` (`default@doc+runs`) gives the
plan every run of two or more retrieved chunks whole (`kvrag.engine.runs.with_runs`, as `KVRAG` reads an index
encoded in context); it changes which chunks are given, not how they are kept.

`top_k` gives each item's K best chunks by the embedder's scores, best first, as the engine's retrieval would
(every chunk of an item is still stored, as an index holds them); None gives them all in the item's order.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from kvrag.cache.codec import STORAGE_DTYPES
from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
from kvrag.cpu import decode_weights
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.engine.runs import with_runs
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
    top_k: int | None = None,
    to_line_break: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time and score every strategy's whole answer on the items of `data` (see the module docstring)."""
    items, _ = load_items(data, limit=limit, seed=seed)
    embedder = Embedder()
    options = dict(max_new_tokens=max_new_tokens, stop=["\n"] if to_line_break else [])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-answers-") as tmp:
        engines: dict[tuple[bool, str | None], KVRAG] = {}
        for strategy in strategies:
            kept = keeping(strategy)
            if kept not in engines:
                store = MemoryStore() if kept[1] is None else TieredStore(
                    MemoryStore(), DiskStore(f"{tmp}/{len(engines)}", kept[1])
                )
                engines[kept] = KVRAG(kv, embedder=embedder, store=store)
        t0 = time.perf_counter()
        for n, item in enumerate(items):
            texts = [c.text for c in item.chunks]
            for (in_context, _), engine in engines.items():
                if in_context:
                    store_in_context(engine, item.chunks)
                else:
                    engine.store_kv(texts)
            vectors = torch.as_tensor(embedder.embed(texts))
            scores = (vectors @ torch.as_tensor(embedder.embed([item.question]))[0]).tolist()
            hits = list(range(len(texts)))
            if top_k is not None:
                hits = sorted(hits, key=lambda i: (-scores[i], i))[:top_k]
            given = {s: _given(kv, item.chunks, hits, reads_runs(s)) for s in strategies}

            def run(strategy: str) -> Any:
                chosen = given[strategy]
                return _answer(engines[keeping(strategy)], strategy, item.question, [texts[i] for i in chosen],
                               [scores[i] for i in chosen], options)

            if n == 0:  # untimed: the first answer of each strategy builds kernels and buffers
                for strategy in strategies:
                    run(strategy)
            for strategy in strategies:
                answer = run(strategy)
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
                        "given": len(given[strategy]),
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
        "top_k": top_k,
        "to_line_break": to_line_break,
        "summary": summary(rows, strategies),
        "rows": rows,
    }


def keeping(strategy: str) -> tuple[bool, str | None]:
    """How a bench name keeps its chunks' KV: (encoded in their document's context, the storage dtype or None for
    the model's own dtype in memory). "default@doc+int4" is (True, "int4"); ValueError on a mark it does not know."""
    marks = strategy.partition("@")[2]
    in_context, dtype = False, None
    for mark in filter(None, marks.split("+")):
        if mark == "doc":
            in_context = True
        elif mark == "runs":  # which chunks are given, not how they are kept
            continue
        elif mark in STORAGE_DTYPES and dtype is None:
            dtype = mark
        else:
            raise ValueError(f"{strategy}: after '@' name doc, runs and at most one of "
                             f"{', '.join(STORAGE_DTYPES)}, joined by '+' (default@doc+int4)")
    if "runs" in marks.split("+") and not in_context:
        raise ValueError(f"{strategy}: runs are read whole only where chunks are encoded in context: add doc")
    return in_context, dtype


def reads_runs(strategy: str) -> bool:
    """Whether a bench name gives the plan the retrieved chunks' runs whole (`+runs`)."""
    return "runs" in strategy.partition("@")[2].split("+")


def _given(kv: KVModel, chunks: Sequence[Any], hits: list[int], runs: bool) -> list[int]:
    """The chunks (indices into an item's) a strategy is given: the retrieved `hits`, best first, with their runs
    whole where `runs` (an item's document's chunks, in the item's order, cut into runs as encoding cuts them)."""
    if not runs:
        return hits
    ids = [kv.chunk_ids(i, c.text) for i, c in enumerate(chunks)]
    run_of: dict[int, list[int]] = {}
    for members in _documents(chunks):
        for run in kv.context_runs([ids[i] for i in members]):  # as `encode_in_context` cuts them
            for j in run:
                run_of[members[j]] = [members[k] for k in run]
    return with_runs(hits, run_of.__getitem__, lambda c: len(ids[c]))


def _documents(chunks: Sequence[Any]) -> list[list[int]]:
    """An item's chunks (indices) grouped by their document (`Chunk.document`), each in the item's order."""
    documents: dict[str, list[int]] = {}
    for i, chunk in enumerate(chunks):
        documents.setdefault(chunk.document, []).append(i)
    return list(documents.values())


def same_as(strategy: str) -> str:
    """The row a bench name's `same` is counted against: with a storage mark, the name kept in the model's dtype
    ("default_int4@doc+int4" -> "default_int4@doc"); else decoded over the model's own weights ("default_int4@doc"
    -> "default@doc")."""
    in_context, dtype = keeping(strategy)
    doc = "@doc" if in_context else ""
    return _name(strategy) + doc if dtype is not None else quantized(_name(strategy))[0] + doc


def _name(strategy: str) -> str:
    """A bench name without its marks: "default_int4@doc+int4" is "default_int4"."""
    return strategy.partition("@")[0]


def store_in_context(rag: KVRAG, chunks: Sequence[Any]) -> None:
    """Store an item's chunks' KV encoded in their documents' context, at the keys of their texts (a study item's
    chunks, `kvrag.lab.study.data.Chunk`: a document's chunks in the item's order)."""
    groups = _documents(chunks)
    encoded = rag.kvmodel.encode_in_context([[chunks[i].text for i in group] for group in groups])
    for group, kvs in zip(groups, encoded):
        for i, kv in zip(group, kvs):
            rag.source.put(rag.source.key(kv.token_ids.tolist()), kv)


def _answer(rag: KVRAG, strategy: str, question: str, texts: list[str], scores: list[float],
            options: dict[str, Any]) -> Any:
    """One answer of `strategy` (a name ending in `_int8` or `_int4`: decoded over those weights)."""
    base, kind = quantized(_name(strategy))
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
            base = same_as(strategy)
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
        f"{result['data']}, {result['limit']} items a set, seed {result['seed']}; greedy "
        f"{'to the first line break' if result.get('to_line_break', True) else 'to its end (as `kvrag ask`)'}, at "
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
