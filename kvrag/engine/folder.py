"""An index folder on disk: its manifest, its generations of index files, and the lock that orders writers.

A commit writes the index under a fresh generation name, then renames the manifest over the old one: a
process killed at any point leaves the previous index or the new one, whole. Many processes may open
one folder: writers hold its exclusive lock, readers a shared one.

Confinement: nothing under the folder is reached through a symbolic link (`index/`, `kv/`, the lock, the
manifest, the index files): a link is refused with IndexLoadError, never followed, so a hostile folder
cannot make kvrag read, write or delete elsewhere. Integrity: the manifest commits a checksum of each
index file (an HMAC under the tenant secret when one is set); a damaged records file is refused, a
damaged vectors file is rebuilt from the records' texts. Opened `read_only`, nothing is created or
written. This module never embeds, encodes or answers; the engine calls it.

Bounds: every read is capped (the manifest, and each index file at the size its manifest committed), so a sparse
or grown file is refused as damaged, never allocated; the lock is waited for at most `lock_timeout_s` (a few
seconds to read, longer to write), then LockTimeoutError names the process holding it. A folder a first ingest
left before its first commit is recognised (`uncommitted`) and removable (`remove_uncommitted`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import stat
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from kvrag.cache.secret import user_key, user_key_path
from kvrag.engine.index import ChunkIndex, index_files
from kvrag.errors import IndexLoadError, InvalidRequestError, LockTimeoutError, StoreError
from kvrag.files import FILE_MODE, TooLarge, read_capped, write_atomic

try:
    import fcntl
except ImportError:  # not POSIX: one process an index folder
    fcntl = None  # type: ignore[assignment]

# 2: vectors as safetensors (never a format that runs code when read), files named by a generation that the
# manifest commits.
INDEX_FORMAT = 2
MANIFEST = "kvrag-index.json"
LOCK_FILE = ".kvrag.lock"
GENERATION = re.compile(r"[0-9a-f]{16}")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

MAX_MANIFEST_BYTES = 1 << 20  # a manifest is about a kilobyte: anything near this is not one
# An index file of a manifest that records no sizes (one committed before they were): larger is refused as damaged.
MAX_INDEX_FILE_BYTES = 1 << 36
READ_WAIT_S = 5.0  # how long a reader waits for a writer's lock by default (a commit holds it for well under that)
WRITE_WAIT_S = 30.0  # a writer waits behind readers and other writers' commits (a large commit writes for seconds)

# What a manifest must hold, with the types a field may have; anything else is a damaged manifest.
_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (str,),
    "model": (str, type(None)),
    "dtype": (str,),
    "fingerprint": (str,),
    "architecture": (str,),
    "weights": (str,),
    "embedder": (str, type(None)),
    "dim": (int,),
    "chunk_tokens": (int,),
    "overlap": (int,),
    "storage_dtype": (str,),
}


class IndexWarning(UserWarning):
    """An index file was damaged and rebuilt (the vectors, re-embedded from the stored texts)."""


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file, at most `limit`, opened without following a link and without blocking: a link,
    a FIFO, a device or a socket at `path` is an OSError (ELOOP, or "not a regular file"), never a hang or a read
    elsewhere; a larger file is `kvrag.files.TooLarge` (an OSError) before anything is read. FileNotFoundError when
    nothing is there."""
    return read_capped(path, limit)


def secret_check(secret: bytes) -> str:
    """What a manifest keeps of a tenant secret: enough to tell a wrong secret, nothing to recover it."""
    return hmac.new(secret, b"kvrag-secret-check/1", hashlib.sha256).hexdigest()[:32]


