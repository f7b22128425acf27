"""kvrag's plans on vLLM against vLLM's own prefill and kvrag's transformers engine: time to first token and
throughput under concurrent requests. Run it alone (`kvrag bench-vllm`, or `python -m vllm_kvrag.bench`).

Time to first token, at each context size (one request at a time, median of `runs`):
- vLLM's full prefill, and vLLM over an exact prefix-cache hit of the whole prompt (the least work there is);
- the floor for `target_recompute`: vLLM computing the target and the suffix over an exact prefix-cache hit
  of the head it reuses (cut to whole blocks, as vLLM caches them), timed from the engine's own steps, with
  nothing of kvrag's in between;
- `reuse` and `target_recompute` through kvrag's connector, with the entries read from the store (disk) and,
  when `memory_bytes` is given, again with them in the worker's memory tier (read and verified once before);
- kvrag's transformers engine: full prefill and `target_recompute`.
Every connector run starts with vLLM's prefix cache reset: a later run of the same plan would otherwise hit
the blocks the first one left cached, which is no reuse of stored KV at all. The floor and the connector's
plans run in rounds, one run of each a round after a first round that warms up: each round also gives a
paired ratio of `target_recompute` to its floor, and the row keeps every run (`runs`) beside the medians.

Throughput, for each concurrency N: N requests in flight at once from N threads (each its own question and
its own chunks, drawn from a shared pool, so no two prompts are the same), `answer_tokens` tokens each, on
vLLM (continuous batching: full prefill, and `target_recompute` through the connector) and on kvrag's
transformers engine (`target_recompute`, one forward at a time). Wall time for all N, answer tokens a second,
and the mean time to first token.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

CONNECTOR = ("reuse", "target_recompute")
BLOCK = 32  # vLLM's block size here
FLOOR = "floor: target + suffix over an exact cache hit of the head"
PAIRED = "connector target_recompute / floor, median of the rounds' ratios"
_floor_ids = itertools.count()


def run(
    folder: str | None = None,
    *,
    contexts: list[int],
    concurrency: list[int],
    runs: int = 3,
    answer_tokens: int = 32,
    chunk_tokens: int = 200,
    concurrent_context: int = 1000,
    storage_dtype: str = "float16",
    memory_bytes: int = 0,
    dtype: str = "auto",
    layerwise: bool | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from vllm import LLM

    from kvrag import KVModel
    from kvrag.cache.chunks import ChunkSource
    from kvrag.cache.secret import user_key
    from kvrag.cache.store import DiskStore
    from kvrag.lab.bench.ttft import context_texts
    from kvrag.model.catalog import resolve
    from vllm_kvrag.executor import VLLMExecutor, connector_config

    folder = resolve(folder)  # a named model's converted folder; None: the embedded default's
    root = tempfile.mkdtemp(prefix="kvrag-bench-vllm-")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where vLLM's build runs, kvrag's engine runs too
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    kv = KVModel.from_pretrained(folder, dtype=dtype, device=device)
    pool = context_texts(kv, max([*contexts, concurrent_context * max(concurrency, default=1) // 4]), chunk_tokens)
    longest = (
        len(kv.prefix) + sum(len(kv.layout.chunk_ids(t)) for t in pool[: _fit(kv, pool, max(contexts, default=0))]) + 64
    )
    extra: dict[str, Any] = {"store": "disk", "path": root, "storage_dtype": storage_dtype}
    if memory_bytes:
        extra["memory_bytes"] = memory_bytes
    if layerwise is not None:
        extra["layerwise"] = layerwise
    llm = LLM(
        model=folder,
        dtype=dtype,
        max_model_len=max(longest + answer_tokens, 2048),
        block_size=BLOCK,
        enforce_eager=True,
        gpu_memory_utilization=0.3,  # the share of the GPU's memory (on the CPU backend: of the host's) for paged KV
        max_num_seqs=max([*concurrency, 1]),
        kv_transfer_config=connector_config(extra),
    )
    store = DiskStore(root, storage_dtype)
    # keyed with the user's key, as kvrag's engine keys a disk store by default and the connector reads it
    store.secret = user_key()
    ex = VLLMExecutor(kv, llm, store, secret=store.secret)
    ChunkSource(kv, store, secret=store.secret).chunks(pool).kv()  # every chunk stored once, before any timing
    _check_readable(extra, kv, ex.prefix_key)
    result: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "storage_dtype": storage_dtype,
        "memory_bytes": memory_bytes,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype,
        "layerwise": layerwise,
        "answer_tokens": answer_tokens,
        "ttft": [],
        "throughput": [],
    }
    log(f"{result['device']}, {dtype}, threads {result['threads']}, entries stored as {storage_dtype}")
    question = "What does the documentation say about the first topic?"
    for size in contexts:
        texts = pool[: _fit(kv, pool, size)]
        row = _ttft_row(kv, llm, ex, store, texts, question, runs=runs, memory=bool(memory_bytes))
        result["ttft"].append(row)
        log(_ttft_line(row))
    for n in concurrency:
        row = _throughput_row(kv, llm, ex, store, pool, n, concurrent_context, answer_tokens)
        result["throughput"].append(row)
        log(_throughput_line(row))
    return result


def _check_readable(extra: dict[str, Any], kv: Any, key: str) -> None:
    """Read an entry as the connector's worker reads it (its store, its secret): an entry it cannot read is
    computed by vLLM, and the connector's rows would time vLLM's own prefill under the connector's name."""
    from kvrag.errors import KVRAGError
    from vllm_kvrag.config import open_store

    reader = open_store(extra)
    reader.bind(encoder=kv.encoder_id, dtype=None, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if reader.get(key) is None:
            where = extra.get("path") or extra.get("url")
            raise KVRAGError(f"the connector cannot read the bench's entries in {where} (written under another secret)")


def _fit(kv: Any, pool: list[str], tokens: int) -> int:
    """How many of the pool's first chunks hold at least `tokens` tokens."""
    total = 0
    for n, text in enumerate(pool, 1):
        total += len(kv.layout.chunk_ids(text))
        if total >= tokens:
            return n
    return len(pool)


def _answer(kv: Any, executor: Any, store: Any, question: str, texts: list[str], strategy: str, tokens: int) -> Any:
    from kvrag import Request
    from kvrag.cache.chunks import ChunkSource
    from kvrag.run import pipeline

    request = Request.of(question, texts, strategy=strategy, target=0, max_new_tokens=tokens)
    chunks = ChunkSource(kv, store, secret=store.secret).chunks(request.chunks)
    *_, final = pipeline.stream(kv, request, chunks, executor, started_at=time.perf_counter())
    return final


def _ttft_row(
    kv: Any, llm: Any, ex: Any, store: Any, texts: list[str], question: str, *, runs: int, memory: bool
) -> dict[str, Any]:
    def ttft(strategy: str, executor: Any = ex) -> float:
        return _answer(kv, executor, store, question, texts, strategy, 1).stats.ttft_s

    def cold(fn: Callable[[], float]) -> float:
        fn()  # warm
        times = []
        for _ in range(runs):
            llm.reset_prefix_cache()
            times.append(fn())
        return statistics.median(times)

    final = _answer(kv, kv.executor, store, question, texts, "reuse", 1)
    row: dict[str, Any] = {"context_tokens": final.stats.context_tokens}
    row["vllm full_prefill"] = cold(lambda: ttft("full_prefill"))
    ttft("full_prefill")  # the prompt is now in vLLM's prefix cache
    row["vllm exact prefix-cache hit"] = statistics.median(ttft("full_prefill") for _ in range(runs))
    # the floor: the head target_recompute reuses, cached exactly; then the target and the suffix computed
    layout = kv.layout
    ids = layout.prefix_ids + [t for c in [*texts[1:], texts[0]] for t in layout.chunk_ids(c)]
    ids += layout.suffix_ids(question)
    head = len(layout.prefix_ids) + sum(len(layout.chunk_ids(c)) for c in texts[1:])
    # vLLM's prefix cache holds whole blocks: the head is cut to whole blocks (at most BLOCK - 1 of its last
    # tokens dropped), so the floor computes exactly the target and the suffix, over a head at most that shorter
    aligned = head - head % BLOCK

    def floor() -> float:
        llm.reset_prefix_cache()
        _engine_ttft(ex, ids[:aligned])  # the head cached, untimed
        return _engine_ttft(ex, ids[:aligned] + ids[head:])

    def connector(strategy: str) -> float:
        llm.reset_prefix_cache()
        return ttft(strategy)

    # The floor and the connector's plans in rounds, one run of each a round (the first round warms up, and with
    # a memory tier fills it): a slow spell of the machine touches all of them alike, and each round gives one
    # paired ratio of target_recompute to its floor.
    suffix = ", memory tier" if memory else ""
    names = {"floor": FLOOR, **{s: f"connector {s}{suffix}" for s in CONNECTOR}}
    timed: dict[str, list[float]] = {name: [] for name in names.values()}
    for round_ in range(runs + 1):
        got = {FLOOR: floor(), **{names[s]: connector(s) for s in CONNECTOR}}
        if round_:
            for name, seconds in got.items():
                timed[name].append(seconds)
    for name, seconds in timed.items():
        row[name] = statistics.median(seconds)
    pairs = [c / f for c, f in zip(timed[names["target_recompute"]], timed[FLOOR])]
    row[PAIRED] = statistics.median(pairs)
    row["runs"] = timed
    row["kvrag transformers full_prefill"] = statistics.median(ttft("full_prefill", kv.executor) for _ in range(runs))
    row["kvrag transformers target_recompute"] = cold(lambda: ttft("target_recompute", kv.executor))
    return row


def _engine_ttft(ex: Any, ids: list[int]) -> float:
    """Seconds from handing vLLM's engine a prompt of token ids to its first token, stepped as the executor steps
    it (nothing of kvrag's in between: the floor's own path)."""
    from vllm import SamplingParams

    stepper, rid = ex._stepper, f"floor-{next(_floor_ids)}"
    t0 = time.perf_counter()
    stepper.add(rid, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0))
    while not stepper.next(rid).finished:
        pass
    stepper.forget(rid)
    return time.perf_counter() - t0


