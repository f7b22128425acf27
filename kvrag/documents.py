"""Documents in: texts, files and (text, metadata) pairs, and the token-based splitter with overlap.

Files are read by a loader chosen by suffix (.txt, .md, .rst built in; `register_loader` adds more).
Chunks keep the document's exact characters: windows are cut at token offsets, ending on a line or
sentence break when one is near. This module never touches the model or the index.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from kvrag.errors import DocumentError, EmptyInputError, InvalidRequestError
from kvrag.layout import check_unicode


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


LOADERS: dict[str, Callable[[Path], str]] = {".txt": _read_text, ".md": _read_text, ".rst": _read_text}


def register_loader(suffix: str, loader: Callable[[Path], str]) -> None:
    """Read files ending in `suffix` (e.g. ".html") with `loader(path) -> text`."""
    LOADERS[suffix.lower()] = loader


def _load_path(path: Path) -> list[Document]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOADERS)
        if not files:
            raise DocumentError(f"{path} holds no file kvrag can read ({', '.join(sorted(LOADERS))})")
        return [doc for f in files for doc in _load_path(f)]
    if not path.exists():
        raise DocumentError(f"{path} does not exist")
    loader = LOADERS.get(path.suffix.lower())
    if loader is None:
        raise DocumentError(
            f"cannot read {path}: supported types are {', '.join(sorted(LOADERS))} "
            "(add one with kvrag.documents.register_loader)"
        )
    try:
        text = loader(path)
    except OSError as err:
        raise DocumentError(f"cannot read {path}: {err.strerror}") from err
    return [Document(text=text, metadata={"source": str(path)}, id=str(path))]


def to_documents(items: Item | Iterable[Item], metadata: Mapping[str, Any] | None = None) -> list[Document]:
    """Normalize what `ingest` accepts: a str is text, a Path is a file or folder, a pair is (text, metadata)."""
    single_pair = isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], Mapping)
    if isinstance(items, (str, Path, Document)) or single_pair:
        items = [items]  # type: ignore[list-item]
    docs: list[Document] = []
    for item in items:  # type: ignore[union-attr]
        if isinstance(item, Document):
            docs.append(Document(item.text, dict(item.metadata), item.id))
        elif isinstance(item, Path):
            docs.extend(_load_path(item))
        elif isinstance(item, str):
            docs.append(Document(text=item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Mapping):
            docs.append(Document(text=item[0], metadata=dict(item[1])))
        else:
            raise InvalidRequestError(
                f"cannot ingest a {type(item).__name__}: give str texts, pathlib.Path files or "
                "folders, (text, metadata) pairs or kvrag.Document"
            )
    for doc in docs:
        if not isinstance(doc.text, str):
            raise InvalidRequestError(f"a Document's text is a {type(doc.text).__name__}: give it a str")
        if metadata:
            doc.metadata = {**metadata, **doc.metadata}
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
