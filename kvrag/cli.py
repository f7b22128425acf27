"""The `kvrag` command line. User mistakes print one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kvrag import __version__
from kvrag.errors import KVRAGError


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face model id or folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    parser.add_argument("--cache-dir", default=None, help="where converted default weights are kept")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrag", description="Reuse attention (KV) state in retrieval-augmented generation.")
    parser.add_argument("--version", action="version", version=f"kvrag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="answer questions over a bundled excerpt of the Python docs, offline")
    _model_args(demo)
    demo.add_argument("--questions", type=int, default=3, help="how many bundled questions to ask (default 3)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.command == "demo":
            from kvrag.demo import run_demo

            load = dict(name_or_path=args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
            run_demo(load=load, questions=args.questions, max_new_tokens=args.max_new_tokens)
    except (KVRAGError, ValueError) as err:
        print(f"kvrag: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
