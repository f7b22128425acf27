"""`kvrag demo` and `kvrag models`: the bundled demo and the named models."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvrag.cli.common import compile_arg, model_args


def add_demo(sub: Any) -> None:
    """`kvrag demo`."""
    demo = sub.add_parser("demo", help="retrieve and answer over a bundled excerpt of the Python docs, offline")
    model_args(demo, default="qwen2.5-coder-0.5b, installed by the set-up; smollm2-135m, the embedded default, is "
               "faster and answers fewer questions right")
    compile_arg(demo)
    demo.add_argument("--questions", type=int, default=3, help="how many bundled questions to ask (default 3)")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="most tokens an answer decodes (default 48)")


def add_models(sub: Any) -> None:
    """`kvrag models`."""
    models = sub.add_parser("models", help="the models kvrag installs offline: size, installed or not, where, how")
    models.add_argument("--cache-dir", default=None, help="where converted named models are kept")
    models.add_argument("--json", action="store_true", help="one JSON object a model instead of a table")
    models.add_argument("--model", default=None, help="show this named model only")
    models.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)


def _demo(args: argparse.Namespace) -> None:
    from kvrag.lab.demo import run_demo

    load = dict(
        name_or_path=args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        compile_decode=args.compile_decode,
        decode_weights=args.decode_weights,
        cpu_kernels=args.cpu_kernels,
    )
    run_demo(load=load, questions=args.questions, max_new_tokens=args.max_new_tokens)


def _models(args: argparse.Namespace) -> None:
    from kvrag.errors import InvalidRequestError
    from kvrag.model.catalog import MODELS, named, status

    chosen = list(MODELS.values())
    if args.model is not None:
        if named(args.model) is None:
            raise InvalidRequestError(f"--model {args.model!r} is not a named model: give one of {', '.join(MODELS)}")
        chosen = [named(args.model)]
    rows = [{**status(m, args.cache_dir), **_defaults(m)} for m in chosen]
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
        parts = " (questions split into parts)" if row["parts"] else ""
        weights = "its own weights" if row["decode_weights"] == "model" else f"{row['decode_weights']} copies"
        encoded = "alone" if row["encoding"] == "alone" else "in their document's context"
        asks = "; asks the model to say when the documents do not" if row["declines"] else ""
        print(f"{'':<20}by default: plan {row['plan']}{parts}; decodes over {weights}; stores {row['storage_dtype']} "
              f"KV; encodes chunks {encoded}{asks}")


def _defaults(model: Any) -> dict[str, Any]:
    """What a model answers with unless told otherwise: its default plan (`kvrag.plan.defaults`), decode weights,
    stored KV, encoding and prompt header (`kvrag.model.catalog`)."""
    from kvrag.model.layout import DECLINING_HEADER
    from kvrag.plan.defaults import shipped_default

    plan = shipped_default(model.weights)
    return {
        "plan": plan["strategy"] + (f":{plan['picker']}" if plan.get("picker") else ""),
        "parts": plan.get("parts") == "auto",
        "decode_weights": model.decode_weights,
        "storage_dtype": model.storage_dtype,
        "encoding": model.encoding,
        "header": model.header,
        "declines": model.header == DECLINING_HEADER,  # its header asks the model to say the documents do not say
    }


COMMANDS = {
    "demo": _demo,
    "models": _models,
}