def _throughput_row(
    kv: Any, llm: Any, ex: Any, store: Any, pool: list[str], n: int, context: int, tokens: int
) -> dict[str, Any]:
    per = max(1, _fit(kv, pool, context))
    jobs = [
        (f"What does the documentation say about topic {i}?", [pool[(i * 3 + j) % len(pool)] for j in range(per)])
        for i in range(n)
    ]
    row: dict[str, Any] = {"concurrent": n, "context_tokens_each": context}
    for name, executor, strategy in (
        ("vllm full_prefill", ex, "full_prefill"),
        ("connector target_recompute", ex, "target_recompute"),
        ("kvrag transformers target_recompute", kv.executor, "target_recompute"),
    ):
        llm.reset_prefix_cache()
        finals: list[Any] = [None] * n
        failures: list[BaseException] = []

        def one(i: int) -> None:
            try:
                finals[i] = _answer(kv, executor, store, *jobs[i], strategy, tokens)
            except BaseException as err:  # re-raised below: a benchmark that lost a request reports nothing
                failures.append(err)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if failures:
            raise failures[0]
        answered = sum(len(f.token_ids) for f in finals)
        row[name] = {
            "wall_s": wall,
            "answer_tokens": answered,
            "tokens_per_s": answered / wall,
            "mean_ttft_s": statistics.mean(f.stats.ttft_s for f in finals),
        }
    return row


