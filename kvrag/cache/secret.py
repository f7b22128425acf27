"""The secret a store's entries are keyed with: the caller's, or by default the user's own key.

Every entry kvrag writes to a disk or Redis store, and every index manifest, is authenticated with an HMAC under a
secret, and every store key is an HMAC under it too: an entry forged by someone who can write the store but does not
hold the secret is a miss, and a tenant who knows another's labels computes none of its keys. Unless told otherwise
that secret is the user's key, 32 random bytes made on first use in the user's config folder
(`$XDG_CONFIG_HOME/kvrag/key`, else `~/.config/kvrag/key`), readable by the user alone. Processes that share a store
share its secret by file (`--secret-file`, `secret_file=`). docs/reliability.md states the threat model.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from kvrag.errors import InvalidRequestError

KEY_BYTES = 32


def user_key_path() -> Path:
    """Where the user's key lives: `$XDG_CONFIG_HOME/kvrag/key`, else `~/.config/kvrag/key`."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "kvrag" / "key"


def user_key() -> bytes:
    """The user's key, made on first use (hex of 32 random bytes, mode 0600, in a folder of mode 0700). A key file
    that others may read, or that is not a regular file of the user's, is refused: it would key nothing."""
    path = user_key_path()
    if not os.path.lexists(path):
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # written whole under a temporary name, then linked into place: a process that reads it never sees
            # part of a key, and of two first uses at once one key wins (the other's link fails, it reads the winner)
            fd, tmp = tempfile.mkstemp(prefix=".key.", dir=path.parent)  # 0600
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(secrets.token_hex(KEY_BYTES))
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        except OSError as err:
            raise InvalidRequestError(
                f"cannot make the user's kvrag key at {path}: {err.strerror}; give a secret instead (--secret-file, "
                "secret=)"
            ) from None
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise InvalidRequestError(f"cannot read the user's kvrag key at {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise InvalidRequestError(
                f"the kvrag key at {path} is not a private file of this user (mode {stat.S_IMODE(info.st_mode):o}): "
                f"`chmod 600 {path}`, or remove it to have a new one made (indexes keyed with it then need re-ingest)"
            )
        key = f.read().strip()
    if len(key) < 16:
        raise InvalidRequestError(
            f"the kvrag key at {path} holds {len(key)} bytes, fewer than 16: remove it to have a new one made"
        )
    return key


def check_secret(secret: bytes | str | None) -> bytes:
    """A tenant secret as bytes: at least 16 bytes (e.g. `openssl rand -hex 32`); "" or b"" for none (unkeyed,
    anyone who can write the store can forge its entries); None is returned as b"" here (the caller decides whether
    None means the user's key: see `resolve_secret`)."""
    if secret is None or secret in ("", b""):
        return b""
    if isinstance(secret, str):
        secret = secret.encode("utf-8", "surrogatepass")
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise InvalidRequestError(
            "a tenant secret must be bytes or str of at least 16 bytes (e.g. the output of `openssl rand -hex 32`), "
            f"got {type(secret).__name__}"
            + (f" of {len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else "")
        )
    return bytes(secret)


def resolve_secret(secret: bytes | str | None, *, durable: bool) -> bytes:
    """The secret an engine keys with: the one given; for None, the user's key where entries go to a durable or
    shared store (disk, Redis: another writer could forge them), none for a store in this process's memory only."""
    if secret is None:
        return user_key() if durable else b""
    return check_secret(secret)
