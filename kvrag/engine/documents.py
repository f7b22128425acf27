"""Documents in: texts, files and (text, metadata) pairs, and the token-based splitter with overlap.

Files are read by a loader chosen by suffix (.txt, .md, .rst built in; `register_loader` adds more); a file of
any other suffix, or none (a package's METADATA, a LICENSE), is read when it is text (no NUL byte, UTF-8). A
file whose content cannot be read (binary, not UTF-8, empty, over the size limit) is skipped and named with its
reason (`Skipped`), so one bad file never stops the others; what a file is (a link not to be followed, a FIFO,
a missing path) is refused with an error. Chunks keep the document's exact characters: windows are cut at token
offsets, ending on a line or sentence break when one is near. This module never touches the model or the index.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from kvrag.errors import DocumentError, EmptyInputError, InvalidRequestError
from kvrag.model.layout import check_unicode


@dataclass(slots=True)
class Document:
    """A text to ingest."""

    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    id: str = ""  # stable id; derived from the path or the text when empty


@dataclass(slots=True)
class Skipped:
    """A file ingestion passed over: its content could not be read as text."""

    path: str  # as found (given, or under a given folder)
    reason: str  # what was wrong and what to do, e.g. "binary (it holds NUL bytes)"


Item = Union[str, Path, Document, "tuple[str, Mapping[str, Any]]"]


class _Unreadable(Exception):
    """A file's content is not text kvrag can read: skipped (or, asked strictly, refused) with this reason."""


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DocumentError(f"{path} is not UTF-8 text (byte {err.start}): convert it to UTF-8 first") from err


