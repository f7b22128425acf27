"""How kvrag writes the files it keeps: one mode policy for all of them, and atomic replacement.

Everything an index folder and a disk store hold (the manifest, the chunk records with the documents' text, the
vectors, the tuned default, the lock file, the KV entries) is private to the user who wrote it: files 0600 and
folders 0700, whatever the umask. The text of the documents is as sensitive as their KV. Processes of several users
share an index through one account (or a service), not through group bits; a store shared between machines is a
Redis store, keyed with a shared secret file (docs/reliability.md).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


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
