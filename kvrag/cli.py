"""The `kvrag` command line. User mistakes print one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from kvrag import __version__
from kvrag.errors import InvalidRequestError, KVRAGError


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a named model (`kvrag models`: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a Hugging Face "
        "model id or a folder (default: the embedded smollm2-135m)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    parser.add_argument("--cache-dir", default=None, help="where converted named models are kept")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def _compile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="where the C decode step does not take the model: decode through torch.compile'd layer steps (seconds "
        "of compiling at the first token, faster after)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrag", description="Reuse attention (KV) state in retrieval-augmented generation."
    )
    parser.add_argument("--version", action="version", version=f"kvrag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    adders = (_add_demo, _add_models, _add_ingest, _add_ask, _add_agree_and_tune, _add_bench, _add_study, _add_info)
    for add in (*adders, _add_gc):
        add(sub)
    return parser


def _add_demo(sub: Any) -> None:
    """`kvrag demo`."""
    demo = sub.add_parser("demo", help="retrieve and answer over a bundled excerpt of the Python docs, offline")
    _model_args(demo)
    _compile_arg(demo)
    demo.add_argument("--questions", type=int, default=3, help="how many bundled questions to ask (default 3)")
    demo.add_argument("--max-new-tokens", type=int, default=48)


def _add_models(sub: Any) -> None:
    """`kvrag models`."""
    models = sub.add_parser("models", help="the models kvrag installs offline: size, installed or not, where, how")
    models.add_argument("--cache-dir", default=None, help="where converted named models are kept")
    models.add_argument("--json", action="store_true", help="one JSON object a model instead of a table")
    models.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)


def _add_ingest(sub: Any) -> None:
    """`kvrag ingest`."""
    ingest = sub.add_parser("ingest", help="split, embed and encode documents into an index folder")
    ingest.add_argument("paths", nargs="+", type=Path, help=".txt, .md or .rst files, or folders of them")
    ingest.add_argument("--index", required=True, type=Path, help="the index folder (created if missing)")
    # The index flags default to None: a flag left out takes an existing index's value (or, for a fresh index,
    # the default its help states); one given must agree with the index (`_index_settings`).
    ingest.add_argument("--chunk-tokens", type=int, default=None, help="tokens a chunk (default 200)")
    ingest.add_argument("--overlap", type=int, default=None, help="tokens shared by neighbouring chunks (default 20)")
    ingest.add_argument("--storage-dtype", default=None, help="float16 (default), bfloat16, float32 or int8")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.add_argument("--redis", default=None, metavar="URL", help="keep chunk KV in Redis (redis:// or rediss://)")
    ingest.add_argument(
        "--namespace", default=None, help="a tenant name in every chunk's store key (kept in the index; default: none)"
    )
    ingest.add_argument(
        "--follow-symlinks", action="store_true", help="read files and folders reached through symbolic links"
    )
    ingest.add_argument("--max-file-mb", type=float, default=None, help="the largest input file read (default 64)")
    _secret_arg(ingest)
    _model_args(ingest)
    ingest.set_defaults(dtype=None)  # "auto", unless the index at --index was built with another


def _add_ask(sub: Any) -> None:
    """`kvrag ask`."""
    ask = sub.add_parser("ask", help="answer a question from an index folder")
    ask.add_argument("question")
    ask.add_argument("--index", required=True, type=Path)
    ask.add_argument(
        "--strategy",
        default=None,
        help="default: the index's tuned default (kvrag tune), else kvrag.defaults' for the model",
    )
    ask.add_argument(
        "--picker",
        default=None,
        help="retriever, attention, likelihood, lexical, fused or oracle; set pickers (for set_recompute, set_only): "
        "top2, top3, likelihood2, diverse2",
    )
    ask.add_argument("--budget", type=float, default=None, help="default: the tuned default's, else 0.05")
    ask.add_argument("--top-k", type=int, default=5)
    ask.add_argument("--bm25", "--hybrid", dest="bm25", action="store_true", help="fuse dense and BM25 rankings")
    ask.add_argument("--max-new-tokens", type=int, default=256)
    ask.add_argument(
        "--parts",
        default=None,
        metavar="auto|Q1;;Q2",
        help="answer a part at a time over the same chunks: auto (kvrag's splitter: 'What is A, and who is B?', "
        "'... of each of X, Y and Z?'; a question it cannot split is answered whole), or the parts separated by ';;' "
        "(a part holding {answer} takes the previous part's answer); printed whole, --stream aside",
    )
    ask.add_argument("--stream", action="store_true", help="print the answer as it is decoded")
    ask.add_argument("--json", action="store_true", help="print one JSON object: text, finish_reason, sources, stats")
    ask.add_argument("--redis", default=None, metavar="URL", help="read chunk KV from Redis (as given to ingest)")
    _secret_arg(ask)
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--threads", type=int, default=None)
    _compile_arg(ask)
    ask.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="what runs the plan: kvrag's transformers engine (default) or vLLM through kvrag's connector (vllm-kvrag; "
        "it stores the prompt prefix's KV, which the connector loads, if the store lacks it)",
    )
    ask.add_argument(
        "--vllm-server",
        default=None,
        metavar="URL",
        help="with --backend vllm: a `vllm serve` that loads the connector",
    )


def _add_agree_and_tune(sub: Any) -> None:
    """`kvrag agree` and `kvrag tune` (the same options)."""
    from kvrag.study.agreement import DEFAULT_BUDGETS, DEFAULT_CANDIDATES, DEFAULT_FLOOR

    for name, what in (
        ("agree", "how often each strategy's answer is full prefill's, on an index and a file of your questions"),
        (
            "tune",
            "measure agreement (as kvrag agree), choose the fastest strategy above a floor, save it as the index's default",
        ),
    ):
        tune = sub.add_parser(name, help=what)
        tune.add_argument("--index", required=True, type=Path)
        tune.add_argument("--questions", required=True, type=Path, help="one question a line (a query log)")
        tune.add_argument("--out", required=True, type=Path, help="where results.json, table.md, agreement.png go")
        tune.add_argument(
            "--candidates",
            default=",".join(DEFAULT_CANDIDATES),
            help="comma-separated strategies, NAME:PICKER fixes a picker (default: %(default)s)",
        )
        tune.add_argument(
            "--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), help="budgets of budgeted strategies"
        )
        tune.add_argument("--floor", type=float, default=DEFAULT_FLOOR, help="agreement to reach (default 0.9)")
        tune.add_argument("--top-k", type=int, default=5)
        tune.add_argument("--limit", type=int, default=None, help="the first N questions only")
        tune.add_argument("--max-new-tokens", type=int, default=32, help="answers also end at a line break")
        tune.add_argument("--redis", default=None, metavar="URL", help="read chunk KV from Redis (as given to ingest)")
        _secret_arg(tune)
        tune.add_argument("--device", default="cpu")
        tune.add_argument("--threads", type=int, default=None)
        tune.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_bench(sub: Any) -> None:
    """`kvrag bench-ingest` and `kvrag bench`."""
    bench = sub.add_parser("bench-ingest", help="ingest throughput beside the model's raw batched forward")
    _model_args(bench)
    bench.add_argument("--copies", type=int, default=3, help="copies of the bundled docs to ingest (default 3)")
    bench.add_argument("--runs", type=int, default=3)

    bench = sub.add_parser(
        "bench-decode", help="ms a decoded token after a kvrag prefill, beside the transformers step and the floor"
    )
    _model_args(bench)
    bench.add_argument("--contexts", default="1000,4000", help="context sizes in tokens (default 1000,4000)")
    bench.add_argument("--tokens", type=int, default=32, help="tokens decoded a run (default 32)")
    bench.add_argument("--runs", type=int, default=3, help="timed runs of each, the median is kept (default 3)")

    bench = sub.add_parser(
        "bench-dtype", help="first-token KL and answer agreement of a lower-precision dtype against float32"
    )
    _model_args(bench)
    bench.set_defaults(dtype="bfloat16")
    next(a for a in bench._actions if a.dest == "dtype").help = "the dtype compared with float32 (default bfloat16)"
    bench.add_argument("--items", type=int, default=20, help="built-in study items a family (default 20)")
    bench.add_argument("--max-new-tokens", type=int, default=32)
    bench.add_argument("--out", type=Path, default=None, help="write the result as JSON to this file")

    bench = sub.add_parser(
        "bench-vllm",
        add_help=False,  # listed here only: `main` hands its arguments to vllm_kvrag.bench, --help included
        help="time to first token and concurrent throughput on vLLM through kvrag's connector, beside vLLM's own "
        "prefill and kvrag's engine (needs vllm-kvrag)",
    )

    bench = sub.add_parser(
        "bench",
        help="time to first token and a whole answer's time of every strategy beside full prefill and the floors; write "
        "bench.*",
    )
    _model_args(bench)
    _compile_arg(bench)
    bench.add_argument("--out", required=True, type=Path, help="folder for bench.json, bench.md and ttft.png")
    bench.add_argument("--contexts", default=None, help="context sizes in tokens (default 1000,2000,4000,8000)")
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


def _add_study(sub: Any) -> None:
    """`kvrag study`."""
    study = sub.add_parser(
        "study", help="run every repair strategy over study data; write results.json, table.md and plots"
    )
    study.add_argument(
        "--data", required=True, help="FILE.jsonl, builtin:NAME[,NAME...] (api_docs, open_qa, dialogue) or builtin:all"
    )
    study.add_argument("--out", required=True, type=Path, help="output folder (its cache/ makes reruns resume)")
    study.add_argument(
        "--strategies",
        default=None,
        help="comma-separated; NAME:PICKER fixes a target strategy's picker, NAME@lead encodes its chunks behind a "
        "neutral lead (default: full_prefill_top1,full_prefill_top3,reuse,reorder,insert_full_kv,spread,"
        "target_recompute,target_recompute:oracle,token_select,attention_select); full prefill and closed book are "
        "always measured",
    )
    study.add_argument(
        "--pickers", default="retriever", help="pickers of target strategies given without one (default: %(default)s)"
    )
    study.add_argument("--budget", type=float, default=None, help="one budget (default 0.05)")
    study.add_argument("--budgets", default=None, help="comma-separated budgets, e.g. 0.01,0.02,0.05,0.1,0.2")
    study.add_argument(
        "--limit",
        type=int,
        default=None,
        help="items per file or per built-in set (default: all of a file, 200 of a built-in set)",
    )
    study.add_argument("--seed", type=int, default=0, help="seed of the built-in generators")
    study.add_argument("--chunks", default="8-10", help="chunks a built-in question, MIN-MAX (default %(default)s)")
    study.add_argument("--max-new-tokens", type=int, default=32, help="answers also end at a line break")
    study.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="run every N-th item from the I-th (0-based): shards may share one --out (each appends to its own "
        "cache files) or run on other machines, their cache/*.jsonl then copied into one folder",
    )
    study.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes, each with its own model and --threads divided among them (default 1; on a CPU, "
        "one per core is fastest)",
    )
    study.add_argument("--quiet", action="store_true", help="no progress bar")
    study.add_argument(
        "--report-only",
        action="store_true",
        help="compute nothing: write the results of the items whose every row is already in --out's cache",
    )
    _model_args(study)
    compare = sub.add_parser(
        "study-compare", help="several study runs side by side (e.g. one data set on several models), one column a run"
    )
    compare.add_argument("runs", nargs="+", type=Path, help="study --out folders (each holds results.json)")
    compare.add_argument("--out", required=True, type=Path, help="where compare.md and compare_accuracy.png go")
    compare.add_argument("--budget", type=float, default=0.05, help="the budget of budgeted rows (default 0.05)")
    compare.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)


def _add_info(sub: Any) -> None:
    """`kvrag info`."""
    info = sub.add_parser("info", help="counts, bytes and the model fingerprint of an index folder (read-only)")
    info.add_argument("--index", required=True, type=Path)
    info.add_argument("--redis", default=None, metavar="URL", help="count the chunk KV in Redis (as given to ingest)")
    _secret_arg(info)
    info.add_argument("--device", default="cpu")
    info.add_argument("--threads", type=int, default=None)


def _add_gc(sub: Any) -> None:
    """`kvrag gc`."""
    gc = sub.add_parser(
        "gc", help="delete stored chunk KV that no indexed chunk refers to, and dead writers' temporary files"
    )
    gc.add_argument("--index", required=True, type=Path)
    gc.add_argument("--redis", default=None, metavar="URL", help="collect in Redis (needs --exclusive)")
    gc.add_argument(
        "--exclusive",
        action="store_true",
        help="with --redis: this index is the only one writing to that Redis namespace (else another index's entries "
        "would look like orphans)",
    )
    gc.add_argument("--dry-run", action="store_true", help="count what would be removed, remove nothing")
    _secret_arg(gc)
    gc.add_argument("--device", default="cpu")
    gc.add_argument("--threads", type=int, default=None)


def _secret_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="a file holding the tenant secret the index was built with (keys and checksums are HMACs under it)",
    )


def _secret(args: argparse.Namespace) -> bytes | None:
    """The tenant secret in --secret-file (surrounding whitespace dropped), or None."""
    path = getattr(args, "secret_file", None)
    if path is None:
        return None
    try:
        secret = path.read_bytes().strip()
    except OSError as err:
        raise InvalidRequestError(f"cannot read the secret file {path}: {err.strerror}") from None
    if len(secret) < 16:
        raise InvalidRequestError(
            f"the secret file {path} holds {len(secret)} bytes: a secret needs at least 16 (`openssl rand -hex 32`)"
        )
    return secret


def _run(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars are noise on a command line
    if args.threads is not None:
        if not 1 <= args.threads <= 1024:
            raise InvalidRequestError(f"--threads must be in 1..1024, got {args.threads}")
        torch.set_num_threads(args.threads)
    COMMANDS[args.command](args)


def _demo(args: argparse.Namespace) -> None:
    from kvrag.demo import run_demo

    load = dict(
        name_or_path=args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        compile_decode=args.compile_decode,
    )
    run_demo(load=load, questions=args.questions, max_new_tokens=args.max_new_tokens)


def _models(args: argparse.Namespace) -> None:
    from kvrag.catalog import MODELS, status

    rows = [status(m, args.cache_dir) for m in MODELS.values()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{'name':<20}{'size':>6}  {'GGUF':>9}  {'installed':<10} {'converted':<10} where / how to install")
    for row in rows:
        where = row["converted"] or row["gguf"] if row["installed"] else f"`{row['install']}`"
        installed, converted = ("yes" if row[k] else "no" for k in ("installed", "converted"))
        size = f"{row['gguf_bytes'] / 1e6:>7.0f}MB"
        print(f"{row['name']:<20}{row['params']:>6}  {size}  {installed:<10} {converted:<10} {where}")


def _study_compare(args: argparse.Namespace) -> None:
    from kvrag.study.compare import write

    for path in write(args.runs, args.out, args.budget):
        print(path)


def _bench_ingest(args: argparse.Namespace) -> None:
    from kvrag.bench import ingest_benchmark
    from kvrag.kvmodel import KVModel

    kv = KVModel.from_pretrained(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    ingest_benchmark(kv, copies=args.copies, runs=args.runs)


def _bench_decode(args: argparse.Namespace) -> None:
    from kvrag.bench_decode import decode_benchmark
    from kvrag.kvmodel import KVModel

    kv = KVModel.from_pretrained(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    decode_benchmark(kv, contexts=contexts, tokens=args.tokens, runs=args.runs)


def _bench_dtype(args: argparse.Namespace) -> None:
    import torch

    from kvrag.bench_dtype import dtype_quality, markdown
    from kvrag.kvmodel import KVModel
    from kvrag.model import resolve_dtype

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


def _store(args: argparse.Namespace, *, read_only: bool = False) -> Any:
    """The KV store the command names (Redis behind memory), or None for the index folder's own."""
    from kvrag.store import MemoryStore, RedisStore, TieredStore

    redis_url = getattr(args, "redis", None)
    if not redis_url:
        return None
    storage = getattr(args, "storage_dtype", None) or "float16"
    return TieredStore(MemoryStore(), RedisStore(redis_url, storage_dtype=storage, read_only=read_only))


