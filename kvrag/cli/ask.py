"""`kvrag ask`: a question over an index, in process or through vLLM, and the footer under its answer (the plan
that ran, the chunks read apart from those only retrieved). It never plans or answers itself: the engine does."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvrag.answer import Answer
from kvrag.cli.common import compile_arg, import_vllm_kvrag, index_model_arg, open_index, secret_arg
from kvrag.errors import InvalidRequestError


def add_ask(sub: Any) -> None:
    """`kvrag ask`."""
    ask = sub.add_parser("ask", help="answer a question from an index folder")
    ask.add_argument("question", help="the question, quoted")
    ask.add_argument("--index", required=True, type=Path, help="the index folder (`kvrag ingest` builds one)")
    ask.add_argument(
        "--strategy",
        default=None,
        help="default: the index's tuned default (kvrag tune), else kvrag.plan.defaults' for the model",
    )
    ask.add_argument(
        "--picker",
        default=None,
        help="retriever, attention, likelihood, lexical, fused or oracle; set pickers (for set_recompute, set_only): "
        "top2, top3, likelihood2, diverse2",
    )
    ask.add_argument("--budget", type=float, default=None, help="default: the tuned default's, else 0.05")
    ask.add_argument("--top-k", type=int, default=5, help="chunks retrieved for a question (default 5)")
    ask.add_argument("--bm25", "--hybrid", dest="bm25", action="store_true", help="fuse dense and BM25 rankings")
    ask.add_argument(
        "--whole-runs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="where two or more retrieved chunks are of one run of a document encoded in its context, read the run "
        "whole (no recomputation: kvrag.engine.runs); default: kvrag's (docs/usage.md)",
    )
    ask.add_argument("--max-new-tokens", type=int, default=256, help="most tokens an answer decodes (default 256)")
    ask.add_argument(
        "--parts",
        default=None,
        metavar="auto|model|Q1;;Q2",
        help="answer a part at a time over the same chunks: auto (kvrag's splitter: 'What is A, and who is B?', "
        "'... of each of X, Y and Z?', comparisons, bridges; a question it cannot split is answered whole), model "
        "(the model lists the parts), or the parts separated by ';;' (a part holding {answer} takes the previous "
        "part's answer); default: as the default says (auto on the named models); printed whole, --stream aside",
    )
    ask.add_argument(
        "--stream", action="store_true", help="print the answer as it is decoded, then the same footer as without"
    )
    ask.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, finish_reason, abstained, sources (each with read and retrieved), stats",
    )
    ask.add_argument("--redis", default=None, metavar="URL", help="read chunk KV from Redis (as given to ingest)")
    secret_arg(ask)
    index_model_arg(ask)
    ask.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ask.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    compile_arg(ask)
    ask.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="what runs the plan: kvrag's transformers engine (default) or vLLM through kvrag's connector (vllm-kvrag; "
        "it stores the prompt prefix's KV, which the connector loads, if the store lacks it; an engine started for one "
        "question runs eager, its model not compiled)",
    )
    ask.add_argument(
        "--vllm-server",
        default=None,
        metavar="URL",
        help="with --backend vllm: a `vllm serve` that loads the connector",
    )


def _ask(args: argparse.Namespace) -> None:
    if args.backend != "vllm" and args.vllm_server:
        raise InvalidRequestError("--vllm-server goes with --backend vllm")
    # vLLM's connector needs the prompt prefix's KV in the store: the vLLM backend stores it if it is missing
    rag = open_index(args, read_only=args.backend != "vllm")
    if args.backend == "vllm":
        _on_vllm(rag, args)
    kwargs = dict(
        strategy=args.strategy,
        picker=args.picker,
        budget=args.budget,
        top_k=args.top_k,
        bm25=args.bm25,
        whole_runs=args.whole_runs,
        max_new_tokens=args.max_new_tokens,
    )
    if args.parts is not None:
        parts = args.parts if args.parts in ("auto", "model") else [p for p in args.parts.split(";;")]
        kwargs["parts"] = parts
    if args.stream and not args.json and args.parts is None:
        answer = None
        for item in rag.stream(args.question, **kwargs):
            if isinstance(item, str):
                print(item, end="", flush=True)
            else:
                answer = item
        print()
        if answer is not None:
            print("\n" + footer(answer))
        return
    answer = rag.query(args.question, **kwargs)
    if args.json:
        print(json.dumps(answer.to_dict(), ensure_ascii=False))
    else:
        print(answer.text.strip())
        print("\n" + footer(answer))


def footer(answer: Answer) -> str:
    """The lines under an answer: the plan that ran (and why, when the default chose it), the chunks a prompt that
    answered held apart from those only retrieved, and a line when the answer abstained."""
    from kvrag.adapters import answered_by  # imports the engine: not before a command runs

    said = answered_by(answer.to_dict())
    plan = said["plan"] + (f" ({said['reason']})" if said["reason"] else "")
    unread = [s.id for s in answer.sources if s.retrieved and not s.read]
    added = [s.id for s in answer.sources if not s.retrieved and s.read]
    given = [s.id for s in answer.sources if not s.retrieved and not s.read]
    lines = [f"[{plan}, ttft {answer.stats.ttft_s:.3f} s]", "read: " + (", ".join(said["read"]) or "none")]
    if added:
        lines.append("read for their run, not retrieved: " + ", ".join(added))
    if unread:
        lines.append("retrieved, not read: " + ", ".join(unread))
    if given:
        lines.append("given for their run, not read: " + ", ".join(given))
    if said["abstained"]:
        lines.append("abstained: the chunks read do not answer this (--json keeps the model's draft)")
    return "\n".join(lines)


def _on_vllm(rag: Any, args: argparse.Namespace) -> None:
    """Hand the engine's plans to vLLM: an in-process engine with kvrag's connector, or a `vllm serve`."""
    flags = (("--compile-decode", args.compile_decode), ("--decode-weights", args.decode_weights is not None))
    for flag, given in flags:
        if given:
            raise InvalidRequestError(f"{flag} is kvrag's own decode: vLLM decodes with its own")
    vllm_kvrag = import_vllm_kvrag("--backend vllm")
    secret_file = str(args.secret_file) if args.secret_file else None  # the connector verifies under the same secret
    # One question: an in-process engine runs eager, since compiling its model (on a CPU, minutes) would cost more
    # than the answer.
    eager = {} if args.vllm_server else {"enforce_eager": True}
    vllm_kvrag.attach.attach(rag, server=args.vllm_server, secret_file=secret_file, **eager)


COMMANDS = {
    "ask": _ask,
}
