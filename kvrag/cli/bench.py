"""`kvrag bench` and its kin: figures measured side by side in one process."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from kvrag.cli.common import compile_arg, import_vllm_kvrag, model_args, parse_csv
from kvrag.errors import InvalidRequestError


def add_bench(sub: Any) -> None:
    """`kvrag bench-ingest` and `kvrag bench`.
    Long by design: a flat list of the bench commands' options, one declaration each."""
    bench = sub.add_parser("bench-ingest", help="ingest throughput beside the model's raw batched forward")
    model_args(bench)
    bench.add_argument("--copies", type=int, default=3, help="copies of the bundled docs to ingest (default 3)")
    bench.add_argument("--runs", type=int, default=3, help="timed runs of each, the median is kept (default 3)")

    bench = sub.add_parser(
        "bench-decode", help="ms a decoded token after a kvrag prefill, beside the transformers step and the floor"
    )
    model_args(bench)
    bench.add_argument("--contexts", default="1000,4000", help="context sizes in tokens (default 1000,4000)")
    bench.add_argument("--tokens", type=int, default=32, help="tokens decoded a run (default 32)")
    bench.add_argument("--runs", type=int, default=3, help="timed runs of each, the median is kept (default 3)")
    bench.add_argument(
        "--rows",
        default=None,
        help="comma-separated decode rows to time (default every one: transformers_step, kvrag, kvrag_lookup, "
        "kvrag_quote, kvrag_lookup_quote, kvrag_int8, kvrag_int4, kvrag_small_pages, kvrag_torch, kvrag_compiled, "
        "memory_read, memory_read_int8, memory_read_int4); fewer rows take less time and memory",
    )

    bench = sub.add_parser(
        "bench-dtype", help="first-token KL and answer agreement of a lower-precision dtype against float32"
    )
    model_args(bench)
    bench.set_defaults(dtype="bfloat16")
    next(a for a in bench._actions if a.dest == "dtype").help = "the dtype compared with float32 (default bfloat16)"
    bench.add_argument("--items", type=int, default=20, help="built-in study items a family (default 20)")
    bench.add_argument("--max-new-tokens", type=int, default=32, help="most tokens an answer decodes (default 32)")
    bench.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")

    bench = sub.add_parser(
        "bench-answers",
        help="whole answers on the built-in study sets, each strategy through the engine: right, first token, answer",
    )
    model_args(bench)
    bench.add_argument("--data", default="builtin:all", help="builtin:NAME[,NAME...] or builtin:all (default)")
    bench.add_argument("--limit", type=int, default=10, help="items a built-in set (default 10)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the built-in generators (default 0)")
    bench.add_argument(
        "--strategies",
        default="full_prefill_top1,full_prefill_top3,default",
        help="comma-separated; default is the model's shipped default, a name ending in _int8 or _int4 that "
        "strategy decoded over those weights; after an @, marks joined by +: doc (chunks encoded in their "
        "documents' context) and a storage dtype (entries stored so and read back: default@doc+int4) "
        "(default: full_prefill_top1,full_prefill_top3,default)",
    )
    bench.add_argument("--max-new-tokens", type=int, default=48, help="most tokens an answer decodes (default 48)")
    bench.add_argument(
        "--whole",
        action="store_true",
        help="decode each answer to its end, as `kvrag ask` does (a list over several lines whole), not to its first "
        "line break",
    )
    bench.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="give each item's K best chunks by the embedder's scores, best first, as retrieval would (default: every "
        "chunk, in the item's order)",
    )
    bench.add_argument(
        "--header",
        choices=("shipped", "plain", "declining"),
        default="shipped",
        help="the prompt's context header: the model's shipped one (`kvrag models`), kvrag's own plain one, or one "
        "that asks the model to say 'The documents do not say.' where they are silent "
        "(kvrag.model.layout.DECLINING_HEADER; default: shipped)",
    )
    bench.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")

    bench = sub.add_parser(
        "bench-vllm",
        add_help=False,  # listed here only: `main` hands its arguments to vllm_kvrag.bench, --help included
        help="time to first token and concurrent throughput on vLLM through kvrag's connector, beside vLLM's own "
        "prefill and kvrag's engine (needs vllm-kvrag)",
    )

    bench = sub.add_parser(
        "bench",
        help="time to first token and a whole answer's time of every strategy beside full prefill and the floors; "
        "write bench.*",
    )
    model_args(bench)
    compile_arg(bench)
    bench.add_argument("--out", required=True, type=Path, help="folder for bench.json, bench.md and ttft.png")
    bench.add_argument(
        "--contexts",
        default=None,
        help="context sizes in tokens (default 1000,2000,4000,8000; long ones such as 16000,32000 are measured "
        "where they fit the model and the machine's free memory, else named as not measured)",
    )
    bench.add_argument(
        "--sections",
        default="ttft,ingest,storage",
        help="comma-separated: ttft (first token and whole answers a context size), ingest, storage "
        "(default all; ttft alone times the answers without the store and ingest sections)",
    )
    bench.add_argument("--chunk-tokens", type=int, default=None, help="tokens a chunk (default 200)")
    bench.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies, NAME:PICKER for a target strategy's picker (default: every study row)",
    )
    bench.add_argument("--runs", type=int, default=None, help="timed runs of each, the median is kept (default 5)")
    bench.add_argument(
        "--answer-tokens", type=int, default=None, help="tokens of the whole answers timed (default 32; 4 with --quick)"
    )
    bench.add_argument("--json", action="store_true", help="print bench.json instead of the markdown tables")
    bench.add_argument("--quick", action="store_true", help="tiny contexts, one run: checks that everything runs")


