"""The disk store: one codec entry a file, written to a temporary file and renamed, private to the user.

Every read is capped: an entry file is read no further than its own header says it holds and never past the
store's `max_entry_bytes`, so a sparse or forged file at a chunk's key is a damaged entry, never a MemoryError. The
folder is made at the first write: opening a store, or an ingest refused before it wrote, creates nothing.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator

from kvrag.cache.store.base import (
    DAMAGED,
    HEX_KEY,
    MAX_HEADER_BYTES,
    KVStore,
    SerializedStore,
    check_namespace,
    entry_size,
    header_length,
)
from kvrag.errors import InvalidRequestError, StoreError
from kvrag.files import make_dirs


class DiskStore(SerializedStore):
    """One safetensors file an entry under `root`, written to a temporary name and renamed into place.

    Concurrent writers of one key each rename a complete file, so a reader never sees half an entry; a
    full disk raises StoreError and leaves every stored entry as it was. Nothing under `root` is reached
    through a symbolic link: a linked bucket folder or entry is refused (StoreError), never followed.
    `read_only` opens an existing folder without creating, sweeping or writing anything. `max_entry_bytes` caps what
    one entry is read as (default `MAX_ENTRY_BYTES`): a larger file is a damaged entry, never read.

    `max_bytes` bounds the entries' bytes: past it, the least recently used entries are deleted (down to 90% of
    the bound, so the folder is rescanned once in a while, not at every write), never a `pin`ned one. Recency is
    the file's modification time, set again at each read, so processes sharing the folder evict in one order; an
    evicted entry is only a miss, its chunk recomputed (and stored again) where it is used. `evictions` counts
    them and `nbytes` is the bytes held.
    """

    LOW_WATER = 0.9  # eviction goes down to this share of max_bytes

    SUFFIX = ".kv.safetensors"
    STALE_TMP_S = 60.0  # a temporary file this old belongs to a writer that died (a live one renames in ms)

    def __init__(
        self,
        root: str | Path,
        storage_dtype: str = "float16",
        *,
        read_only: bool = False,
        max_bytes: int | None = None,
        max_entry_bytes: int | None = None,
    ) -> None:
        super().__init__(storage_dtype, max_entry_bytes)
        self.root = Path(root)
        self.read_only = read_only
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise InvalidRequestError(f"max_bytes must be a positive whole number of bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.evictions = 0
        self.pinned: set[str] = set()
        self._recent: OrderedDict[str, int] | None = None  # key -> bytes, least recently used first
        self._held = 0
        self._bound_lock = threading.Lock()
        if read_only:
            return
        if self.root.is_symlink():
            raise StoreError(f"{self.root} is a symbolic link: kvrag never follows links inside a KV store folder")
        self.sweep()  # the folder itself is made at the first write

    def scoped(self, namespace: str) -> KVStore:
        root = self.root / f"ns-{check_namespace(namespace)}"
        if root.is_symlink():
            raise StoreError(
                f"{root} is a symbolic link: kvrag never follows links inside a KV store folder; remove it"
            )
        scoped = DiskStore(
            root,
            self.storage_dtype,
            read_only=self.read_only,
            max_bytes=self.max_bytes,
            max_entry_bytes=self.max_entry_bytes,
        )
        scoped.view, scoped.legacy = namespace, self
        return scoped

    def sweep(self, *, older_than_s: float | None = None) -> int:
        """Remove temporary files left by writers killed before their rename (older than `older_than_s`,
        default STALE_TMP_S: never a live writer's); return how many."""
        return len(self.stale_temp_files(older_than_s, remove=True))

    def stale_temp_files(self, older_than_s: float | None = None, *, remove: bool = False) -> list[Path]:
        """Temporary files older than `older_than_s` in the real (not linked) bucket folders; removed with `remove`."""
        now, age, found = time.time(), self.STALE_TMP_S if older_than_s is None else older_than_s, []
        for bucket in self.root.glob("[0-9a-f][0-9a-f]"):
            if bucket.is_symlink() or not bucket.is_dir():
                continue  # a link is never walked: its target is outside the store
            for tmp in bucket.glob(".*.tmp"):
                try:
                    if not tmp.is_symlink() and now - tmp.lstat().st_mtime > age:
                        if remove:
                            tmp.unlink()
                        found.append(tmp)
                except OSError:
                    pass
        return found

    def _path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise StoreError(f"invalid store key {key!r}: keys are hex digests from kvrag.chunk_key")
        path = self.root / key[:2] / f"{key}{self.SUFFIX}"
        if path.parent.is_symlink():
            raise StoreError(
                f"{path.parent} is a symbolic link: kvrag never follows links inside a KV store folder; "
                "remove it (its entries are recomputed)"
            )
        return path

    def _read(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            blob = self._read_capped(path)  # never through a link, never a FIFO's endless wait
        except FileNotFoundError:
            return None
        except OSError as err:
            if path.is_symlink():
                raise StoreError(
                    f"{path} is a symbolic link: kvrag never follows links inside a KV store folder; remove it"
                ) from None
            raise StoreError(f"cannot read {path}: {err.strerror or err}") from err
        if self.max_bytes is not None and not self.read_only:
            self._used(key, path, len(blob))
        return blob

    def _read_capped(self, path: Path) -> bytes:
        """The entry file at `path`, read no further than its header says it holds; DAMAGED, unread, when that is
        not a well-formed entry's header, or the file holds more (or fewer) bytes than the header says, or more than
        `max_entry_bytes`."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"{path} is not a regular file")
            if info.st_size > self.max_entry_bytes:
                return DAMAGED
            if hasattr(os, "set_blocking"):
                os.set_blocking(fd, True)
            with os.fdopen(fd, "rb", closefd=False) as f:
                head = f.read(8)
                length = header_length(head)
                if length is None or 8 + length > info.st_size:
                    return DAMAGED
                header = f.read(min(length, MAX_HEADER_BYTES))
                size = entry_size(header)
                if size is None or size != info.st_size:
                    return DAMAGED
                blob = head + header + f.read(size - len(head) - len(header))
            return blob if len(blob) == size else DAMAGED  # a file cut short since fstat
        finally:
            os.close(fd)

    def _write(self, key: str, blob: bytes) -> None:
        path = self._path(key)
        tmp_name = None
        try:
            make_dirs(path.parent)  # the store's folder too, at its first entry
            if path.parent.is_symlink():  # made a link since _path looked: never write through it
                raise StoreError(f"{path.parent} is a symbolic link: kvrag never writes through one; remove it")
            fd, tmp_name = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, path)
            tmp_name = None
            if self.max_bytes is not None:
                self._used(key, None, len(blob))
                self._evict()
        except OSError as err:
            raise StoreError(
                f"cannot write a KV entry under {self.root}: {err.strerror or err}; nothing stored "
                "was changed. Free space or choose another folder."
            ) from err
        finally:
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name)
                except OSError:
                    pass

    def delete(self, key: str) -> None:
        if self.read_only:
            raise StoreError(f"the KV store {self.root} is open read-only: nothing can be deleted")
        path = self._path(key)
        try:
            if stat.S_ISDIR(path.lstat().st_mode):  # a folder at an entry's name: never an entry, never walked out of
                shutil.rmtree(path)
            else:
                path.unlink()  # a link itself, never its target; a FIFO or a socket too
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StoreError(f"cannot remove {path}: {err.strerror or err}") from err
        with self._bound_lock:
            if self._recent is not None and key in self._recent:
                self._held -= self._recent.pop(key)

    # -- the byte bound ----------------------------------------------------------------------------------

    def pin(self, keys: Iterable[str]) -> None:
        """Never evict these entries (a hot collection, the prompt prefix); they count against the bound."""
        self.pinned.update(keys)

    def _used(self, key: str, path: Path | None, size: int) -> None:
        """`key` was just read or written: the most recent entry (its file's time too, for other processes)."""
        if path is not None:
            try:
                os.utime(path)
            except OSError:
                pass
        with self._bound_lock:
            if self._recent is None:
                self._scan()  # once a store: what the folder holds, in its files' order
            assert self._recent is not None
            self._held += size - self._recent.pop(key, 0)
            self._recent[key] = size

    def _scan(self) -> None:
        """Every entry in the folder, least recently used first (by file time): other processes' writes too."""
        # file times are coarse (a clock tick): entries this process used keep its order among equal times
        rank = {key: n for n, key in enumerate(self._recent or ())}
        found = []
        for path in self._entries():
            try:
                info = path.lstat()
            except OSError:
                continue
            key = path.name[: -len(self.SUFFIX)]
            found.append((info.st_mtime_ns, rank.get(key, -1), key, info.st_size))
        found.sort()
        self._recent = OrderedDict((key, size) for _, _, key, size in found)
        self._held = sum(size for *_, size in found)

    def _evict(self) -> None:
        """Past the bound: rescan, then delete least recently used unpinned entries down to the low water mark."""
        assert self.max_bytes is not None
        with self._bound_lock:
            if self._recent is not None and self._held <= self.max_bytes:
                return
            self._scan()
            assert self._recent is not None
            if self._held <= self.max_bytes:
                return
            target = int(self.max_bytes * self.LOW_WATER)
            for key in [k for k in self._recent if k not in self.pinned]:
                if self._held <= target:
                    break
                try:
                    self._path(key).unlink()
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self._held -= self._recent.pop(key)
                self.evictions += 1

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        path = self._path(key)
        return not path.is_symlink() and path.is_file()

    def irregular(self, key: str) -> bool:
        """Whether something other than a regular file is at `key`'s entry (a link, a folder, a FIFO, a socket, a
        device): never an entry kvrag wrote, never read, and for `verify` a damaged one (`delete` removes it)."""
        try:
            return not stat.S_ISREG(self._path(key).lstat().st_mode)
        except FileNotFoundError:
            return False
        except OSError:
            return True

    def _entries(self) -> Iterator[Path]:
        for path in self.root.glob(f"[0-9a-f][0-9a-f]/*{self.SUFFIX}"):
            if HEX_KEY.fullmatch(path.name[: -len(self.SUFFIX)]) and not path.is_symlink():
                if not path.parent.is_symlink():
                    yield path

    def keys(self) -> Iterator[str]:
        for path in self._entries():
            yield path.name[: -len(self.SUFFIX)]

    @property
    def nbytes(self) -> int:
        total = 0
        for path in self._entries():
            try:
                total += path.lstat().st_size
            except OSError:
                pass
        return total