def _index_is_a_folder(index: Path) -> None:
    """Refuse an --index that names something other than a folder (a file is not an index, and ingest cannot make
    a folder there)."""
    if index.exists() and not index.is_dir():
        raise InvalidRequestError(f"--index {index} is a file, not an index folder: give a folder's path")


def _open_index(args: argparse.Namespace, *, read_only: bool = True) -> Any:
    """The engine over an existing index folder; read-only unless the command writes (tune, gc)."""
    from kvrag.engine import KVRAG
    from kvrag.errors import IndexLoadError
    from kvrag.folder import IndexFolder

    _index_is_a_folder(args.index)
    if not IndexFolder(args.index).exists():
        raise IndexLoadError(
            f"no kvrag index at {args.index}: create one with `kvrag ingest PATH --index {args.index}`"
        )
    return KVRAG.load(
        args.index,
        device=args.device,
        store=_store(args, read_only=read_only),
        require_store=True,
        secret=_secret(args),
        read_only=read_only,
        compile_decode=getattr(args, "compile_decode", False),
    )


def _interruptible(work: Callable[[], Any], *, interrupted: str) -> Any:
    """`work()` in a worker thread, so Ctrl-C ends the command within a fraction of a second even while a
    forward of many seconds runs; every write kvrag makes is atomic, so what committed stays whole."""
    import os
    import threading

    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as err:  # re-raised in the main thread
            failure.append(err)

    worker = threading.Thread(target=run, name="kvrag-ingest", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr, flush=True)
        os._exit(130)  # the worker cannot be stopped mid-forward; exiting now is what a user asked for
    if failure:
        raise failure[0]
    return result[0]


