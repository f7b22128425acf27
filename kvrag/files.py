"""How kvrag writes the files it keeps: one mode policy for all of them, and atomic replacement.

Everything an index folder and a disk store hold (the manifest, the chunk records with the documents' text, the
vectors, the tuned default, the lock file, the KV entries) is private to the user who wrote it: files 0600 and
folders 0700, whatever the umask. The text of the documents is as sensitive as their KV. Processes of several users
share an index through one account (or a service), not through group bits; a store shared between machines is a
Redis store, keyed with a shared secret file (docs/reliability.md).

Reading: `read_capped` is how kvrag reads a file it keeps or is given: a regular file only (never a FIFO's endless
wait or a device's endless bytes), no more bytes than the caller says the file can hold (never a MemoryError).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


class TooLarge(OSError):
    """A file holds more bytes than the caller's bound on what it can be (a sparse file, a damaged size)."""


def read_capped(path: Path, limit: int, *, follow_links: bool = False) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them.

    Opened without blocking, so a FIFO, a device or a socket is an OSError ("not a regular file") at once, never a
    hang; without following a link unless `follow_links` (ELOOP). A file larger than `limit` is `TooLarge` before
    anything is read. FileNotFoundError when nothing is there.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if info.st_size > limit:
            raise TooLarge(errno.EFBIG, f"{path} holds {info.st_size:,} bytes, more than the {limit:,} it can")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            blob = f.read(limit + 1)  # a file grown since fstat is still read no further than the bound
        if len(blob) > limit:
            raise TooLarge(errno.EFBIG, f"{path} holds more than the {limit:,} bytes it can")
        return blob
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`path` and its missing parents, each new one made 0700 (an existing folder keeps its mode; `mkdir(parents=
    True)` would make the parents by the umask)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=DIR_MODE, exist_ok=True)


def write_atomic(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` (mode 0600) through a temporary file in the same folder: fsynced, then renamed.

    A reader sees the old file or the new one, never a part; on any error the temporary file is removed
    and the old file is left as it was.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)  # a leftover temporary file of another mode is made private too
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def default_cache_dir() -> Path:
    """Where kvrag caches what it makes once (converted weights, digests, built kernels): the user's cache
    directory, under kvrag/."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvrag"))