def _text_of(path: Path) -> str:
    """A file's text when it is text: no NUL byte (a binary file, or UTF-16) and valid UTF-8."""
    data = path.read_bytes()
    if b"\x00" in data:
        raise _Unreadable("binary, or text not in UTF-8 (it holds NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _Unreadable(f"not UTF-8 text (byte {err.start}): convert it to UTF-8 first") from None


MAX_FILE_BYTES = 64 << 20  # the default cap on one input file (`max_file_bytes`, `kvrag ingest --max-file-mb`)


LOADERS: dict[str, Callable[[Path], str]] = {".txt": _read_text, ".md": _read_text, ".rst": _read_text}


def register_loader(suffix: str, loader: Callable[[Path], str]) -> None:
    """Read files ending in `suffix` (e.g. ".html") with `loader(path) -> text`."""
    LOADERS[suffix.lower()] = loader


def _files_under(path: Path, follow_symlinks: bool, skipped: list[Skipped]) -> list[Path]:
    """Every file under a folder, sorted; hidden entries (".git", ".env") and kvrag index folders are skipped by
    name, never walked; links to folders are listed (refused by the caller unless links are followed)."""
    from kvrag.engine.folder import MANIFEST

    files = []
    for root, dirs, names in os.walk(path, followlinks=follow_symlinks):
        dirs.sort()
        for d in [d for d in dirs if d.startswith(".") or (Path(root, d) / MANIFEST).is_file()]:
            dirs.remove(d)
            why = "a hidden folder: not walked (name it to ingest it)" if d.startswith(".") else "a kvrag index folder"
            skipped.append(Skipped(str(Path(root, d)), why))
        linked = [d for d in dirs if Path(root, d).is_symlink()] if not follow_symlinks else []
        for n in sorted(names):
            if n.startswith("."):
                skipped.append(Skipped(str(Path(root, n)), "a hidden file: not read (name it to ingest it)"))
            else:
                files.append(Path(root, n))
        files += [Path(root, d) for d in linked]  # refused below, by name, rather than skipped unseen
    return files


def _load_path(
    path: Path, skipped: list[Skipped], *, follow_symlinks: bool = False, max_bytes: int = MAX_FILE_BYTES
) -> list[Document]:
    """The documents of a file, or of every readable file under a folder; a file whose content cannot be read is
    added to `skipped` instead.

    Regular files only (never a FIFO, device or socket, which could hang or never end), each at most
    `max_bytes`; a symbolic link is refused unless `follow_symlinks`. A document's id is its resolved path,
    so two spellings of one file are one document.
    """
    if path.is_symlink() and not follow_symlinks:
        raise DocumentError(
            f"{path} is a symbolic link: kvrag does not follow links unless asked (follow_symlinks=True, "
            "`kvrag ingest --follow-symlinks`)"
        )
    if path.is_dir():
        files = _files_under(path, follow_symlinks, skipped)
        if not files and not skipped:
            raise DocumentError(f"{path} holds no file kvrag can read: it is empty")
        load = dict(follow_symlinks=follow_symlinks, max_bytes=max_bytes)
        return [doc for f in files for doc in _load_path(f, skipped, **load)]
    if not path.exists():
        raise DocumentError(f"{path} does not exist")
    try:
        info = path.stat()
    except OSError as err:
        raise DocumentError(f"cannot read {path}: {err.strerror}") from err
    if not stat.S_ISREG(info.st_mode):
        raise DocumentError(f"{path} is not a regular file (a FIFO, device or socket): kvrag reads regular files only")
    try:
        if info.st_size > max_bytes:
            raise _Unreadable(
                f"{info.st_size / 1e6:.1f} MB, over the {max_bytes / 1e6:.1f} MB limit on one file: split it, or "
                "raise the limit (max_file_bytes=, `kvrag ingest --max-file-mb`)"
            )
        loader = LOADERS.get(path.suffix.lower())
        try:
            text = _text_of(path) if loader in (None, _read_text) else loader(path)
        except DocumentError as err:  # a registered loader's refusal
            raise _Unreadable(str(err)) from None
        except OSError as err:
            raise _Unreadable(f"cannot read it: {err.strerror}") from None
        if not text.strip():
            raise _Unreadable("empty or whitespace only: nothing to ingest")
    except _Unreadable as why:
        skipped.append(Skipped(str(path), str(why)))
        return []
    return [Document(text=text, metadata={"source": str(path)}, id=str(path.resolve()))]


def named(skipped: Sequence[Skipped], most: int = 10) -> str:
    """Skipped files as one line: each path and its reason, the first `most` of them."""
    shown = "; ".join(f"{s.path}: {s.reason}" for s in skipped[:most])
    return shown + (f"; and {len(skipped) - most} more" if len(skipped) > most else "")


def check_metadata(metadata: Any, what: str) -> dict[str, Any]:
    """Metadata as the index keeps it (in JSON): str keys, each to a JSON scalar (str, finite number, bool,
    None) or a list of them; a tuple becomes a list. Returns a new dict."""
    if not isinstance(metadata, Mapping):
        raise InvalidRequestError(
            f'{what} is a {type(metadata).__name__}: give a dict of str keys, e.g. {{"source": "a.txt"}}'
        )
    checked: dict[str, Any] = {}
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise InvalidRequestError(
                f"{what} has the key {key!r}, a {type(key).__name__}: metadata keys must be str (e.g. {str(key)!r})"
            )
        check_unicode(key, f"{what}'s key {key!r}")
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise InvalidRequestError(f"{what}[{key!r}] holds {v!r}: metadata numbers must be finite")
            if not isinstance(v, (str, int, float, bool, type(None))):
                raise InvalidRequestError(
                    f"{what}[{key!r}] is {value!r}: a metadata value must be a str, number, bool or None, "
                    "or a list of them (convert it, e.g. a set to a sorted list)"
                )
            if isinstance(v, str):
                check_unicode(v, f"{what}[{key!r}]")
        checked[key] = list(value) if isinstance(value, (list, tuple)) else value
    return checked


def to_documents(
    items: Item | Iterable[Item],
    metadata: Mapping[str, Any] | None = None,
    *,
    follow_symlinks: bool = False,
    max_file_bytes: int = MAX_FILE_BYTES,
    skipped: list[Skipped] | None = None,
) -> list[Document]:
    """Normalize what `ingest` accepts: a str is text, a Path is a file or folder, a pair is (text, metadata).

    Files are regular files of at most `max_file_bytes`; symbolic links are refused unless `follow_symlinks`.
    A file whose content cannot be read is added to `skipped` when a list is given (a DocumentError naming every
    one when nothing else is left to ingest), else refused at once with a DocumentError.
    """
    single_pair = isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], Mapping)
    if isinstance(items, (str, Path, Document)) or single_pair:
        items = [items]  # type: ignore[list-item]
    if isinstance(items, (bytes, bytearray, Mapping)) or not isinstance(items, Iterable):
        raise InvalidRequestError(
            f"cannot ingest a {type(items).__name__}: give a str text, a pathlib.Path file or folder, a (text, "
            "metadata) pair, a kvrag.Document, or a list of them"
        )
    if metadata is not None:
        metadata = check_metadata(metadata, "metadata")
    docs: list[Document] = []
    passed: list[Skipped] = [] if skipped is None else skipped
    for item in items:  # type: ignore[union-attr]
        if isinstance(item, Document):
            if not isinstance(item.id, str):
                raise InvalidRequestError(f"a Document's id is a {type(item.id).__name__}: give it a str (or '')")
            check_unicode(item.id, "a Document's id")
            docs.append(Document(item.text, check_metadata(item.metadata, "a Document's metadata"), item.id))
        elif isinstance(item, Path):
            docs.extend(_load_path(item, passed, follow_symlinks=follow_symlinks, max_bytes=max_file_bytes))
            if skipped is None and passed:
                raise DocumentError(f"cannot ingest {named(passed, 1)}")
        elif isinstance(item, str):
            docs.append(Document(text=item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Mapping):
            docs.append(Document(text=item[0], metadata=check_metadata(item[1], "a pair's metadata")))
        else:
            raise InvalidRequestError(
                f"cannot ingest a {type(item).__name__}: give str texts, pathlib.Path files or "
                "folders, (text, metadata) pairs or kvrag.Document"
            )
    if not docs and passed:
        raise DocumentError(f"nothing to ingest: every file was skipped: {named(passed)}")
    if not docs:
        raise EmptyInputError("no documents given: nothing to ingest (pass texts, files or Documents)")
    for doc in docs:
        if not isinstance(doc.text, str):
            raise InvalidRequestError(f"a Document's text is a {type(doc.text).__name__}: give it a str")
        if metadata:
            doc.metadata = {**metadata, **doc.metadata}
        check_metadata(doc.metadata, "the metadata of " + str(doc.metadata.get("source", "a document")))
        if not doc.text.strip():
            where = doc.metadata.get("source", "a document")
            raise EmptyInputError(f"{where} is empty or whitespace only: nothing to ingest")
        check_unicode(doc.text, str(doc.metadata.get("source", "a document")))
        if not doc.id:
            doc.id = "text-" + hashlib.sha256(doc.text.encode()).hexdigest()[:16]
    return docs


_BREAKS = ("\n\n", "\n", ". ", "? ", "! ", "; ", ", ", " ")


def split_text(text: str, tokenizer: Any, *, chunk_tokens: int = 200, overlap: int = 20) -> list[str]:
    """Cut text into windows of at most `chunk_tokens` tokens, each sharing ~`overlap` tokens with the last.

    A window ends at the strongest break (paragraph, line, sentence, word) in its last quarter.
    """
    if chunk_tokens < 8:
        raise InvalidRequestError(f"chunk_tokens must be at least 8, got {chunk_tokens}")
    if not 0 <= overlap < chunk_tokens // 2:
        raise InvalidRequestError(f"overlap must be in 0..{chunk_tokens // 2 - 1}, got {overlap}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets: Sequence[tuple[int, int]] = enc["offset_mapping"]
    if len(offsets) <= chunk_tokens:
        return [text.strip()] if text.strip() else []
    chunks, start = [], 0
    while start < len(offsets):
        end = min(start + chunk_tokens, len(offsets))
        if end < len(offsets):
            window_end = offsets[end - 1][1]
            floor = offsets[start + (3 * chunk_tokens) // 4][0]
            for mark in _BREAKS:
                cut = text.rfind(mark, floor, window_end)
                if cut > 0:
                    cut += len(mark)
                    end = next(i for i in range(start + 1, end + 1) if i == end or offsets[i][0] >= cut)
                    break
        piece = text[offsets[start][0] : offsets[end - 1][1]].strip()
        if piece:
            chunks.append(piece)
        if end >= len(offsets):
            break
        start = max(end - overlap, start + 1)
    return chunks
