"""An index folder on disk: its manifest, its generations of index files, and the lock that orders writers.

A commit writes the index under a fresh generation name, then renames the manifest over the old one: a
process killed at any point leaves the previous index or the new one, whole. Many processes may open
one folder: writers hold its exclusive lock, readers a shared one. This module never embeds, encodes or
answers; the engine calls it.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

from kvrag.errors import IndexLoadError, StoreError
from kvrag.index import ChunkIndex, write_atomic

try:
    import fcntl
except ImportError:  # not POSIX: one process an index folder
    fcntl = None  # type: ignore[assignment]

# 2: vectors as safetensors (never a format that runs code when read), files named by a generation that the
# manifest commits.
INDEX_FORMAT = 2
MANIFEST = "kvrag-index.json"
LOCK_FILE = ".kvrag.lock"


class IndexFolder:
    """One index folder: read its committed manifest and index, commit a new generation, lock it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        """Whether the folder holds a committed index."""
        return (self.path / MANIFEST).is_file()

    @contextlib.contextmanager
    def lock(self, *, shared: bool = False) -> Iterator[None]:
        """An advisory lock across processes (exclusive to write, shared to read)."""
        if fcntl is None or not self.path.is_dir():
            yield
            return
        with open(self.path / LOCK_FILE, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def manifest(self) -> dict[str, Any]:
        """The committed manifest, checked for this kvrag's index format."""
        try:
            manifest = json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise IndexLoadError(
                f"no kvrag index at {self.path}: create one with `kvrag ingest PATH --index {self.path}`"
            ) from None
        except (OSError, ValueError) as err:
            raise IndexLoadError(f"the index manifest {self.path / MANIFEST} is unreadable ({err}): re-ingest") from err
        if not isinstance(manifest, dict) or manifest.get("format") != INDEX_FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise IndexLoadError(f"{self.path} holds index format {found}, this kvrag reads {INDEX_FORMAT}: re-ingest")
        return manifest

    def load_index(self, manifest: Mapping[str, Any]) -> ChunkIndex:
        """The index generation that `manifest` commits."""
        try:
            return ChunkIndex.load(self.path / "index", manifest["dim"], manifest["index"])
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as err:
            raise IndexLoadError(f"the index at {self.path} is damaged ({err}): re-ingest into a new folder") from err

    def commit(self, index: ChunkIndex, manifest: Mapping[str, Any]) -> str:
        """Write `index` under a new generation and commit it with `manifest`; return the generation.

        The caller holds the exclusive lock. A write that fails (a full disk) raises StoreError and leaves
        the committed index as it was.
        """
        generation = uuid.uuid4().hex[:16]
        written: list[Path] = []
        try:
            written = index.save(self.path / "index", generation)
            body = {"format": INDEX_FORMAT, "index": generation, **manifest}
            write_atomic(self.path / MANIFEST, json.dumps(body, indent=1).encode())
        except OSError as err:
            for file in written:  # never committed: nothing refers to them
                with contextlib.suppress(OSError):
                    file.unlink()
            raise StoreError(
                f"cannot write the index under {self.path}: {err.strerror or err}; the index on disk is unchanged. "
                "Free space or choose another folder, then ingest again."
            ) from err
        # Earlier generations are unreferenced now, and a temporary file can only be a dead writer's: every
        # writer of the index holds the folder's exclusive lock.
        for old in [*(self.path / "index").glob("*"), *self.path.glob(".*.tmp")]:
            if old.is_file() and (generation not in old.name or old.name.endswith(".tmp")):
                with contextlib.suppress(OSError):
                    old.unlink()
        return generation
