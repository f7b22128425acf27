"""`kvrag study`, `kvrag study-compare`, `kvrag agree` and `kvrag tune`: quality against full prefill."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from kvrag.cli.common import cpu_arg, model_args, open_index, parse_csv, parse_shard, secret_arg
from kvrag.errors import InvalidRequestError


def add_agree_and_tune(sub: Any) -> None:
    """`kvrag agree` and `kvrag tune` (the same options)."""
    from kvrag.lab.study.agreement import DEFAULT_BUDGETS, DEFAULT_CANDIDATES, DEFAULT_FLOOR

    for name, what in (
        ("agree", "how often each strategy's answer is full prefill's, on an index and a file of your questions"),
        (
            "tune",
            "measure agreement (as kvrag agree), choose the fastest strategy above a floor, save it as the index's "
            "default",
        ),
    ):
        tune = sub.add_parser(name, help=what)
        tune.add_argument("--index", required=True, type=Path, help="the index folder (`kvrag ingest` builds one)")
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
        tune.add_argument("--top-k", type=int, default=5, help="chunks retrieved for a question (default 5)")
        tune.add_argument("--limit", type=int, default=None, help="the first N questions only")
        tune.add_argument("--max-new-tokens", type=int, default=32, help="answers also end at a line break")
        tune.add_argument("--redis", default=None, metavar="URL", help="read chunk KV from Redis (as given to ingest)")
        secret_arg(tune)
        tune.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
        tune.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
        tune.add_argument("--quiet", action="store_true", help="no progress bar")


def add_study(sub: Any) -> None:
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
    model_args(study)
    cpu_arg(study)
    compare = sub.add_parser(
        "study-compare", help="several study runs side by side (e.g. one data set on several models), one column a run"
    )
    compare.add_argument("runs", nargs="+", type=Path, help="study --out folders (each holds results.json)")
    compare.add_argument("--out", required=True, type=Path, help="where compare.md and compare_accuracy.png go")
    compare.add_argument("--budget", type=float, default=0.05, help="the budget of budgeted rows (default 0.05)")
    compare.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)


def _study_compare(args: argparse.Namespace) -> None:
    from kvrag.lab.study.compare import write

    for path in write(args.runs, args.out, args.budget):
        print(path)


def _tune(args: argparse.Namespace) -> None:
    from kvrag.lab.study.agreement import candidates, read_questions, run_tune

    configs = candidates(parse_csv(args.candidates, str, "--candidates"), parse_csv(args.budgets, float, "--budgets"))
    questions = read_questions(args.questions)[: args.limit] if args.limit is None or args.limit >= 1 else []
    if not questions:
        raise InvalidRequestError(f"--limit must be at least 1, got {args.limit}")
    results = run_tune(
        open_index(args, read_only=args.command == "agree"),
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
    from kvrag.lab.study import StudyConfig, load_items, run_study
    from kvrag.lab.study.rows import DEFAULT_STRATEGIES
    from kvrag.kvmodel import KVModel
    from kvrag.plan.request import check_budget

    if args.budget is not None and args.budgets is not None:
        raise InvalidRequestError("give --budget or --budgets, not both")
    budgets = [args.budget] if args.budget is not None else parse_csv(args.budgets or "0.05", float, "--budgets")
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
        strategies=parse_csv(args.strategies, str, "--strategies") if args.strategies else DEFAULT_STRATEGIES,
        pickers=parse_csv(args.pickers, str, "--pickers"),
        budgets=budgets,
        max_new_tokens=args.max_new_tokens,
    )
    rows = config.rows()  # checks every strategy and picker name before the model loads
    items, problems = load_items(args.data, limit=args.limit, seed=args.seed, chunks=(lo, hi))
    index, count = parse_shard(args.shard)
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
    kv = KVModel.from_pretrained(**load, cpu_kernels=args.cpu_kernels)
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


COMMANDS = {
    "study": _study,
    "study-compare": _study_compare,
    "agree": _tune,
    "tune": _tune,
}