def _ingest(args: argparse.Namespace) -> None:
    from kvrag.documents import MAX_FILE_BYTES
    from kvrag.engine import KVRAG, MANIFEST

    _index_is_a_folder(args.index)
    fresh = not (args.index / MANIFEST).is_file()
    _index_settings(args)
    rag = KVRAG.from_defaults(
        args.index,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        chunk_tokens=args.chunk_tokens,
        overlap=args.overlap,
        storage_dtype=args.storage_dtype,
        store=_store(args),
        namespace=args.namespace,
        require_store=True,
        secret=_secret(args),
    )
    if args.max_file_mb is not None and not 0 < args.max_file_mb <= 1 << 20:
        raise InvalidRequestError(f"--max-file-mb must be a positive number of megabytes, got {args.max_file_mb}")
    max_bytes = int(args.max_file_mb * (1 << 20)) if args.max_file_mb is not None else MAX_FILE_BYTES
    stats = _interruptible(
        lambda: rag.ingest(
            list(args.paths), progress=not args.quiet, follow_symlinks=args.follow_symlinks, max_file_bytes=max_bytes
        ),
        interrupted=f"kvrag: interrupted; the index at {args.index} is as last committed (the KV already encoded "
        "is kept: ingesting again reuses it, `kvrag gc` removes it)",
    )
    print(
        f"{'created' if fresh else 'updated'} {args.index}: {stats.documents} documents, {stats.chunks} chunks "
        f"({stats.tokens} tokens); KV encoded for {stats.encoded}, already stored for {stats.store_hits}; "
        f"{stats.seconds:.1f} s"
    )


