"""The `kvrag` command line. User mistakes print one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from kvrag import __version__
from kvrag.errors import KVRAGError


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="Hugging Face model id or folder (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    parser.add_argument("--cache-dir", default=None, help="where converted default weights are kept")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrag", description="Reuse attention (KV) state in retrieval-augmented generation."
    )
    parser.add_argument("--version", action="version", version=f"kvrag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="retrieve and answer over a bundled excerpt of the Python docs, offline")
    _model_args(demo)
    demo.add_argument("--questions", type=int, default=3, help="how many bundled questions to ask (default 3)")
    demo.add_argument("--max-new-tokens", type=int, default=48)

    ingest = sub.add_parser("ingest", help="split, embed and encode documents into an index folder")
    ingest.add_argument("paths", nargs="+", type=Path, help=".txt, .md or .rst files, or folders of them")
    ingest.add_argument("--index", required=True, type=Path, help="the index folder (created if missing)")
    ingest.add_argument("--chunk-tokens", type=int, default=200)
    ingest.add_argument("--overlap", type=int, default=20)
    ingest.add_argument("--storage-dtype", default="float16", help="float16 (default), bfloat16, float32 or int8")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.add_argument("--redis", default=None, metavar="URL", help="keep chunk KV in Redis (redis:// or rediss://)")
    _model_args(ingest)

    ask = sub.add_parser("ask", help="answer a question from an index folder")
    ask.add_argument("question")
    ask.add_argument("--index", required=True, type=Path)
    ask.add_argument("--strategy", default="target_recompute")
    ask.add_argument("--picker", default=None, help="retriever, attention or oracle")
    ask.add_argument("--budget", type=float, default=0.05)
    ask.add_argument("--top-k", type=int, default=5)
    ask.add_argument("--hybrid", action="store_true", help="fuse dense and BM25 rankings")
    ask.add_argument("--max-new-tokens", type=int, default=256)
    ask.add_argument("--stream", action="store_true", help="print the answer as it is decoded")
    ask.add_argument("--json", action="store_true", help="print one JSON object: text, finish_reason, sources, stats")
    ask.add_argument("--redis", default=None, metavar="URL", help="read chunk KV from Redis (as given to ingest)")
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--threads", type=int, default=None)

    bench = sub.add_parser("bench-ingest", help="ingest throughput beside the model's raw batched forward")
    _model_args(bench)
    bench.add_argument("--copies", type=int, default=3, help="copies of the bundled docs to ingest (default 3)")
    bench.add_argument("--runs", type=int, default=3)

    info = sub.add_parser("info", help="counts, bytes and the model fingerprint of an index folder")
    info.add_argument("--index", required=True, type=Path)
    info.add_argument("--device", default="cpu")
    info.add_argument("--threads", type=int, default=None)
    return parser


def _run(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars are noise on a command line
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "demo":
        from kvrag.demo import run_demo

        load = dict(name_or_path=args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
        run_demo(load=load, questions=args.questions, max_new_tokens=args.max_new_tokens)
        return

    if args.command == "bench-ingest":
        from kvrag.bench import ingest_benchmark
        from kvrag.kvmodel import KVModel

        kv = KVModel.from_pretrained(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
        ingest_benchmark(kv, copies=args.copies, runs=args.runs)
        return

    from kvrag.engine import MANIFEST, KVRAG
    from kvrag.errors import IndexLoadError
    from kvrag.store import MemoryStore, RedisStore, TieredStore

    redis_url = getattr(args, "redis", None)
    store = (
        TieredStore(MemoryStore(), RedisStore(redis_url, storage_dtype=getattr(args, "storage_dtype", "float16")))
        if redis_url
        else None
    )

    if args.command == "ingest":
        fresh = not (args.index / MANIFEST).is_file()
        rag = KVRAG.from_defaults(
            args.index,
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            cache_dir=args.cache_dir,
            chunk_tokens=args.chunk_tokens,
            overlap=args.overlap,
            storage_dtype=args.storage_dtype,
            store=store,
        )
        stats = rag.ingest(list(args.paths), progress=not args.quiet)
        print(
            f"{'created' if fresh else 'updated'} {args.index}: {stats.documents} documents, {stats.chunks} chunks "
            f"({stats.tokens} tokens); KV encoded for {stats.encoded}, already stored for {stats.store_hits}; "
            f"{stats.seconds:.1f} s"
        )
        return
    if not (args.index / MANIFEST).is_file():
        raise IndexLoadError(
            f"no kvrag index at {args.index}: create one with `kvrag ingest PATH --index {args.index}`"
        )
    rag = KVRAG.load(args.index, device=args.device, store=store)
    if args.command == "info":
        print(json.dumps(rag.info(), indent=1))
        return
    kwargs = dict(
        strategy=args.strategy,
        picker=args.picker,
        budget=args.budget,
        top_k=args.top_k,
        hybrid=args.hybrid,
        max_new_tokens=args.max_new_tokens,
    )
    if args.stream and not args.json:
        for item in rag.stream(args.question, **kwargs):
            if isinstance(item, str):
                print(item, end="", flush=True)
        print()
        return
    answer = rag.query(args.question, **kwargs)
    if args.json:
        print(json.dumps(answer.to_dict(), ensure_ascii=False))
    else:
        print(answer.text.strip())
        print(
            f"\n[{answer.stats.strategy}, ttft {answer.stats.ttft_s:.3f} s, sources: "
            f"{', '.join(s.id for s in answer.sources)}]"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except (KVRAGError, ValueError, OSError) as err:
        print(f"kvrag: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
