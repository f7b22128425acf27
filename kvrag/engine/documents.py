"""Documents in: texts, files and (text, metadata) pairs, and the token-based splitter with overlap.

Files are read by a loader chosen by suffix (.txt, .md, .rst built in; `register_loader` adds more).
Chunks keep the document's exact characters: windows are cut at token offsets, ending on a line or
sentence break when one is near. This module never touches the model or the index.
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


Item = Union[str, Path, Document, "tuple[str, Mapping[str, Any]]"]


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DocumentError(f"{path} is not UTF-8 text (byte {err.start}): convert it to UTF-8 first") from err


MAX_FILE_BYTES = 64 << 20  # the default cap on one input file (`max_file_bytes`, `kvrag ingest --max-file-mb`)


LOADERS: dict[str, Callable[[Path], str]] = {".txt": _read_text, ".md": _read_text, ".rst": _read_text}


def register_loader(suffix: str, loader: Callable[[Path], str]) -> None:
    """Read files ending in `suffix` (e.g. ".html") with `loader(path) -> text`."""
    LOADERS[suffix.lower()] = loader


def _load_path(path: Path, *, follow_symlinks: bool = False, max_bytes: int = MAX_FILE_BYTES) -> list[Document]:
    """The documents of a file, or of every readable file under a folder.

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
        files = []
        for root, dirs, names in os.walk(path, followlinks=follow_symlinks):
            dirs.sort()
            linked = [d for d in dirs if Path(root, d).is_symlink()] if not follow_symlinks else []
            files += [Path(root, n) for n in sorted(names) if Path(n).suffix.lower() in LOADERS]
            files += [Path(root, d) for d in linked]  # refused below, by name, rather than skipped unseen
        if not files:
            raise DocumentError(f"{path} holds no file kvrag can read ({', '.join(sorted(LOADERS))})")
        return [doc for f in files for doc in _load_path(f, follow_symlinks=follow_symlinks, max_bytes=max_bytes)]
    if not path.exists():
        raise DocumentError(f"{path} does not exist")
    try:
        info = path.stat()
    except OSError as err:
        raise DocumentError(f"cannot read {path}: {err.strerror}") from err
    if not stat.S_ISREG(info.st_mode):
        raise DocumentError(f"{path} is not a regular file (a FIFO, device or socket): kvrag reads regular files only")
    if info.st_size > max_bytes:
        raise DocumentError(
            f"{path} is {info.st_size / 1e6:.1f} MB, over the {max_bytes / 1e6:.1f} MB limit on one file: split it, "
            "or raise the limit (max_file_bytes=, `kvrag ingest --max-file-mb`)"
        )
    loader = LOADERS.get(path.suffix.lower())
    if loader is None:
        raise DocumentError(
            f"cannot read {path}: supported types are {', '.join(sorted(LOADERS))} "
            "(add one with kvrag.engine.documents.register_loader)"
        )
    try:
        text = loader(path)
    except OSError as err:
        raise DocumentError(f"cannot read {path}: {err.strerror}") from err
    return [Document(text=text, metadata={"source": str(path)}, id=str(path.resolve()))]


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
) -> list[Document]:
    """Normalize what `ingest` accepts: a str is text, a Path is a file or folder, a pair is (text, metadata).

    Files are regular files of at most `max_file_bytes`; symbolic links are refused unless `follow_symlinks`.
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
    for item in items:  # type: ignore[union-attr]
        if isinstance(item, Document):
            if not isinstance(item.id, str):
                raise InvalidRequestError(f"a Document's id is a {type(item.id).__name__}: give it a str (or '')")
            check_unicode(item.id, "a Document's id")
            docs.append(Document(item.text, check_metadata(item.metadata, "a Document's metadata"), item.id))
        elif isinstance(item, Path):
            docs.extend(_load_path(item, follow_symlinks=follow_symlinks, max_bytes=max_file_bytes))
        elif isinstance(item, str):
            docs.append(Document(text=item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Mapping):
            docs.append(Document(text=item[0], metadata=check_metadata(item[1], "a pair's metadata")))
        else:
            raise InvalidRequestError(
                f"cannot ingest a {type(item).__name__}: give str texts, pathlib.Path files or "
                "folders, (text, metadata) pairs or kvrag.Document"
            )
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