# ingest's index flags: the manifest key each is kept under, and its default for a fresh index.
_INDEX_FLAGS = {
    "model": ("--model", None),
    "dtype": ("--dtype", "auto"),
    "chunk_tokens": ("--chunk-tokens", 200),
    "overlap": ("--overlap", 20),
    "storage_dtype": ("--storage-dtype", "float16"),
    "namespace": ("--namespace", ""),
}


def _index_settings(args: argparse.Namespace) -> None:
    """Fill ingest's index flags left out: from the index at --index, else the defaults.

    A flag given with a value other than the one the existing index was built with is an InvalidRequestError
    naming both (the index keeps its own: ingesting would otherwise ignore the flag, or mix chunkings).
    `--dtype auto` states no preference; `--model` must be the model as the index names it.
    """
    from kvrag.folder import IndexFolder
    from kvrag.model import resolve_dtype

    folder = IndexFolder(args.index, read_only=True, secret=_secret(args) or b"")
    if not folder.exists():
        for key, (_, default) in _INDEX_FLAGS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        return
    manifest = folder.manifest()
    for key, (flag, default) in _INDEX_FLAGS.items():
        given, built = getattr(args, key), manifest.get(key, default)
        if key == "dtype" and given is not None:
            given = None if given == "auto" else str(resolve_dtype(given, args.device)).removeprefix("torch.")
        same = given is None or given == built or (key == "model" and built is not None and _same_folder(given, built))
        if not same:
            shown = "None (the embedded default)" if built is None else shlex.quote(str(built))
            raise InvalidRequestError(
                f"{flag} {shlex.quote(str(getattr(args, key)))} conflicts with the index at {args.index}, built with "
                f"{key} {shown}: drop the flag or ingest into a new folder"
            )
        setattr(args, key, built)


