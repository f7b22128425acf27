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

from kvrag.errors import InvalidRequestError
from kvrag.study.data import BUILTIN, BUILTIN_LIMIT, DEFAULT_CHUNKS, Chunk, StudyItem, builtin, load_jsonl, write_jsonl
from kvrag.study.runner import DEFAULT_PICKERS, DEFAULT_STRATEGIES, StudyConfig, StudyRunner

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
) -> dict[str, Any]:
    """Run the study over `items` with model `kv` and write every output file in `out`; return the results.

    Finished records are kept in `out/cache/` and reused by a rerun with the same model and settings.
    """
    import torch
    from tqdm.auto import tqdm

    from kvrag.study import report

    if not items:
        raise InvalidRequestError("no study items to run: check --data and --limit")
    config = config or StudyConfig()
    if embedder is None:
        from kvrag.embed import Embedder

        embedder = Embedder()
    out = Path(out)
    runner = StudyRunner(kv, embedder, config, out / "cache")
    skipped = list(problems)
    cached = sum(runner.done(i) for i in items)
    t0 = time.perf_counter()
    bar = tqdm(total=len(items), desc="study", unit="item", disable=not progress, initial=0)

    def on_item(item: StudyItem, reason: str | None) -> None:
        if reason:
            skipped.append(f"item {item.id}: {reason}")
        bar.update(1)

    try:
        records = runner.run(items, on_item=on_item)
    finally:
        bar.close()
    run_s = time.perf_counter() - t0
    per_item = {r["item"]: r.get("item_s", 0.0) for r in records}
    results = {
        "schema": report.SCHEMA,
        "command": command,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"name": _model_name(kv), "fingerprint": asdict(kv.fingerprint)},
        "config": {**asdict(config), "rows": [r.label for r in config.rows()]},
        "threads": torch.get_num_threads(),
        "run_s": run_s,  # this invocation
        "compute_s": sum(per_item.values()),  # every item's first computation, earlier invocations included
        "data": {"items": len({r["item"] for r in records}), "cached_items": cached, "skipped": skipped},
        **report.summarize(records, config),
    }
    paths = report.write(results, out)
    for line in skipped[:20]:
        log(f"skipped: {line}")
    if len(skipped) > 20:
        log(f"skipped: ... and {len(skipped) - 20} more (all in results.json)")
    log(f"wrote {', '.join(str(p) for p in paths)}")
    return results


def _model_name(kv: Any) -> str:
    name = str(getattr(kv.model.config, "_name_or_path", "") or kv.fingerprint.weights)
    return Path(name).name if Path(name).exists() else name
