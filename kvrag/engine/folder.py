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
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import stat
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from kvrag.cache.secret import user_key, user_key_path
from kvrag.engine.index import ChunkIndex, index_files
from kvrag.errors import IndexLoadError, StoreError
from kvrag.files import FILE_MODE, write_atomic

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


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file, opened without following a link and without blocking: a link, a FIFO, a
    device or a socket at `path` is an OSError (ELOOP, or "not a regular file"), never a hang or a read
    elsewhere. FileNotFoundError when nothing is there."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


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
    """

    def __init__(self, path: str | Path, *, read_only: bool = False, secret: bytes | None = None) -> None:
        self.path = Path(path)
        self.read_only, self._secret = read_only, secret
        self._defaulted = secret is None  # the user's key, not one the caller gave

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

    def kv_folder(self) -> Path:
        """The folder of the index's own disk KV store (checked: not a link)."""
        return self.inside("kv")

    @contextlib.contextmanager
    def lock(self, *, shared: bool = False) -> Iterator[None]:
        """An advisory lock across processes (exclusive to write, shared to read). Read-only, an existing lock
        file is locked shared and a missing one is not created."""
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
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared or self.read_only else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _read(self, *parts: str) -> bytes:
        return read_regular(self.inside(*parts))

    def manifest(self) -> dict[str, Any]:
        """The committed manifest, checked for this kvrag's index format and every field's type."""
        where = self.path / MANIFEST
        try:
            manifest = json.loads(self._read(MANIFEST).decode("utf-8"))
        except FileNotFoundError:
            raise IndexLoadError(
                f"no kvrag index at {self.path}: create one with `kvrag ingest PATH --index {self.path}`"
            ) from None
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
        damaged = f"the index at {self.path} is damaged"
        try:
            chunks = self._read("index", chunks_name)
            if "chunks" in sums and not hmac.compare_digest(self._digest(chunks), str(sums["chunks"])):
                raise IndexLoadError(
                    f"{damaged}: {chunks_name} does not match the checksum its manifest committed (changed after it "
                    "was written); re-ingest into a new folder"
                )
            try:
                vectors: bytes | None = self._read("index", vectors_name)
            except FileNotFoundError:
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
            sums = {kind: self._digest(path.read_bytes()) for kind, path in zip(("vectors", "chunks"), written)}
            body = {"format": INDEX_FORMAT, "index": generation, **manifest, "checksums": sums}
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