class IndexFolder:
    """One index folder: read its committed manifest and index, commit a new generation, lock it.

    Args:
        path: the folder (itself may be a link; nothing inside it may be).
        read_only: never create, lock-file, sweep or write anything (`kvrag ask`, `kvrag info`).
        secret: the secret the manifest's file checksums are HMACs under; None (default): the user's key
            (`kvrag.cache.secret`, read when first needed); b"" for an index built unkeyed.
        lock_timeout_s: the longest wait for the folder's lock, in seconds; None (default): READ_WAIT_S for a
            shared lock, WRITE_WAIT_S for the exclusive one.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        read_only: bool = False,
        secret: bytes | None = None,
        lock_timeout_s: float | None = None,
    ) -> None:
        self.path = Path(path)
        self.read_only, self._secret = read_only, secret
        self._defaulted = secret is None  # the user's key, not one the caller gave
        self.lock_timeout_s = check_wait(lock_timeout_s)

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            self._secret = user_key()
        return self._secret

    def inside(self, *parts: str) -> Path:
        """`path/parts...`, refused (IndexLoadError) when any part of it under the folder is a symbolic link."""
        at = self.path
        for part in parts:
            at = at / part
            try:
                linked = at.is_symlink()
            except OSError as err:
                raise IndexLoadError(f"cannot look at {at}: {err.strerror}") from err
            if linked:
                raise IndexLoadError(
                    f"{at} is a symbolic link: kvrag never follows links inside an index folder (one could make it "
                    "read, write or delete elsewhere); replace it with the real file or folder"
                )
        return at

    def exists(self) -> bool:
        """Whether the folder holds a committed index."""
        return self.inside(MANIFEST).is_file()

    def uncommitted(self) -> bool:
        """Whether the folder holds what a first ingest left before its first commit (its KV folder, index files or
        lock file) and no manifest: a first ingest interrupted, killed or failed."""
        if not self.path.is_dir() or self.exists():
            return False
        return any(os.path.lexists(self.path / name) for name in _LEFT_BY_INGEST)

    def absent(self) -> IndexLoadError:
        """The error for a folder that holds no committed index, saying what is there and what to do."""
        if self.uncommitted():
            entries, size = _entries_under(self.path / "kv")
            return IndexLoadError(
                f"the index folder {self.path} was interrupted before its first commit: it holds {entries} KV entries "
                f"({size:,} bytes) and no index. `kvrag gc --index {self.path}` removes them; ingesting into it "
                "again reuses them"
            )
        return IndexLoadError(f"no kvrag index at {self.path}: create one with `kvrag ingest PATH --index {self.path}`")

    def remove_uncommitted(self, *, dry_run: bool = False) -> tuple[int, int]:
        """Remove what a first ingest left before its first commit: the KV entries and temporary files it wrote, its
        index files and lock file, then each folder of them left empty (the index folder too). Nothing else is
        touched and no link is followed. Return the entries and their bytes (that would be removed, with `dry_run`).

        Held under the folder's exclusive lock, and a no-op once a commit has happened: a first ingest still running
        elsewhere commits, and its entries are left alone.
        """
        if not self.uncommitted():
            return 0, 0
        entries, size = _entries_under(self.path / "kv")
        if dry_run:
            return entries, size
        with self.lock():
            if self.exists():  # another process committed meanwhile: nothing here is a leftover
                return 0, 0
            for root, names in ((self.path / "kv", _KV_LEFTOVER), (self.path / "index", _INDEX_LEFTOVER)):
                _remove_matching(root, names)
            for tmp in self.path.glob(f".{MANIFEST}.*.tmp"):
                with contextlib.suppress(OSError):
                    tmp.unlink()
        with contextlib.suppress(OSError):
            (self.path / LOCK_FILE).unlink()
        with contextlib.suppress(OSError):
            self.path.rmdir()  # only when empty: whatever else the folder holds stays
        return entries, size

    def kv_folder(self) -> Path:
        """The folder of the index's own disk KV store (checked: not a link)."""
        return self.inside("kv")

    @contextlib.contextmanager
    def lock(self, *, shared: bool = False) -> Iterator[None]:
        """An advisory lock across processes (exclusive to write, shared to read). Read-only, an existing lock
        file is locked shared and a missing one is not created.

        Waited for at most `lock_timeout_s`, then LockTimeoutError names the process holding it (from the kernel's
        lock table where it has one, else the pid an exclusive holder writes into the lock file).
        """
        if fcntl is None or not self.path.is_dir():
            yield
            return
        path = self.inside(LOCK_FILE)
        flags = (os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT) | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
        try:
            fd: int | None = os.open(path, flags, FILE_MODE)
        except FileNotFoundError:  # read-only and never written by a writer of this kvrag: nothing to order
            fd = None
        except OSError as err:
            raise IndexLoadError(f"cannot open the lock file {path}: {err.strerror}") from err
        if fd is None:
            yield
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IndexLoadError(f"the lock file {path} is not a regular file: remove it")
        exclusive = not (shared or self.read_only)
        try:
            self._acquire(fd, path, exclusive)
            if exclusive:  # who holds it, for a process that waits too long (cleared before it is let go)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                if exclusive:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _acquire(self, fd: int, path: Path, exclusive: bool) -> None:
        """flock `fd`, polling, for at most the folder's wait; LockTimeoutError naming the holder past it."""
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        wait = self.lock_timeout_s if self.lock_timeout_s is not None else WRITE_WAIT_S if exclusive else READ_WAIT_S
        deadline, pause = time.monotonic() + wait, 0.005
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.1)
        holders = _holders(fd) or _pid_in(fd)
        who = ", ".join(f"pid {pid} ({how})" for pid, how in holders) or "another process"
        stuck = " (`kill` it if it is stuck)" if holders else ""
        raise LockTimeoutError(
            f"the index at {self.path} is locked by {who}: waited {wait:g} s to {'write' if exclusive else 'read'} "
            f"it. Retry when that process ends{stuck}, or wait longer with --lock-timeout SECONDS (lock_timeout_s=)"
        )

    def _read(self, *parts: str, limit: int = MAX_INDEX_FILE_BYTES) -> bytes:
        return read_regular(self.inside(*parts), limit)

    def manifest(self) -> dict[str, Any]:
        """The committed manifest, checked for this kvrag's index format and every field's type."""
        where = self.path / MANIFEST
        try:
            manifest = json.loads(self._read(MANIFEST, limit=MAX_MANIFEST_BYTES).decode("utf-8"))
        except FileNotFoundError:
            raise self.absent() from None
        except (OSError, ValueError) as err:
            raise IndexLoadError(f"the index manifest {where} is unreadable ({err}): re-ingest") from err
        if not isinstance(manifest, dict) or manifest.get("format") != INDEX_FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise IndexLoadError(f"{self.path} holds index format {found}, this kvrag reads {INDEX_FORMAT}: re-ingest")
        for name, types in _FIELDS.items():
            value = manifest.get(name)
            if name not in manifest or not isinstance(value, types) or isinstance(value, bool):
                raise IndexLoadError(
                    f"the index manifest {where} is damaged: {name!r} is {value!r}; re-ingest into a new folder"
                )
        if not GENERATION.fullmatch(manifest["index"]):
            raise IndexLoadError(
                f"the index manifest {where} is damaged: its index generation {manifest['index']!r} is not one kvrag "
                "writes (16 hex digits, a file inside the folder); re-ingest into a new folder"
            )
        if manifest["dim"] < 1 or manifest["chunk_tokens"] < 1 or manifest["overlap"] < 0:
            raise IndexLoadError(f"the index manifest {where} is damaged (dim, chunk_tokens or overlap); re-ingest")
        self._check_secret(manifest)
        return manifest

    def _mac(self, manifest: Mapping[str, Any]) -> str:
        """An HMAC under the secret over the whole manifest but this field: no field can be changed, dropped
        (the file checksums) or added by someone without the secret."""
        body = json.dumps({k: v for k, v in manifest.items() if k != "mac"}, sort_keys=True).encode()
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()

    def _check_secret(self, manifest: Mapping[str, Any]) -> None:
        check = manifest.get("secret_check")
        if check is None and self.secret:
            raise IndexLoadError(
                f"the index at {self.path} was built without a secret, so whoever can write its folder or store can "
                "forge its entries: re-ingest it (keyed by your kvrag key by default), or open it unkeyed with "
                "secret='' (--no-secret)"
            )
        if check is not None and not self.secret:
            raise IndexLoadError(
                f"the index at {self.path} was built with a tenant secret: pass it (secret=, or --secret-file)"
            )
        if check is not None and not hmac.compare_digest(str(check), secret_check(self.secret)):
            if self._defaulted:
                raise IndexLoadError(
                    f"the index at {self.path} was built with a secret that is not your kvrag key "
                    f"({user_key_path()}): pass it (secret=, or --secret-file)"
                )
            raise IndexLoadError(f"the secret given does not match the one the index at {self.path} was built with")
        if self.secret and not hmac.compare_digest(str(manifest.get("mac", "")), self._mac(manifest)):
            raise IndexLoadError(
                f"the index manifest {self.path / MANIFEST} was changed by someone without its secret (its HMAC does "
                "not match): re-ingest into a new folder"
            )

    def _digest(self, blob: bytes) -> str:
        if self.secret:
            return hmac.new(self.secret, blob, hashlib.sha256).hexdigest()
        return hashlib.sha256(blob).hexdigest()

    def load_index(
        self, manifest: Mapping[str, Any], embed: Callable[[list[str]], np.ndarray] | None = None
    ) -> ChunkIndex:
        """The index generation that `manifest` commits, its files checked against the manifest's checksums.

        A damaged records file is an IndexLoadError; a damaged vectors file, with `embed` given, is rebuilt
        by embedding the records' texts (an IndexWarning says so).
        """
        vectors_name, chunks_name = index_files(manifest["index"])
        sums = manifest.get("checksums") if isinstance(manifest.get("checksums"), dict) else {}
        sizes = manifest.get("sizes") if isinstance(manifest.get("sizes"), dict) else {}

        def cap(kind: str) -> int:  # the size the manifest committed: a file grown or swapped since is refused
            size = sizes.get(kind)
            fits = isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_INDEX_FILE_BYTES
            return size if fits else MAX_INDEX_FILE_BYTES

        damaged = f"the index at {self.path} is damaged"
        try:
            chunks = self._read("index", chunks_name, limit=cap("chunks"))
            if "chunks" in sums and not hmac.compare_digest(self._digest(chunks), str(sums["chunks"])):
                raise IndexLoadError(
                    f"{damaged}: {chunks_name} does not match the checksum its manifest committed (changed after it "
                    "was written); re-ingest into a new folder"
                )
            try:
                vectors: bytes | None = self._read("index", vectors_name, limit=cap("vectors"))
            except (FileNotFoundError, TooLarge):
                if embed is None:
                    raise
                vectors = None
            if vectors is not None and "vectors" in sums:
                if not hmac.compare_digest(self._digest(vectors), str(sums["vectors"])):
                    vectors = None
                    if embed is None:
                        raise IndexLoadError(f"{damaged}: {vectors_name} does not match its checksum; re-ingest")
            rebuilt = vectors is None
            index = ChunkIndex.from_bytes(manifest["dim"], vectors, chunks, embed)
        except IndexLoadError:
            raise
        except (OSError, RuntimeError, ValueError, TypeError, KeyError, OverflowError) as err:
            raise IndexLoadError(f"{damaged} ({err}): re-ingest into a new folder") from err
        if rebuilt:
            warnings.warn(
                f"kvrag: the vectors file of the index at {self.path} was damaged; rebuilt by embedding the "
                f"{len(index)} stored chunk texts (the next ingest writes it anew)",
                IndexWarning,
                stacklevel=3,
            )
        return index

    def commit(self, index: ChunkIndex, manifest: Mapping[str, Any]) -> str:
        """Write `index` under a new generation and commit it with `manifest`; return the generation.

        The caller holds the exclusive lock. A write that fails (a full disk) raises StoreError and leaves
        the committed index as it was.
        """
        if self.read_only:
            raise StoreError(f"the index at {self.path} is open read-only: nothing can be committed")
        generation = uuid.uuid4().hex[:16]
        folder = self.inside("index")
        written: list[Path] = []
        try:
            written = index.save(folder, generation)
            blobs = {kind: path.read_bytes() for kind, path in zip(("vectors", "chunks"), written)}
            sums = {kind: self._digest(blob) for kind, blob in blobs.items()}
            sizes = {kind: len(blob) for kind, blob in blobs.items()}  # what a read of each file is capped at
            body = {"format": INDEX_FORMAT, "index": generation, **manifest, "checksums": sums, "sizes": sizes}
            if self.secret:
                body["secret_check"] = secret_check(self.secret)
                body["mac"] = self._mac(body)
            write_atomic(self.inside(MANIFEST), json.dumps(body, indent=1).encode())
        except OSError as err:
            for file in written:  # never committed: nothing refers to them
                with contextlib.suppress(OSError):
                    file.unlink()
            raise StoreError(
                f"cannot write the index under {self.path}: {err.strerror or err}; the index on disk is unchanged. "
                "Free space or choose another folder, then ingest again."
            ) from err
        # Earlier generations are unreferenced now, and a temporary file can only be a dead writer's: every
        # writer of the index holds the folder's exclusive lock. A link is removed itself, never its target.
        for old in [*folder.glob("*"), *self.path.glob(".*.tmp")]:
            if (old.is_symlink() or old.is_file()) and (generation not in old.name or old.name.endswith(".tmp")):
                with contextlib.suppress(OSError):
                    old.unlink()
        return generation


