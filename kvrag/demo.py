"""The demo: the embedded default model answers questions over a bundled excerpt of the Python docs.

Every chunk is encoded once (ingestion); each question is then answered three ways over the same
stitched context — full prefill (the reference), plain reuse, and target recompute (the retriever's top
chunk moved next to the question and recomputed) — with each one's time to first token.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any, Callable

import torch

from kvrag.embed import Embedder
from kvrag.kvmodel import KVModel

STRATEGIES = ("target_recompute", "reuse", "full_prefill")


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
    max_new_tokens: int = 48,
    embedder: Embedder | None = None,
    print_fn: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run the demo and print it; return one record per (question, strategy).

    Args:
        kv: a loaded model; None loads one with `KVModel.from_pretrained(**load)` (the embedded default).
    """
    t0 = time.perf_counter()
    loaded = kv is None
    kv = kv or KVModel.from_pretrained(**(load or {}))
    ready = f"model loaded in {time.perf_counter() - t0:.1f} s" if loaded else "model given"
    chunks, items = sample_docs()
    texts = [c["text"] for c in chunks]
    t0 = time.perf_counter()
    encoded = kv.encode(texts)
    encode_s = time.perf_counter() - t0
    context = sum(len(c) for c in encoded)
    embedder = embedder or Embedder()
    print_fn(f"kvrag demo: {kv.fingerprint.architecture.split(':')[0]} model, {kv.fingerprint.dtype}, "
             f"{kv.prefix.keys.device}, {torch.get_num_threads()} threads; {ready}")
    print_fn(f"ingested {len(chunks)} chunks of the Python 3.11 docs ({context} tokens) in {encode_s:.1f} s; "
             f"KV held: {sum(c.nbytes for c in encoded) / 1e6:.1f} MB\n")
    records = []
    for n, item in enumerate(items[:questions], 1):
        scores = embedder.scores(item["question"], texts)
        picked = max(range(len(chunks)), key=lambda i: scores[i])
        print_fn(f"Q{n}: {item['question']}")
        print_fn(f"    retriever's top chunk: {chunks[picked]['id']} (holds the answer: {chunks[picked]['id'] == item['target']})")
        ttft = {}
        for strategy in STRATEGIES:
            answer = kv.answer(item["question"], encoded, strategy=strategy, scores=scores,
                               max_new_tokens=max_new_tokens, stop=["\n\n"])
            ttft[strategy] = answer.stats.ttft_s
            text = " ".join(answer.text.split())
            right = any(a.lower() in text.lower() for a in item["answers"])
            print_fn(f"    {strategy:<17} ttft {answer.stats.ttft_s:6.3f} s  {'right' if right else 'wrong'}  | {text}")
            records.append({"question": item["question"], "strategy": strategy, "text": answer.text, "right": right,
                            **answer.stats.to_dict()})
        recomputed = records[-3]["recomputed_tokens"]
        print_fn(f"    target_recompute: {ttft['full_prefill'] / ttft['target_recompute']:.1f}x faster to the first "
                 f"token than full prefill, {recomputed} of {context} context tokens recomputed\n")
    return records
