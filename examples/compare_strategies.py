"""Time to first token of every strategy over one stitched context, side by side in one run.

    python examples/compare_strategies.py --context-tokens 4000 --runs 3

Chunks are the bundled Python-docs excerpt, repeated until the context reaches the asked size; the
first chunk is the target. Every strategy runs over the same pre-encoded chunk KV (ingestion is not
timed), after one warm-up, at a 5% budget; the median of --runs is printed with its ratio to full prefill.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvrag import STRATEGIES, KVModel
from kvrag.lab.demo import sample_docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context-tokens", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    kv = KVModel.from_pretrained(args.model)
    chunks, items = sample_docs()
    texts, tokens = [], 0
    while tokens < args.context_tokens:
        text = chunks[len(texts) % len(chunks)]["text"]
        texts.append(text)
        tokens += len(kv.layout.chunk_ids(text))
    encoded = kv.encode(texts)
    question = items[0]["question"]
    print(
        f"{len(texts)} chunks, {tokens} context tokens, budget {args.budget}, {torch.get_num_threads()} threads, "
        f"median of {args.runs} runs after a warm-up"
    )
    results = {}
    for name in STRATEGIES:

        def once() -> float:
            a = kv.answer(question, encoded, strategy=name, target=0, budget=args.budget, max_new_tokens=1)
            return a.stats.ttft_s

        once()
        results[name] = statistics.median(once() for _ in range(args.runs))
    full = results["full_prefill"]
    print(f"{'strategy':<18}{'ttft s':>9}{'x full prefill':>16}")
    for name, seconds in results.items():
        print(f"{name:<18}{seconds:>9.3f}{seconds / full:>16.2f}")


if __name__ == "__main__":
    main()