def _bench_ingest(args: argparse.Namespace) -> None:
    from kvrag.lab.bench.ttft import ingest_benchmark
    from kvrag.kvmodel import KVModel

    kv = KVModel.from_pretrained(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    ingest_benchmark(kv, copies=args.copies, runs=args.runs)


def _bench_decode(args: argparse.Namespace) -> None:
    from kvrag.lab.bench.decode import ROWS, decode_benchmark
    from kvrag.kvmodel import KVModel

    rows = parse_csv(args.rows, str, "--rows") if args.rows else None
    if rows is not None and set(rows) - set(ROWS):
        raise InvalidRequestError(f"--rows names unknown rows {sorted(set(rows) - set(ROWS))}: name some of "
                                  f"{', '.join(ROWS)}")
    kv = KVModel.from_pretrained(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    decode_benchmark(kv, contexts=contexts, tokens=args.tokens, runs=args.runs, rows=rows)


def _bench_dtype(args: argparse.Namespace) -> None:
    import torch

    from kvrag.lab.bench.dtype import dtype_quality, markdown
    from kvrag.kvmodel import KVModel
    from kvrag.model.loading import resolve_dtype

    if resolve_dtype(args.dtype, args.device) == torch.float32:
        raise InvalidRequestError(f"--dtype {args.dtype} is float32 here: give bfloat16 or float16 to compare")
    if not 1 <= args.items <= 10_000 or args.max_new_tokens < 1:
        raise InvalidRequestError(
            f"need --items in 1..10000 and --max-new-tokens >= 1, got {args.items}, {args.max_new_tokens}"
        )
    load = dict(device=args.device, cache_dir=args.cache_dir)
    reference = KVModel.from_pretrained(args.model, dtype="float32", **load)
    low = KVModel.from_pretrained(args.model, dtype=args.dtype, **load)
    result = dtype_quality(
        reference, low, limit=args.items, max_new_tokens=args.max_new_tokens, log=lambda m: print(m, file=sys.stderr)
    )
    result["command"] = "kvrag " + " ".join(shlex.quote(a) for a in args.argv)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))