def check_wait(seconds: float | None) -> float | None:
    """A lock wait in seconds (None: the default), refused unless a finite number >= 0."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise InvalidRequestError(f"lock_timeout_s must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def _holders(fd: int) -> list[tuple[int, str]]:
    """The processes holding a lock on `fd`'s file, from the kernel's lock table (Linux `/proc/locks`), as (pid,
    "reading" or "writing"); [] where there is no such table."""
    info = os.fstat(fd)
    found = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            lines = table.read(1 << 22).splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or "->" in fields or fields[1] != "FLOCK":  # "->": a waiter, not a holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            pid = int(fields[4])
            same = int(inode) == info.st_ino and (int(major, 16), int(minor, 16)) == (
                os.major(info.st_dev),
                os.minor(info.st_dev),
            )
        except ValueError:
            continue
        if same and pid != os.getpid() and pid > 0:
            found.append((pid, "writing" if fields[3] == "WRITE" else "reading"))
    return found


def _pid_in(fd: int) -> list[tuple[int, str]]:
    """The pid an exclusive holder wrote into the lock file, if that process is alive."""
    try:
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
        os.kill(pid, 0)
    except (OSError, ValueError, UnicodeDecodeError):
        return []
    return [(pid, "writing")] if pid != os.getpid() else []


# What a first ingest makes in an index folder before its first commit.
_LEFT_BY_INGEST = ("kv", "index", LOCK_FILE)
# The files a first ingest writes under kv/ (entries and their temporary files, in a bucket or a namespace's
# bucket) and under index/ (a generation's files and their temporary files).
_KV_LEFTOVER = re.compile(r"(ns-[A-Za-z0-9][A-Za-z0-9_.-]*/)?[0-9a-f]{2}/([0-9a-f]{64}\.kv\.safetensors|\..*\.tmp)")
_INDEX_LEFTOVER = re.compile(r"(vectors|chunks)-[0-9a-f]{16}\.(safetensors|jsonl)|\..*\.tmp")


def _walk(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every path under `root` with its lstat, deepest first; a link is listed, never walked."""
    try:
        if not stat.S_ISDIR(root.lstat().st_mode):
            return
    except OSError:
        return
    for here, folders, files in os.walk(root, topdown=False):  # os.walk never descends into a link
        for name in [*files, *folders]:
            path = Path(here) / name
            with contextlib.suppress(OSError):
                yield path, path.lstat()


def _entries_under(kv: Path) -> tuple[int, int]:
    """The KV entry files under a KV folder (namespaces' too) and their bytes."""
    count = size = 0
    for path, info in _walk(kv):
        if stat.S_ISREG(info.st_mode) and path.name.endswith(".kv.safetensors"):
            count, size = count + 1, size + info.st_size
    return count, size


def _remove_matching(root: Path, names: re.Pattern[str]) -> None:
    """Remove the files (or links) under `root` whose path relative to it matches `names`, and each folder left
    empty, `root` included."""
    for path, info in _walk(root):
        relative = path.relative_to(root).as_posix()
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(info.st_mode):
                path.rmdir()  # only when empty
            elif names.fullmatch(relative):
                path.unlink()  # a link itself, never its target
    with contextlib.suppress(OSError):
        root.rmdir()