def _same_folder(a: str, b: str) -> bool:
    """Whether two model names are one local folder, written differently."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def _info(args: argparse.Namespace) -> None:
    info = _open_index(args).info()
    print(json.dumps(info, indent=1))
    ingested = info.get("kv_store_at_ingest")
    if isinstance(ingested, str) and ingested.startswith("memory in front of redis") and not args.redis:
        print(
            f"kvrag: the KV of this index was stored in {ingested.split(' in front of ')[1]}: pass --redis URL to "
            "count those entries (the counts above are of the index folder's own kv/)",
            file=sys.stderr,
        )


def _gc(args: argparse.Namespace) -> None:
    if args.redis and not args.exclusive:
        raise InvalidRequestError(
            "--redis needs --exclusive: a Redis namespace may hold other indexes' entries, which this index would "
            "take for orphans. Pass --exclusive only if this index alone writes to it"
        )
    rag = _open_index(args, read_only=args.dry_run)  # a dry run opens read-only: it sweeps nothing either
    done = rag.gc(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{args.index}: {verb} {done['orphan_entries']} orphan KV entries and {done['temp_files']} temporary files "
        f"from {rag.info()['kv_store']}"
    )


def _ask(args: argparse.Namespace) -> None:
    if args.backend != "vllm" and args.vllm_server:
        raise InvalidRequestError("--vllm-server goes with --backend vllm")
    # vLLM's connector needs the prompt prefix's KV in the store: the vLLM backend stores it if it is missing
    rag = _open_index(args, read_only=args.backend != "vllm")
    if args.backend == "vllm":
        _on_vllm(rag, args)
    kwargs = dict(
        strategy=args.strategy,
        picker=args.picker,
        budget=args.budget,
        top_k=args.top_k,
        bm25=args.bm25,
        max_new_tokens=args.max_new_tokens,
    )
    if args.parts is not None:
        parts = args.parts if args.parts == "auto" else [p for p in args.parts.split(";;")]
        kwargs["parts"] = parts
    if args.stream and not args.json and args.parts is None:
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


def _vllm_kvrag(what: str) -> Any:
    """The vllm_kvrag package, or a clear error saying where it is installed."""
    import os

    # A command's stdout is its result (--json: one object): vLLM's log goes to stderr, warnings and worse
    # only, unless the environment says otherwise (vLLM's own variables). Set before vLLM is imported.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm_kvrag.attach

        return vllm_kvrag
    except ImportError as err:
        raise InvalidRequestError(
            f"{what} needs vllm-kvrag and vLLM ({err}): `make install-vllm` puts both in .venv-vllm; run "
            f"`.venv-vllm/bin/kvrag ...` from there, or `pip install -e integrations/vllm-kvrag` beside vLLM"
        ) from None


def _on_vllm(rag: Any, args: argparse.Namespace) -> None:
    """Hand the engine's plans to vLLM: an in-process engine with kvrag's connector, or a `vllm serve`."""
    if args.compile_decode:
        raise InvalidRequestError("--compile-decode is kvrag's transformers decode: vLLM decodes with its own")
    vllm_kvrag = _vllm_kvrag("--backend vllm")
    secret_file = str(args.secret_file) if args.secret_file else None  # the connector verifies under the same secret
    vllm_kvrag.attach.attach(rag, server=args.vllm_server, secret_file=secret_file)


def _bench_vllm(args: argparse.Namespace) -> None:
    _vllm_kvrag("kvrag bench-vllm")
    from vllm_kvrag.bench import main

    main(args.rest)


def _csv(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidRequestError(f"{what} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise InvalidRequestError(f"{what} is empty: give at least one")
    return values


def _bench(args: argparse.Namespace) -> None:
    from kvrag.bench_report import run_bench
    from kvrag.kvmodel import KVModel
    from kvrag.pickers import get_picker
    from kvrag.strategies import BUILTIN_STRATEGIES, get_strategy

    quick = args.quick
    contexts = _csv(args.contexts or ("150,300" if quick else "1000,2000,4000,8000"), int, "--contexts")
    strategies = _csv(args.strategies, str, "--strategies") if args.strategies else list(BUILTIN_STRATEGIES)
    for name in strategies:  # NAME, NAME:PICKER or default (the model's shipped default)
        if name == "default":
            continue
        strategy, _, picker = name.partition(":")
        get_strategy(strategy)
        if picker:
            get_picker(picker)
    chunk_tokens = args.chunk_tokens or (50 if quick else 200)
    runs = args.runs or (1 if quick else 5)
    answer_tokens = args.answer_tokens if args.answer_tokens is not None else (4 if quick else 32)
    if runs < 1 or chunk_tokens < 8 or min(contexts) < chunk_tokens or answer_tokens < 2:
        raise InvalidRequestError(
            f"need --runs >= 1, --chunk-tokens >= 8, --answer-tokens >= 2 and every context at least one chunk long, "
            f"got runs {runs}, chunk tokens {chunk_tokens}, answer tokens {answer_tokens}, contexts {contexts}"
        )
    kv = KVModel.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir, compile_decode=args.compile_decode
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
        command=command,
        log=log,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print((args.out / "bench.md").read_text())


def _tune(args: argparse.Namespace) -> None:
    from kvrag.study.agreement import candidates, read_questions, run_tune

    configs = candidates(_csv(args.candidates, str, "--candidates"), _csv(args.budgets, float, "--budgets"))
    questions = read_questions(args.questions)[: args.limit] if args.limit is None or args.limit >= 1 else []
    if not questions:
        raise InvalidRequestError(f"--limit must be at least 1, got {args.limit}")
    results = run_tune(
        _open_index(args, read_only=args.command == "agree"),
        questions,
        args.out,
        configs=configs,
        floor=args.floor,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        save=args.command == "tune",
        command="kvrag " + " ".join(shlex.quote(a) for a in args.argv),
        progress=not args.quiet,
    )
    c = results["choice"]
    picker = f" ({c['picker']})" if c["picker"] else ""
    where = f"; saved as the default of {args.index}" if results.get("saved") else ""
    floor = "" if c["reached_floor"] else f" (no candidate reached {100 * args.floor:.0f}%)"
    print(
        f"{len(questions)} questions: {c['strategy']}{picker} at budget {c['budget']:g}, agreement "
        f"{100 * c['agreement']:.1f}%, {c['ttft_s']:.3f} s to the first token{floor}{where}; "
        f"table in {args.out / 'table.md'}"
    )


def _study(args: argparse.Namespace) -> None:
    from kvrag.kvmodel import KVModel
    from kvrag.request import check_budget
    from kvrag.study import StudyConfig, load_items, run_study
    from kvrag.study.runner import DEFAULT_STRATEGIES

    if args.budget is not None and args.budgets is not None:
        raise InvalidRequestError("give --budget or --budgets, not both")
    budgets = [args.budget] if args.budget is not None else _csv(args.budgets or "0.05", float, "--budgets")
    for budget in budgets:
        check_budget(budget)
    try:
        lo, hi = (int(x) for x in args.chunks.split("-"))
    except ValueError:
        raise InvalidRequestError(f"--chunks must be MIN-MAX, e.g. 8-10, got {args.chunks!r}") from None
    if args.limit is not None and args.limit < 1:
        raise InvalidRequestError(f"--limit must be at least 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    config = StudyConfig(
        strategies=_csv(args.strategies, str, "--strategies") if args.strategies else DEFAULT_STRATEGIES,
        pickers=_csv(args.pickers, str, "--pickers"),
        budgets=budgets,
        max_new_tokens=args.max_new_tokens,
    )
    rows = config.rows()  # checks every strategy and picker name before the model loads
    items, problems = load_items(args.data, limit=args.limit, seed=args.seed, chunks=(lo, hi))
    index, count = _shard(args.shard)
    items = items[index::count]
    if not 1 <= args.jobs <= 64:
        raise InvalidRequestError(f"--jobs must be in 1..64, got {args.jobs}")
    for line in problems[:20]:
        print(f"kvrag: skipped {line}", file=sys.stderr)
    print(
        f"kvrag study: {len(items)} items, {len(rows)} strategy rows, budgets {budgets}, "
        f"{__import__('torch').get_num_threads()} threads, {args.jobs} process(es)",
        file=sys.stderr,
    )
    load = dict(name_or_path=args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    kv = KVModel.from_pretrained(**load)
    command = "kvrag " + " ".join(shlex.quote(a) for a in args.argv)
    run_study(
        kv,
        items,
        args.out,
        config=config,
        problems=problems,
        command=command,
        progress=not args.quiet,
        jobs=args.jobs,
        worker_model=load,
        part=f"shard{index}of{count}" if args.shard else "",
        report_only=args.report_only,
    )


def _shard(spec: str | None) -> tuple[int, int]:
    """`--shard I/N` as (I, N); no shard is (0, 1)."""
    if not spec:
        return 0, 1
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise InvalidRequestError(f"--shard must be I/N with 0 <= I < N, e.g. 0/2, got {spec!r}")
    return index, count


COMMANDS = {
    "demo": _demo,
    "models": _models,
    "bench-ingest": _bench_ingest,
    "bench-decode": _bench_decode,
    "bench-dtype": _bench_dtype,
    "bench-vllm": _bench_vllm,
    "bench": _bench,
    "study": _study,
    "study-compare": _study_compare,
    "ingest": _ingest,
    "info": _info,
    "gc": _gc,
    "ask": _ask,
    "agree": _tune,
    "tune": _tune,
}


def _redacted(argv: Sequence[str]) -> list[str]:
    """The command line, each URL in it (`--redis`) with its password replaced by '***'."""
    from kvrag.store import redact

    return [redact(a) if "://" in a else a for a in argv]


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["bench-vllm"]:  # its options are vllm_kvrag.bench's own, --help included
        args = argparse.Namespace(command="bench-vllm", rest=raw[1:], threads=None)
    else:
        args = build_parser().parse_args(raw)
    args.argv = _redacted(raw)  # recorded in outputs: never a password
    try:
        _run(args)
    except BrokenPipeError:  # the reader went away (`kvrag ask ... | head`): stop quietly, as cat does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        return 141  # 128 + SIGPIPE, the status a shell reports for cat
    except (KVRAGError, OSError) as err:  # a user's mistake or the world's; anything else is a bug: a traceback
        print(f"kvrag: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
