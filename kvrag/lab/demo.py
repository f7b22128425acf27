"""The demo: a model that answers them (Qwen2.5-Coder-0.5B, installed by the set-up; `--model smollm2-135m` for the
embedded default) answers questions over a bundled excerpt of the Python docs.

Every chunk is ingested once (embedded, KV encoded and stored); each question retrieves its top chunks
and is answered over them with the model's default strategy (kvrag.plan.defaults: on the named models
target_only, the retriever's top chunk alone, exactly as full prefill over it), target recompute (that chunk
moved next to the question and recomputed), plain reuse, and full prefill over every retrieved chunk (the
reference), with each one's time to first token.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any, Callable

import torch

from kvrag.cache.store import MemoryStore
from kvrag.engine.documents import Document
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.kvmodel import KVModel
from kvrag.plan.defaults import shipped_default

COMPARED = ("target_recompute", "reuse", "full_prefill")  # shown beside the model's default
# The demo's model: the smallest named model that answers the bundled questions right (the embedded 135M answers
# fewer; `kvrag demo --model smollm2-135m` runs it). Installed by the same set-up (`make install`).
DEMO_MODEL = "qwen2.5-coder-0.5b"


def sample_docs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The bundled chunks and questions (Python 3.11 docs excerpt, PSF license in the same folder)."""
    folder = resources.files("kvrag") / "data" / "python_docs"
    read = lambda name: [json.loads(line) for line in (folder / name).read_text().splitlines() if line.strip()]  # noqa: E731
    return read("chunks.jsonl"), read("questions.jsonl")


def run_demo(
    kv: KVModel | None = None,
    *,
    load: dict[str, Any] | None = None,
    questions: int = 3,
    top_k: int = 6,
    max_new_tokens: int = 48,
    embedder: Embedder | None = None,
    print_fn: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run the demo and print it; return one record per (question, strategy).

    Args:
        kv: a loaded model; None loads one with `KVModel.from_pretrained(**load)`, `DEMO_MODEL` unless `load`
            names another (`name_or_path`).
        top_k: chunks retrieved for each question.
    """
    t0 = time.perf_counter()
    loaded = kv is None
    load = {**(load or {})}
    load["name_or_path"] = load.get("name_or_path") or DEMO_MODEL
    kv = kv or KVModel.from_pretrained(**load)
    ready = f"model loaded in {time.perf_counter() - t0:.1f} s" if loaded else "model given"
    chunks, items = sample_docs()
    rag = KVRAG(kv, embedder=embedder or Embedder(), store=MemoryStore())
    ingested = rag.ingest(
        [Document(c["text"], {"source": c["source"]}, id=c["id"]) for c in chunks], split=False, progress=False
    )
    print_fn(
        f"kvrag demo: {kv.fingerprint.architecture.split(':')[0]} model, {kv.fingerprint.dtype}, "
        f"{kv.prefix.keys.device}, {torch.get_num_threads()} threads; {ready}"
    )
    print_fn(
        f"ingested {ingested.chunks} chunks of the Python 3.11 docs ({ingested.tokens} tokens): KV encoded in "
        f"{ingested.encode_s:.1f} s, {rag.store.nbytes / 1e6:.1f} MB held; each question retrieves {top_k}\n"
    )
    default = shipped_default(kv.fingerprint.weights)["strategy"]
    strategies = [default, *(s for s in COMPARED if s != default)]
    # Untimed, every strategy once over the last bundled question: the first answers pay one-time work (the C
    # kernels' build on a new machine, first calls), which no figure printed below should carry.
    t0 = time.perf_counter()
    _question(rag, items[-1], strategies, top_k, 2, lambda line: None)
    print_fn(f"warm-up (one-time work: the C kernels' build on a new machine) {time.perf_counter() - t0:.1f} s\n")
    records = []
    for n, item in enumerate(items[:questions], 1):
        print_fn(f"Q{n}: {item['question']}")
        records += _question(rag, item, strategies, top_k, max_new_tokens, print_fn)
    return records


def _question(
    rag: KVRAG,
    item: dict[str, Any],
    strategies: list[str],
    top_k: int,
    max_new_tokens: int,
    print_fn: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One question answered by each strategy (the first is the default, run as a user gets it), printed."""
    default = strategies[0]
    ttft, recomputed, context, records = {}, 0, 0, []
    for strategy in strategies:
        answer = rag.query(
            item["question"],
            strategy=None if strategy == default else strategy,  # the default as a user gets it
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop=["\n\n"],
        )
        if strategy == default:
            top = answer.sources[0].id.split("#")[0]
            picked = answer.sources[answer.stats.target].id.split("#")[0] if answer.stats.target is not None else None
            print_fn(
                f"    retriever's top chunk: {top} (holds the answer: {top == item['target']})"
                + (f"; the default's pick: {picked} (holds the answer: {picked == item['target']})" if picked else "")
            )
            recomputed, context = answer.stats.recomputed_tokens, answer.stats.context_tokens
        ttft[strategy] = answer.stats.ttft_s
        text = " ".join(answer.text.split())
        right = any(a.lower() in text.lower() for a in item["answers"])
        label = strategy
        if strategy == default:  # with the default's picker where it is not the retriever
            picker = answer.stats.picker
            label = f"{strategy}{f':{picker}' if picker not in (None, 'retriever') else ''} (default)"
        print_fn(f"    {label:<34} ttft {answer.stats.ttft_s:6.3f} s  {'right' if right else 'wrong'}  | {text}")
        records.append(
            {
                "question": item["question"],
                "strategy": strategy,
                "text": answer.text,
                "right": right,
                "top_chunk": answer.sources[0].id.split("#")[0],
                **answer.stats.to_dict(),
            }
        )
    print_fn(
        f"    {default}: {ttft['full_prefill'] / ttft[default]:.1f}x faster to the first token than full "
        f"prefill, {recomputed} of {context} context tokens recomputed\n"
    )
    return records
