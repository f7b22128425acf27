"""The study's resumable cache: append-only JSONL files of records and references, keyed by content digests.

Each writing process appends to its own `NAME[.PART].jsonl`; every `NAME*.jsonl` in the folder is read. A
line cut short by a killed process is ignored (and ended before the next record). This module never runs
a model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

RECORDS, REFERENCES = "records", "references"  # cache/records[.PART].jsonl, one file a writing process


def digest(*parts: Any) -> str:
    """A short, stable key of JSON-able parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_jsonl(folder: Path, name: str) -> dict[str, dict[str, Any]]:
    """key -> row of the append-only cache files `name*.jsonl`; a line cut short by a killed process is ignored."""
    rows: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob(f"{name}*.jsonl")):
        # records end at "\n" only (JSON escapes it in strings); str.splitlines would also cut at U+2028, U+0085
        # and other separators that a generated answer may hold, and lose that record
        for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("key"), str):
                rows[row["key"]] = row
    return rows


class Appender:
    """Appends rows to one JSONL file, each flushed at once (a stopped run loses only what it had not written)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        cut = False
        if path.is_file() and path.stat().st_size:
            with path.open("rb") as existing:
                existing.seek(-1, 2)
                cut = existing.read(1) != b"\n"
        self.file = path.open("a", encoding="utf-8")
        if cut:  # a line cut short by a killed process: end it, so the next record is a line of its own
            self.file.write("\n")

    def __call__(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