def _bench_answers(args: argparse.Namespace) -> None:
    from kvrag.lab.bench.answers import keeping, markdown, quantized, whole_answers
    from kvrag.kvmodel import KVModel
    from kvrag.plan.strategies import get_strategy

    strategies = parse_csv(args.strategies, str, "--strategies")
    for name in strategies:
        try:
            keeping(name)
        except ValueError as err:
            raise InvalidRequestError(f"--strategies: {err}") from None
        base = quantized(name.partition("@")[0])[0].removesuffix("+parts").partition(":")[0]
        if base != "default":
            get_strategy(base)  # an unknown name is refused before the model loads
    if args.top_k is not None and args.top_k < 1:
        raise InvalidRequestError(f"--top-k must be at least 1, got {args.top_k}")
    if not 1 <= args.limit <= 10_000 or args.max_new_tokens < 1:
        raise InvalidRequestError(f"need --limit in 1..10000 and --max-new-tokens >= 1, got {args.limit}, "
                                  f"{args.max_new_tokens}")
    # a plain name decodes over the model's own weights, `_int8` and `_int4` over copies: each row says which
    from kvrag.model.layout import HEADERS

    chosen = {"header": HEADERS[args.header]} if args.header in HEADERS else {}  # else the model's shipped one
    kv = KVModel.from_pretrained(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir,
                                 decode_weights="model", **chosen)
    result = whole_answers(kv, data=args.data, limit=args.limit, seed=args.seed, strategies=strategies,
                           max_new_tokens=args.max_new_tokens, top_k=args.top_k, to_line_break=not args.whole,
                           log=lambda m: print(m, file=sys.stderr))
    result["header"] = kv.layout.header
    result["command"] = "kvrag " + " ".join(shlex.quote(a) for a in args.argv)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))


def _bench_vllm(args: argparse.Namespace) -> None:
    import_vllm_kvrag("kvrag bench-vllm")
    from vllm_kvrag.bench import main

    main(args.rest)


def _bench(args: argparse.Namespace) -> None:
    from kvrag.lab.bench.report import SECTIONS, run_bench
    from kvrag.kvmodel import KVModel
    from kvrag.plan.pickers import get_picker
    from kvrag.plan.strategies import BUILTIN_STRATEGIES, get_strategy

    quick = args.quick
    contexts = parse_csv(args.contexts or ("150,300" if quick else "1000,2000,4000,8000"), int, "--contexts")
    strategies = parse_csv(args.strategies, str, "--strategies") if args.strategies else list(BUILTIN_STRATEGIES)
    for name in strategies:  # NAME, NAME:PICKER or default (the model's shipped default)
        if name == "default":
            continue
        strategy, _, picker = name.partition(":")
        get_strategy(strategy)
        if picker:
            get_picker(picker)
    sections = parse_csv(args.sections, str, "--sections")
    if set(sections) - set(SECTIONS):
        raise InvalidRequestError(f"--sections names unknown sections {sorted(set(sections) - set(SECTIONS))}: name "
                                  f"some of {', '.join(SECTIONS)}")
    chunk_tokens = args.chunk_tokens or (50 if quick else 200)
    runs = args.runs or (1 if quick else 5)
    answer_tokens = args.answer_tokens if args.answer_tokens is not None else (4 if quick else 32)
    if runs < 1 or chunk_tokens < 8 or min(contexts) < chunk_tokens or answer_tokens < 2:
        raise InvalidRequestError(
            f"need --runs >= 1, --chunk-tokens >= 8, --answer-tokens >= 2 and every context at least one chunk long, "
            f"got runs {runs}, chunk tokens {chunk_tokens}, answer tokens {answer_tokens}, contexts {contexts}"
        )
    kv = KVModel.from_pretrained(
        args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        compile_decode=args.compile_decode,
        decode_weights=args.decode_weights,
        cpu_kernels=args.cpu_kernels,
    )
    command = "kvrag " + " ".join(shlex.quote(a) for a in args.argv)
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    result = run_bench(
        kv,
        args.out,
        contexts=contexts,
        chunk_tokens=chunk_tokens,
        strategies=strategies,
        runs=runs,
        answer_tokens=answer_tokens,
        quick=quick,
        sections=sections,
        command=command,
        log=log,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print((args.out / "bench.md").read_text())


def _with_peak_memory(command: Any) -> Any:
    """A bench command whose output ends with the process's memory high-water mark (what the run needed at most)."""

    def run(args: argparse.Namespace) -> None:
        command(args)
        import torch

        from kvrag.lab.bench.ttft import peak_memory_line

        device = torch.device(args.device) if getattr(args, "device", None) else None
        print(peak_memory_line(device), file=sys.stderr if getattr(args, "json", False) else sys.stdout)

    return run


COMMANDS = {
    "bench-ingest": _with_peak_memory(_bench_ingest),
    "bench-decode": _with_peak_memory(_bench_decode),
    "bench-dtype": _with_peak_memory(_bench_dtype),
    "bench-answers": _with_peak_memory(_bench_answers),
    "bench-vllm": _bench_vllm,  # its memory is the serving engine's, in processes of its own
    "bench": _with_peak_memory(_bench),
}
