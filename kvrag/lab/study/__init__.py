"""The study harness: where should a KV-cache repair budget go, measured on your model and data.

    kvrag study --data builtin:all --limit 20 --out study-run

`run_study` loads items (a JSONL file or the built-in sets), runs every strategy row through
`StudyRunner` (cached, resumable) and writes results.json, table.md and the plots (see docs/study.md).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from kvrag.errors import InvalidRequestError, KVRAGError
from kvrag.lab.study.data import (
    BUILTIN,
    BUILTIN_LIMIT,
    DEFAULT_CHUNKS,
    Chunk,
    StudyItem,
    load_jsonl,
    write_jsonl,
)
from kvrag.lab.study.rows import DEFAULT_PICKERS, DEFAULT_STRATEGIES, StudyConfig
from kvrag.lab.study.runner import StudyRunner
from kvrag.lab.study.sets import builtin

__all__ = [
    "BUILTIN",
    "DEFAULT_PICKERS",
    "DEFAULT_STRATEGIES",
    "Chunk",
    "StudyConfig",
    "StudyItem",
    "StudyRunner",
    "builtin",
    "load_items",
    "load_jsonl",
    "run_study",
    "write_jsonl",
]


def load_items(
    data: str, *, limit: int | None = None, seed: int = 0, chunks: tuple[int, int] = DEFAULT_CHUNKS
) -> tuple[list[StudyItem], list[str]]:
    """Items from "FILE.jsonl", "builtin:NAME[,NAME...]" or "builtin:all", and the problems of skipped lines.

    `limit` is per file or per built-in set (a built-in set gives BUILTIN_LIMIT items when it is None). Items of
    several sets are interleaved, so a run stopped early still covers every set.
    """
    if data.startswith("builtin:"):
        names = data.removeprefix("builtin:").split(",")
        names = list(BUILTIN) if names == ["all"] else names
        sets = [builtin(n.strip(), seed=seed, limit=limit or BUILTIN_LIMIT, chunks=chunks) for n in names]
        problems: list[str] = []
    else:
        items, problems = load_jsonl(data)
        sets = [items[:limit] if limit else items]
    longest = max(len(s) for s in sets)
    return [s[i] for i in range(longest) for s in sets if i < len(s)], problems


def run_study(
    kv: Any,
    items: Sequence[StudyItem],
    out: str | Path,
    *,
    config: StudyConfig | None = None,
    embedder: Any = None,
    problems: Sequence[str] = (),
    command: str = "",
    progress: bool = True,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    jobs: int = 1,
    worker_model: dict[str, Any] | None = None,
    part: str = "",
    report_only: bool = False,
) -> dict[str, Any]:
    """Run the study over `items` with model `kv` and write every output file in `out`; return the results.

    Finished records are kept in `out/cache/` and reused by a rerun with the same model and settings.

    Args:
        jobs: worker processes that share the items (each takes the next one from a shared queue when it is
            free), each with its own copy of the model loaded by `KVModel.from_pretrained(**worker_model)` and
            this process's torch threads divided among them. On a CPU, two processes of one thread get more
            done than one of two (a decoding step is mostly fixed cost that a second thread does not shorten).
        worker_model: how a worker loads the model (required when jobs > 1).
        part: names this process's cache files (`records.PART.jsonl`), for several processes on one `out`;
            workers add `jobIofN`.
        report_only: compute nothing: report the items whose every row is in the cache (a run still going, or
            stopped, in other processes).
    """
    # Long only by its signature and documented arguments: the body is the run's one sequence of steps.
    import torch
    from tqdm.auto import tqdm

    from kvrag.lab.study import report

    _check_jobs(items, jobs, worker_model, embedder)
    config = (config or StudyConfig()).for_model(kv.fingerprint.weights)  # what a "default" row runs
    out = Path(out)
    threads = torch.get_num_threads()
    runner = StudyRunner(kv, embedder, config, out / "cache", part=part)
    skipped = list(problems)
    cached = sum(runner.done(i) for i in items)
    t0 = time.perf_counter()
    bar = tqdm(total=len(items), desc="study", unit="item", disable=not progress, initial=0)

    def on_item(item: str, reason: str | None) -> None:
        if reason:
            skipped.append(f"item {item}: {reason}")
        bar.update(1)

    try:
        if report_only:  # what the cache holds: an item missing a row is left out and listed
            records = runner.cached([item for item in items if runner.done(item)])
            skipped += [f"item {item.id}: not every row is in the cache" for item in items if not runner.done(item)]
            bar.update(len(items))
        elif jobs > 1:
            records = _in_workers(
                runner, kv, items, out / "cache", worker_model or {}, jobs, threads, part, bar, on_item
            )
        else:
            if embedder is None:
                from kvrag.engine.embed import Embedder

                runner.embedder = Embedder()
            records = runner.run(items, on_item=lambda item, reason: on_item(item.id, reason))
    finally:
        bar.close()
    results = _results(kv, records, config, command, threads, jobs, time.perf_counter() - t0, cached, skipped)
    paths = report.write(results, out)
    _log_skipped(skipped, log)
    log(f"wrote {', '.join(str(p) for p in paths)}")
    return results


def _log_skipped(skipped: list[str], log: Callable[[str], None]) -> None:
    for line in skipped[:20]:
        log(f"skipped: {line}")
    if len(skipped) > 20:
        log(f"skipped: ... and {len(skipped) - 20} more (all in results.json)")


def _in_workers(
    runner: StudyRunner,
    kv: Any,
    items: Sequence[StudyItem],
    cache: Path,
    model: dict[str, Any],
    jobs: int,
    threads: int,
    part: str,
    bar: Any,
    on_item: Callable[[str, str | None], None],
) -> list[dict[str, Any]]:
    """The items not yet in the cache run by worker processes; every item's records, read back from the cache."""
    todo = [item for item in items if not runner.done(item)]
    bar.update(len(items) - len(todo))
    if todo:
        workers = min(jobs, len(todo))
        share = max(1, threads // workers)
        _run_workers(todo, cache, runner.config, model, runner.settings, workers, share, part, on_item)
    return StudyRunner(kv, None, runner.config, cache).cached(items)  # what the workers wrote


def _check_jobs(items: Sequence[StudyItem], jobs: int, worker_model: Any, embedder: Any) -> None:
    if not items:
        raise InvalidRequestError("no study items to run: check --data and --limit")
    if not isinstance(jobs, int) or not 1 <= jobs <= 64:
        raise InvalidRequestError(f"jobs must be a whole number in 1..64, got {jobs!r}")
    if jobs > 1 and worker_model is None:
        raise InvalidRequestError("jobs > 1 needs worker_model: the KVModel.from_pretrained arguments of each worker")
    if jobs > 1 and embedder is not None:
        raise InvalidRequestError("jobs > 1 runs the default embedder in every worker: leave embedder unset")


def _results(
    kv: Any,
    records: list[dict[str, Any]],
    config: StudyConfig,
    command: str,
    threads: int,
    jobs: int,
    run_s: float,
    cached: int,
    skipped: list[str],
) -> dict[str, Any]:
    """What results.json holds: the run's settings and the summaries of its records."""
    from kvrag.lab.study import report

    per_item = {r["item"]: r.get("item_s", 0.0) for r in records}
    return {
        "schema": report.SCHEMA,
        "command": command,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": model_name(kv), "fingerprint": asdict(kv.fingerprint)},
        "config": {**asdict(config), "rows": [r.label for r in config.rows()]},
        "threads": threads,
        "jobs": jobs,
        "run_s": run_s,  # this invocation
        "compute_s": sum(per_item.values()),  # every item's first computation, earlier invocations included
        "data": {"items": len({r["item"] for r in records}), "cached_items": cached, "skipped": skipped},
        **report.summarize(records, config),
    }


def _run_workers(
    items: Sequence[StudyItem],
    cache: Path,
    config: StudyConfig,
    model: dict[str, Any],
    settings: str,
    jobs: int,
    threads: int,
    part: str,
    on_item: Callable[[str, str | None], None],
) -> None:
    """Run the items in `jobs` spawned processes, each appending to its own cache files; return when all are done.

    A worker that fails stops the others, and so does any error or interruption here; a worker whose parent
    is gone stops after its item in progress. What every worker finished stays in the cache for a rerun.
    """
    import multiprocessing as mp

    context = mp.get_context("spawn")  # a forked copy of a process that has run OpenMP threads can hang
    events = context.Queue()
    tasks = context.Queue()  # one shared queue: a worker takes the next item when it is free, none idles early
    for item in items:
        tasks.put(item)
    for _ in range(jobs):
        tasks.put(None)  # one end mark a worker
    workers = [
        context.Process(
            target=_work,
            args=(
                i,
                tasks,
                cache,
                config,
                model,
                threads,
                ".".join(filter(None, [part, f"job{i}of{jobs}"])),
                events,
            ),
            daemon=True,
        )
        for i in range(jobs)
    ]
    for worker in workers:
        worker.start()
    watch = _Watch(jobs, settings, on_item)
    try:
        watch.until_done(events, workers)
    finally:
        for worker in workers:
            if len(watch.finished) < jobs and worker.is_alive():
                worker.terminate()
            worker.join()
    failure = watch.failure
    if failure is not None:
        raise KVRAGError(f"{failure}; every finished item is kept in {cache}: run the same command again to go on")


class _Watch:
    """The parent's side of the workers: their events, until all are done or one has failed."""

    def __init__(self, jobs: int, settings: str, on_item: Callable[[str, str | None], None]) -> None:
        self.jobs, self.settings, self.on_item = jobs, settings, on_item
        self.finished: set[int] = set()
        self.failure: str | None = None

    def handle(self, kind: str, index: int, detail: Any) -> None:
        if kind == "item":
            self.on_item(*detail)
        elif kind == "done" and detail != self.settings:
            self.failure = (
                f"worker {index} of {self.jobs} loaded a different model or settings than this process "
                f"(worker_model must load the model given to run_study)"
            )
        elif kind == "done":
            self.finished.add(index)
        elif self.failure is None:
            self.failure = f"worker {index} of {self.jobs} failed: {detail}"

    def until_done(self, events: Any, workers: Sequence[Any]) -> None:
        import queue as queues

        while len(self.finished) < self.jobs and self.failure is None:
            try:
                self.handle(*events.get(timeout=1.0))
                continue
            except queues.Empty:
                pass
            for i, worker in enumerate(workers):
                if i not in self.finished and not worker.is_alive():
                    try:  # what it said before it stopped comes first
                        while self.failure is None and i not in self.finished:
                            self.handle(*events.get(timeout=0.5))
                    except queues.Empty:
                        self.failure = (
                            f"worker {i} of {self.jobs} stopped (exit code {worker.exitcode}) before its items "
                            "were done"
                        )


def _work(
    index: int,
    tasks: Any,
    cache: Path,
    config: StudyConfig,
    model: dict[str, Any],
    threads: int,
    part: str,
    events: Any,
) -> None:
    """One worker process of run_study(jobs=N): reports each item, then "done" with its settings digest."""
    import multiprocessing as mp

    import torch

    torch.set_num_threads(threads)
    parent = mp.parent_process()

    def on_item(item: StudyItem, reason: str | None) -> None:
        events.put(("item", index, (item.id, reason)))
        if parent is not None and not parent.is_alive():
            raise SystemExit("the study's parent process is gone")

    try:
        from kvrag.engine.embed import Embedder
        from kvrag.kvmodel import KVModel

        runner = StudyRunner(KVModel.from_pretrained(**model), Embedder(), config, cache, part=part)
        runner.run(iter(tasks.get, None), on_item=on_item)  # items until the end mark
    except BaseException as err:  # reported to the parent, which stops the other workers
        events.put(("error", index, f"{type(err).__name__}: {err}"))
        raise
    events.put(("done", index, runner.settings))


def model_name(kv: Any) -> str:
    from kvrag.model.catalog import MODELS

    named = [m.name for m in MODELS.values() if m.weights == kv.fingerprint.weights]
    if named:
        return f"{named[0]} ({kv.fingerprint.dtype})"
    name = str(getattr(kv.model.config, "_name_or_path", "") or kv.fingerprint.weights)
    return Path(name).name if Path(name).exists() else name
