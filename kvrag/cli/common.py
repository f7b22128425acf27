"""What the command groups share: the model and store options, opening an index (checked against a --model given),
interrupts. It never answers or ingests: the commands do."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from kvrag.errors import InvalidRequestError


def model_args(parser: argparse.ArgumentParser, default: str = "the embedded smollm2-135m") -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a named model (`kvrag models`: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a Hugging Face "
        f"model id or a folder (default: {default})",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    parser.add_argument("--cache-dir", default=None, help="where converted named models are kept")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")


def index_model_arg(parser: argparse.ArgumentParser) -> None:
    """--model on a command over an existing index: the index knows its model, so the flag is only checked."""
    parser.add_argument(
        "--model",
        default=None,
        help="the model the index was built with (the index knows it: a different one is an error; default: the "
        "index's)",
    )


def same_model(given: str, built: str | None) -> bool:
    """Whether a --model names the model an index was built with (`built`; None: the embedded default): the same
    name, the same named model however written (`smollm2-135m` is the embedded default), or one folder."""
    from kvrag.model.catalog import named

    if given == built:
        return True
    if named(given) is not None and named(given) is named(built):
        return not (built is not None and Path(built).exists())  # a local folder wins over a name it shares
    if built is None:
        return False
    a, b = Path(given).expanduser(), Path(built).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def check_index_model(args: argparse.Namespace) -> None:
    """Refuse a --model other than the one the index at --index was built with, naming both."""
    import shlex

    from kvrag.engine.folder import IndexFolder

    given = getattr(args, "model", None)
    if given is None:
        return
    built = IndexFolder(args.index, read_only=True, secret=secret_of(args)).manifest().get("model")
    if not same_model(given, built):
        shown = "None (the embedded default)" if built is None else shlex.quote(str(built))
        raise InvalidRequestError(
            f"--model {shlex.quote(given)} conflicts with the index at {args.index}, built with model {shown}: drop "
            "the flag (the index opens with its own model) or ingest into a new folder with it"
        )


def cpu_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="keep the model as transformers made it: no kvrag CPU kernels or module swaps (the same tokens, slower)",
    )


def compile_arg(parser: argparse.ArgumentParser) -> None:
    cpu_arg(parser)
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="where the C decode step does not take the model: decode through torch.compile'd layer steps (seconds "
        "of compiling at the first token, faster after)",
    )
    parser.add_argument(
        "--decode-weights",
        choices=("model", "int8", "int4"),
        default=None,
        help="what the C decode step reads: the model's own weights, or int8 or int4 copies (about half and a "
        "quarter of the bytes a token; tokens may differ from the model's own: docs/performance.md); default: the "
        "named model's shipped choice (docs/models.md), the model's own weights for any other model",
    )


def secret_arg(parser: argparse.ArgumentParser) -> None:
    """How a command opens an index: the secret it was built with, and how long to wait for its lock."""
    parser.add_argument(
        "--lock-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the longest wait for the index's lock while another process holds it (default: 5 s to read, 30 s to "
        "write), then an error naming that process",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="a file holding the secret the index was built with (keys and checksums are HMACs under it; default: "
        "your kvrag key, ~/.config/kvrag/key, made on first use)",
    )
    parser.add_argument(
        "--no-secret",
        action="store_true",
        help="key nothing: for an index built without a secret (whoever can write its store can forge entries)",
    )


MAX_SECRET_BYTES = 1 << 16  # a secret is tens of bytes: a larger file is not one


def secret_of(args: argparse.Namespace) -> bytes | None:
    """The tenant secret in --secret-file (surrounding whitespace dropped), b"" with --no-secret, or None (the
    user's key)."""
    path = getattr(args, "secret_file", None)
    if getattr(args, "no_secret", False):
        if path is not None:
            raise InvalidRequestError("--no-secret and --secret-file contradict each other: give one")
        return b""
    if path is None:
        return None
    from kvrag.files import read_capped

    try:  # a link is followed (a mounted secret is one); a FIFO or a device is refused at once, never waited on
        secret = read_capped(path, MAX_SECRET_BYTES, follow_links=True).strip()
    except OSError as err:
        raise InvalidRequestError(f"cannot read the secret file {path}: {err.strerror or err}") from None
    if len(secret) < 16:
        raise InvalidRequestError(
            f"the secret file {path} holds {len(secret)} bytes: a secret needs at least 16 (`openssl rand -hex 32`)"
        )
    return secret


def store_of(args: argparse.Namespace, *, read_only: bool = False, storage_dtype: str | None = None) -> Any:
    """The KV store the command names (Redis behind memory), or None for the index folder's own; its entries
    written in `storage_dtype` (an existing index's), else --storage-dtype, else the model's shipped choice."""
    from kvrag.cache.store import MemoryStore, RedisStore, TieredStore

    redis_url = getattr(args, "redis", None)
    if not redis_url:
        return None
    storage = (storage_dtype or getattr(args, "storage_dtype", None)
               or _shipped_storage(getattr(args, "model", None)))
    return TieredStore(MemoryStore(), RedisStore(redis_url, storage_dtype=storage, read_only=read_only))


def _shipped_storage(model: str | None) -> str:
    """A fresh index's storage dtype when --storage-dtype is left out: the named model's choice, else float16."""
    from kvrag.model.catalog import named

    spec = named(model)
    return spec.storage_dtype if spec is not None else "float16"


def index_is_a_folder(index: Path) -> None:
    """Refuse an --index that names something other than a folder (a file is not an index, and ingest cannot make
    a folder there)."""
    if index.exists() and not index.is_dir():
        raise InvalidRequestError(f"--index {index} is a file, not an index folder: give a folder's path")


def open_index(args: argparse.Namespace, *, read_only: bool = True) -> Any:
    """The engine over an existing index folder; read-only unless the command writes (tune, gc)."""
    from kvrag.engine.folder import IndexFolder
    from kvrag.engine.rag import KVRAG

    index_is_a_folder(args.index)
    folder = IndexFolder(args.index)
    if not folder.exists():
        raise folder.absent()  # no index, or one interrupted before its first commit (`kvrag gc` removes it)
    check_index_model(args)
    storage = None  # the index's own, for a Redis store's writes (the folder's disk store reads the manifest itself)
    if getattr(args, "redis", None):
        storage = IndexFolder(args.index, read_only=True, secret=secret_of(args)).manifest().get("storage_dtype")
    return KVRAG.load(
        args.index,
        device=args.device,
        store=store_of(args, read_only=read_only, storage_dtype=storage),
        require_store=True,
        secret=secret_of(args),
        read_only=read_only,
        compile_decode=getattr(args, "compile_decode", False),
        decode_weights=getattr(args, "decode_weights", None),
        cpu_kernels=getattr(args, "cpu_kernels", True),
        lock_timeout_s=getattr(args, "lock_timeout", None),
    )


def interruptible(work: Callable[[], Any], *, interrupted: str) -> Any:
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


def parse_csv(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidRequestError(f"{what} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise InvalidRequestError(f"{what} is empty: give at least one")
    return values


def parse_shard(spec: str | None) -> tuple[int, int]:
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


def import_vllm_kvrag(what: str) -> Any:
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