def _ttft_line(row: dict[str, Any]) -> str:
    return f"{row['context_tokens']} context tokens: " + ", ".join(
        f"{k} {v:.3f}" + ("" if k == PAIRED else " s") for k, v in row.items() if isinstance(v, float)
    )


def _throughput_line(row: dict[str, Any]) -> str:
    parts = [
        f"{k}: {v['wall_s']:.1f} s, {v['tokens_per_s']:.1f} tokens/s, mean ttft {v['mean_ttft_s']:.2f} s"
        for k, v in row.items()
        if isinstance(v, dict)
    ]
    return f"{row['concurrent']} concurrent, {row['context_tokens_each']} context tokens each: " + "; ".join(parts)


def markdown(result: dict[str, Any]) -> str:
    """The result as two tables: seconds to the first token, and throughput."""
    where = f"{result.get('device', 'cpu')}, {result.get('dtype', 'float32')}"
    layerwise = {None: "", True: ", layer by layer", False: ", whole before the forward"}[result.get("layerwise")]
    lines = [f"{where}, threads {result['threads']}, entries stored as {result['storage_dtype']}{layerwise}", ""]
    if result["ttft"]:
        names = [k for k, v in result["ttft"][0].items() if isinstance(v, float)]
        lines += ["| context tokens | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for row in result["ttft"]:
            lines.append(f"| {row['context_tokens']:,} | " + " | ".join(f"{row[k]:.3f}" for k in names) + " |")
        lines.append("")
    if result["throughput"]:
        lines += [
            f"| concurrent requests ({result['answer_tokens']} tokens each) | engine | wall s | answer tokens/s | "
            "mean ttft s |",
            "|---|---|---|---|---|",
        ]
        for row in result["throughput"]:
            for k, v in row.items():
                if isinstance(v, dict):
                    lines.append(
                        f"| {row['concurrent']} | {k} | {v['wall_s']:.1f} | {v['tokens_per_s']:.1f} | "
                        f"{v['mean_ttft_s']:.2f} |"
                    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrag bench-vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local model folder (default: kvrag's converted embedded model)")
    p.add_argument("--contexts", default="1000,2000,4000,8000", help="context sizes in tokens for time to first token")
    p.add_argument("--concurrency", default="8,32", help="concurrent requests for throughput ('' for none)")
    p.add_argument("--concurrent-context", type=int, default=1000, help="context tokens of each concurrent request")
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens of each concurrent request's answer")
    p.add_argument("--runs", type=int, default=3, help="timed runs of each time to first token, the median is kept")
    p.add_argument("--storage-dtype", default="float16", help="entries stored as (default float16, kvrag's default)")
    p.add_argument(
        "--memory-bytes",
        type=int,
        default=0,
        help="the connector's memory tier, in bytes (default 0: entries from disk)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the model's dtype in vLLM and in kvrag's engine (auto: bfloat16 on a GPU, float32 on CPU)",
    )
    p.add_argument(
        "--layerwise",
        default="auto",
        choices=["auto", "on", "off"],
        help="the connector loads layer by layer beside the forward (auto: on a GPU)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    from kvrag.errors import InvalidRequestError

    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise InvalidRequestError(f"--contexts and --concurrency take comma-separated integers, got {argv}") from None
    if min([*contexts, *concurrency, args.runs, args.answer_tokens, args.concurrent_context], default=1) < 1:
        raise InvalidRequestError(
            "--contexts, --concurrency, --runs, --answer-tokens and --concurrent-context take >= 1"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(
        args.model,
        contexts=contexts,
        concurrency=concurrency,
        runs=args.runs,
        answer_tokens=args.answer_tokens,
        concurrent_context=args.concurrent_context,
        storage_dtype=args.storage_dtype,
        memory_bytes=args.memory_bytes,
        dtype=args.dtype,
        layerwise={"auto": None, "on": True, "off": False}[args.layerwise],
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    result["command"] = "kvrag bench-vllm " + " ".join(shlex.quote(a) for a in argv)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from running this again
    main()
