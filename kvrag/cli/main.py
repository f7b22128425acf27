"""The `kvrag` command line: the parser, and the one place errors become exit codes. User mistakes print one line
and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from kvrag import __version__
from kvrag.cli import ask, bench, index, models, study
from kvrag.cli.common import index_model_arg
from kvrag.errors import InvalidRequestError, KVRAGError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrag", description="Reuse attention (KV) state in retrieval-augmented generation."
    )
    parser.add_argument("--version", action="version", version=f"kvrag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    adders = (
        models.add_demo,
        models.add_models,
        index.add_ingest,
        ask.add_ask,
        study.add_agree_and_tune,
        bench.add_bench,
        study.add_study,
        index.add_info,
        index.add_verify,
        index.add_gc,
    )
    for add in adders:
        add(sub)
    # Every command that loads a model takes --model; over an index it is checked against the index's. Not
    # study-compare (it reads results, which name their models) nor bench-vllm (its options are its own).
    for name, command in sub.choices.items():
        if "--model" not in command._option_string_actions and name not in ("study-compare", "bench-vllm"):
            index_model_arg(command)
        if name != "bench-vllm":
            command.add_argument(
                "-v", "--verbose", action="count", default=0,
                help="log what kvrag does to stderr: -v the plan chosen and why, ingestion's skips; -vv also store "
                "reads and writes and the chunks read",
            )
    return parser


COMMANDS = {**models.COMMANDS, **index.COMMANDS, **ask.COMMANDS, **bench.COMMANDS, **study.COMMANDS}


def _run(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars are noise on a command line
    log_to_stderr(getattr(args, "verbose", 0))
    if args.threads is not None:
        if not 1 <= args.threads <= 1024:
            raise InvalidRequestError(f"--threads must be in 1..1024, got {args.threads}")
        torch.set_num_threads(args.threads)
    COMMANDS[args.command](args)


def log_to_stderr(verbose: int) -> None:
    """Show the `kvrag` logger's records on stderr: INFO with -v, DEBUG with -vv; nothing without."""
    log = logging.getLogger("kvrag")
    if not verbose or any(h.get_name() == "kvrag-cli" for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name("kvrag-cli")
    handler.setFormatter(logging.Formatter("kvrag: %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


def _redacted(argv: Sequence[str]) -> list[str]:
    """The command line, each URL in it (`--redis`) with its password replaced by '***'."""
    from kvrag.cache.store import redact

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
    except KeyboardInterrupt:  # Ctrl-C while starting (loading a model, opening an index): nothing was written
        print("kvrag: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    return 0
