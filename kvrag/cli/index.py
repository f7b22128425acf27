"""`kvrag ingest`, `kvrag info` and `kvrag gc`: building, inspecting and cleaning an index folder."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from kvrag.cli.common import (
    cpu_arg,
    index_is_a_folder,
    interruptible,
    model_args,
    open_index,
    same_model,
    secret_arg,
    secret_of,
    store_of,
)
from kvrag.errors import InvalidRequestError


def add_ingest(sub: Any) -> None:
    """`kvrag ingest`."""
    ingest = sub.add_parser("ingest", help="split, embed and encode documents into an index folder")
    ingest.add_argument(
        "paths",
        nargs="+",
        type=Path,
        help="text files (.txt, .md, .rst, or any other that is UTF-8 text), or folders of them; a file that is not "
        "text is skipped and named at the end",
    )
    ingest.add_argument("--index", required=True, type=Path, help="the index folder (created if missing)")
    # The index flags default to None: a flag left out takes an existing index's value (or, for a fresh index,
    # the default its help states); one given must agree with the index (`_index_settings`).
    ingest.add_argument("--chunk-tokens", type=int, default=None, help="tokens a chunk (default 200)")
    ingest.add_argument("--overlap", type=int, default=None, help="tokens shared by neighbouring chunks (default 20)")
    ingest.add_argument(
        "--storage-dtype",
        default=None,
        help="float16, bfloat16, float32, int8, int4 (keys per channel, values per token: under a third of "
        "float16's bytes) or k4v3 (keys at 4 bits, values at 3: under a quarter; docs/usage.md); default the "
        "model's choice (docs/models.md), float16 for a model kvrag does not name",
    )
    ingest.add_argument(
        "--encoding",
        choices=("alone", "document"),
        default=None,
        help="document: each chunk's KV encoded behind its document's earlier chunks (a document's chunks read in "
        "order are then exactly its full prefill); alone: behind the prompt prefix only (docs/usage.md); default "
        "for a new index the model's choice: alone for the embedded smollm2-135m, document for any other model",
    )
    ingest.add_argument(
        "--header",
        choices=("plain", "declining"),
        default=None,
        help="the prompts' context header, every chunk's KV encoded behind it: plain (kvrag's own) or declining (it "
        "asks the model to say 'The documents do not say.' where they are silent); default for a new index the "
        "model's choice (declining for qwen2.5-coder-1.5b, plain for the others; `kvrag models`); an existing index "
        "keeps its own",
    )
    ingest.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    ingest.add_argument(
        "--yes",
        action="store_true",
        help=f"encode more than {BIG_INGEST_CHUNKS:,} new chunks in one run (refused by default, with the estimate)",
    )
    ingest.add_argument("--redis", default=None, metavar="URL", help="keep chunk KV in Redis (redis:// or rediss://)")
    ingest.add_argument(
        "--namespace", default=None, help="a tenant name in every chunk's store key (kept in the index; default: none)"
    )
    ingest.add_argument(
        "--follow-symlinks", action="store_true", help="read files and folders reached through symbolic links"
    )
    ingest.add_argument(
        "--max-file-mb", type=float, default=None, help="the largest input file read (default 64; larger: skipped)"
    )
    ingest.add_argument(
        "--strict",
        action="store_true",
        help="ingest nothing when a file would be skipped (binary, not UTF-8, empty, too large): exit 2 naming them",
    )
    ingest.add_argument(
        "--max-kv-gb",
        type=float,
        default=None,
        help="bound the index's KV folder: least recently used KV evicted past it, computed again when needed (kept "
        "with the index; default: no bound)",
    )
    ingest.add_argument(
        "--kv-on-demand",
        action="store_true",
        help="index and embed only: each chunk's KV is computed at its first retrieval and kept",
    )
    secret_arg(ingest)
    model_args(ingest)
    cpu_arg(ingest)
    ingest.set_defaults(dtype=None)  # "auto", unless the index at --index was built with another


def add_info(sub: Any) -> None:
    """`kvrag info`."""
    info = sub.add_parser("info", help="counts, bytes and the model fingerprint of an index folder (read-only)")
    _index_and_store(info, "count the chunk KV in Redis (as given to ingest)")
    _opening(info)


def _index_and_store(parser: Any, redis_help: str) -> None:
    """--index and --redis: the index folder a command works on and where its chunk KV is."""
    parser.add_argument("--index", required=True, type=Path, help="the index folder (`kvrag ingest` builds one)")
    parser.add_argument("--redis", default=None, metavar="URL", help=redis_help)


def _opening(parser: Any) -> None:
    """The secret, device and threads an index is opened with."""
    secret_arg(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")


def add_verify(sub: Any) -> None:
    """`kvrag verify`."""
    verify = sub.add_parser(
        "verify", help="read every indexed chunk's stored KV and check it (keyed checksum, its own tokens)"
    )
    _index_and_store(verify, "check the chunk KV in Redis (as given to ingest)")
    verify.add_argument(
        "--repair", action="store_true", help="re-encode every entry that fails and write it back (else: exit 1)"
    )
    _opening(verify)


def add_gc(sub: Any) -> None:
    """`kvrag gc`."""
    gc = sub.add_parser(
        "gc", help="delete stored chunk KV that no indexed chunk refers to, and dead writers' temporary files"
    )
    _index_and_store(gc, "collect in Redis (needs --exclusive)")
    gc.add_argument(
        "--exclusive",
        action="store_true",
        help="with --redis: this index is the only one writing to that Redis namespace (else another index's entries "
        "would look like orphans)",
    )
    gc.add_argument("--dry-run", action="store_true", help="count what would be removed, remove nothing")
    _opening(gc)


def _ingest(args: argparse.Namespace) -> None:
    from kvrag.engine.documents import MAX_FILE_BYTES
    from kvrag.engine.rag import KVRAG, MANIFEST
    from kvrag.model.layout import HEADERS

    index_is_a_folder(args.index)
    fresh = not (args.index / MANIFEST).is_file()
    made = not args.index.exists()  # a first ingest that fails removes what it made: no folder is left behind
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
        store=store_of(args),
        namespace=args.namespace,
        max_kv_bytes=_kv_bound(args.max_kv_gb, args.redis),
        cpu_kernels=args.cpu_kernels,
        require_store=True,
        secret=secret_of(args),
        lock_timeout_s=args.lock_timeout,
        encoding=args.encoding,
        header=HEADERS[args.header] if args.header else None,
    )
    if args.max_file_mb is not None and not 0 < args.max_file_mb <= 1 << 20:
        raise InvalidRequestError(f"--max-file-mb must be a positive number of megabytes, got {args.max_file_mb}")
    max_bytes = int(args.max_file_mb * (1 << 20)) if args.max_file_mb is not None else MAX_FILE_BYTES
    terminal = sys.stderr.isatty()
    limit = None if args.yes else BIG_INGEST_CHUNKS
    report = _Progress(rag, refuse_above=limit, lines=not terminal, quiet=args.quiet)
    if fresh:
        interrupted = (
            f"kvrag: interrupted before the first commit at {args.index} (the KV already encoded is kept: ingesting "
            f"again reuses it, `kvrag gc --index {args.index}` removes it)"
        )
    else:
        interrupted = (
            f"kvrag: interrupted; the index at {args.index} is as last committed (the KV already encoded is kept: "
            f"ingesting again reuses it, `kvrag gc --index {args.index}` removes it)"
        )
    try:
        stats = interruptible(
            lambda: rag.ingest(
                list(args.paths),
                progress=terminal and not args.quiet,
                on_progress=report,
                follow_symlinks=args.follow_symlinks,
                max_file_bytes=max_bytes,
                encode=not args.kv_on_demand,
                strict=args.strict,
            ),
            interrupted=interrupted,
        )
    except Exception:
        if made:  # nothing was committed: what this command made goes (the ingest removed its entries already)
            from kvrag.engine.folder import IndexFolder

            IndexFolder(args.index).remove_uncommitted()
            with contextlib.suppress(OSError):
                args.index.rmdir()  # made empty (only when nothing is in it)
        raise
    print(
        f"{'created' if fresh else 'updated'} {args.index}: {stats.documents} documents, {stats.chunks} chunks "
        f"({stats.tokens} tokens); KV encoded for {stats.encoded}, already stored for {stats.store_hits}; "
        f"{stats.seconds:.1f} s"
    )
    if stats.skipped:
        print(f"kvrag: skipped {len(stats.skipped)} file(s), not ingested (--strict refuses them):", file=sys.stderr)
        for skipped in stats.skipped:
            print(f"  {skipped.path}: {skipped.reason}", file=sys.stderr)


# More new chunks than this in one `kvrag ingest` is refused unless --yes: at the embedded model's ~3 chunks a second on
# 2 cores, about half an hour of encoding.
BIG_INGEST_CHUNKS = 5000


def _kv_bound(gigabytes: float | None, redis: str | None = None) -> int | None:
    """--max-kv-gb in bytes (None: no bound)."""
    if gigabytes is None:
        return None
    if redis:
        raise InvalidRequestError(
            "--max-kv-gb bounds the index's own KV folder; with --redis, bound Redis itself (maxmemory with "
            "maxmemory-policy allkeys-lru): an evicted entry is only a miss"
        )
    if not 0 < gigabytes < 1 << 20:
        raise InvalidRequestError(f"--max-kv-gb must be a positive number of gigabytes, got {gigabytes}")
    return int(gigabytes * 1e9)


class _Progress:
    """What `kvrag ingest` says while it encodes: the plan before (chunks and KV bytes; refused above a size unless
    --yes), and when stderr is not a terminal, a line every 10% or 30 s (a progress bar draws nothing in a log)."""

    def __init__(self, rag: Any, *, refuse_above: int | None, lines: bool, quiet: bool = False) -> None:
        from kvrag.cache import lowbit

        config = rag.kvmodel.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        storage = getattr(getattr(rag.store, "back", rag.store), "storage_dtype", "float16")
        width = lowbit.value_bytes(storage) if storage in lowbit.FORMATS else {"float32": 4, "int8": 1}.get(storage, 2)
        self.bytes_per_chunk = int(2 * config.num_hidden_layers * heads * head_dim * width * rag.chunk_tokens)
        self.refuse_above, self.lines, self.quiet = refuse_above, lines, quiet
        self.started, self.said_at, self.said_done = 0.0, 0.0, 0

    def __call__(self, done: int, total: int) -> None:
        import time

        now = time.monotonic()
        if done == 0:
            size = total * self.bytes_per_chunk / 1e9
            if self.refuse_above is not None and total > self.refuse_above:
                raise InvalidRequestError(
                    f"{total:,} new chunks to encode (about {size:.1f} GB of KV): more than {self.refuse_above:,} in "
                    "one run; nothing was written. Ingest fewer files at a time, or pass --yes"
                )
            if not self.quiet:
                print(f"kvrag: encoding {total:,} new chunks (about {size:.2f} GB of KV)", file=sys.stderr, flush=True)
            self.started = self.said_at = now
            return
        if (
            self.lines
            and not self.quiet
            and (done == total or done - self.said_done >= total / 10 or now - self.said_at >= 30)
        ):
            spent = now - self.started
            left = spent / done * (total - done)
            print(
                f"kvrag: encoded {done:,} of {total:,} chunks ({100 * done / total:.0f}%), {spent:.0f} s, "
                f"about {left:.0f} s left",
                file=sys.stderr,
                flush=True,
            )
            self.said_at, self.said_done = now, done


# ingest's index flags: the manifest key each is kept under, and its default for a fresh index.
_INDEX_FLAGS = {
    "model": ("--model", None),
    "dtype": ("--dtype", "auto"),
    "chunk_tokens": ("--chunk-tokens", 200),
    "overlap": ("--overlap", 20),
    "storage_dtype": ("--storage-dtype", None),  # None for a fresh index: the model's shipped choice
    "namespace": ("--namespace", ""),
    "encoding": ("--encoding", None),  # None for a fresh index: the model's choice
}
# what an existing index whose manifest lacks a flag's key was built with (it predates the flag)
_BUILT_BEFORE = {"encoding": "alone"}


def _index_settings(args: argparse.Namespace) -> None:
    """Fill ingest's index flags left out: from the index at --index, else the defaults.

    A flag given with a value other than the one the existing index was built with is an InvalidRequestError
    naming both (the index keeps its own: ingesting would otherwise ignore the flag, or mix chunkings).
    `--dtype auto` states no preference; `--model` must be the model as the index names it.
    """
    from kvrag.engine.folder import IndexFolder
    from kvrag.model.loading import resolve_dtype

    folder = IndexFolder(args.index, read_only=True, secret=secret_of(args))  # None: the user's key
    if not folder.exists():
        for key, (_, default) in _INDEX_FLAGS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        return
    manifest = folder.manifest()
    for key, (flag, default) in _INDEX_FLAGS.items():
        given, built = getattr(args, key), manifest.get(key, _BUILT_BEFORE.get(key, default))
        if key == "dtype" and given is not None:
            given = None if given == "auto" else str(resolve_dtype(given, args.device)).removeprefix("torch.")
        same = given is None or given == built or (key == "model" and same_model(given, built))
        if not same:
            shown = "None (the embedded default)" if built is None else shlex.quote(str(built))
            raise InvalidRequestError(
                f"{flag} {shlex.quote(str(getattr(args, key)))} conflicts with the index at {args.index}, built with "
                f"{key} {shown}: drop the flag or ingest into a new folder"
            )
        setattr(args, key, built)


def _info(args: argparse.Namespace) -> None:
    info = open_index(args).info()
    print(json.dumps(info, indent=1))
    ingested = info.get("kv_store_at_ingest")
    if isinstance(ingested, str) and ingested.startswith("memory in front of redis") and not args.redis:
        print(
            f"kvrag: the KV of this index was stored in {ingested.split(' in front of ')[1]}: pass --redis URL to "
            "count those entries (the counts above are of the index folder's own kv/)",
            file=sys.stderr,
        )


def _verify(args: argparse.Namespace) -> None:
    rag = open_index(args, read_only=not args.repair)
    done = rag.verify(repair=args.repair)
    print(
        f"{args.index}: checked {done['checked']} chunks' KV in {rag.info()['kv_store']}: {done['ok']} ok, "
        f"{done['damaged']} damaged, {done['missing']} not stored (computed when first read)"
        + (f", {done['repaired']} re-encoded and written back" if done["repaired"] else "")
        + (f", {done['filled']} not stored encoded and stored" if done.get("filled") else "")
    )
    if done["damaged"] and not done["repaired"]:
        shown = ", ".join(done["damaged_chunks"][:10]) + (" ..." if done["damaged"] > 10 else "")
        print(
            f"kvrag: {done['damaged']} stored entries failed their check ({shown}): every query recomputes them "
            f"until they are rewritten. Run `kvrag verify --index {args.index} --repair`",
            file=sys.stderr,
        )
        raise SystemExit(1)


def _gc(args: argparse.Namespace) -> None:
    if args.redis and not args.exclusive:
        raise InvalidRequestError(
            "--redis needs --exclusive: a Redis namespace may hold other indexes' entries, which this index would "
            "take for orphans. Pass --exclusive only if this index alone writes to it"
        )
    from kvrag.engine.folder import IndexFolder

    verb = "would remove" if args.dry_run else "removed"
    index_is_a_folder(args.index)
    folder = IndexFolder(args.index, lock_timeout_s=args.lock_timeout)
    if folder.uncommitted():  # a first ingest interrupted or killed: nothing but what it wrote is there
        entries, size = folder.remove_uncommitted(dry_run=args.dry_run)
        gone = "" if args.dry_run or args.index.exists() else "; the folder is gone"
        print(
            f"{args.index}: interrupted before its first commit: {verb} {entries} KV entries ({size:,} bytes) and "
            f"what else that ingest wrote{gone}"
        )
        return
    rag = open_index(args, read_only=args.dry_run)  # a dry run opens read-only: it sweeps nothing either
    done = rag.gc(dry_run=args.dry_run)
    print(
        f"{args.index}: {verb} {done['orphan_entries']} orphan KV entries and {done['temp_files']} temporary files "
        f"from {rag.info()['kv_store']}"
    )


COMMANDS = {
    "ingest": _ingest,
    "info": _info,
    "verify": _verify,
    "gc": _gc,
}
