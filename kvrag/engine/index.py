"""The chunk index: chunk records, a FAISS inner-product index on normalized embeddings, optional BM25.

Filters on metadata are applied before top-k (FAISS searches only the chunks that match). Saved as
safetensors (the vectors and their row ids) plus JSON lines (the records), never in a format that can run
code when read; the FAISS index is rebuilt from the vectors on load. This module never touches the LM or
the KV store.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from kvrag.errors import InvalidRequestError
from kvrag.files import make_dirs, write_atomic
from kvrag.rank import bm25, bm25_scores, fuse

Filters = Mapping[str, Any]  # metadata key -> required value, or a list/tuple/set of accepted values


@dataclass(slots=True)
class ChunkRecord:
    """One indexed chunk."""

    id: str  # "<doc_id>#<n>"
    doc_id: str  # the document it was cut from
    text: str  # the chunk text, exactly as encoded
    metadata: dict[str, Any] = field(default_factory=dict)  # the document's metadata
    key: str = ""  # the KV store key (kvrag.cache.kv.chunk_key)
    n_tokens: int = 0  # LM tokens of the chunk
    row: int = -1  # FAISS id
    after: int = 0  # earlier chunks of its document its KV was encoded behind (0: encoded alone; `KVRAG(encoding=)`)


SCALARS = (str, int, float, bool, type(None))


MAX_TOP_K = 10_000


def check_top_k(top_k: Any) -> int:
    """How many chunks a retrieval returns: an int in 1..MAX_TOP_K."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise InvalidRequestError(f"top_k must be an int in 1..{MAX_TOP_K}, got {top_k!r}")
    return top_k


def check_filters(filters: Any) -> dict[str, Any] | None:
    """Metadata filters as kvrag reads them: None, or a mapping of str keys to a value or a list of accepted values."""
    if filters is None:
        return None
    if not isinstance(filters, Mapping):
        raise InvalidRequestError(
            f"filters is a {type(filters).__name__}: give a dict of metadata key to value, e.g. "
            '{"source": "a.txt"} or {"year": [2023, 2024]}'
        )
    checked: dict[str, Any] = {}
    for name, wanted in filters.items():
        if not isinstance(name, str):
            raise InvalidRequestError(f"filter key {name!r} is a {type(name).__name__}: metadata keys are str")
        values = wanted if isinstance(wanted, (list, tuple, set, frozenset)) else [wanted]
        if not all(isinstance(v, SCALARS) for v in values):
            raise InvalidRequestError(
                f"filter {name!r} wants {wanted!r}: give a str, number, bool or None, or a list of them"
            )
        checked[name] = list(wanted) if isinstance(wanted, (set, frozenset)) else wanted
    return checked


def _matches(metadata: Mapping[str, Any], filters: Filters) -> bool:
    for name, wanted in filters.items():
        value = metadata.get(name)
        if isinstance(wanted, (list, tuple, set, frozenset)):
            if value not in wanted:
                return False
        elif value != wanted:
            return False
    return True


class ChunkIndex:
    """Records and vectors of the ingested chunks."""

    def __init__(self, dim: int) -> None:
        import faiss

        self.dim = dim
        self.vectors = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.records: dict[str, ChunkRecord] = {}
        self.by_row: dict[int, str] = {}
        self.next_row = 0
        self._bm25: Any = None

    def __len__(self) -> int:
        return len(self.records)

    def add(self, records: Sequence[ChunkRecord], vectors: np.ndarray) -> None:
        """Add records with their [N, dim] unit vectors."""
        rows = np.arange(self.next_row, self.next_row + len(records), dtype=np.int64)
        self.vectors.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), rows)
        for record, row in zip(records, rows):
            record.row = int(row)
            self.records[record.id] = record
            self.by_row[int(row)] = record.id
        self.next_row += len(records)
        self._bm25 = None

    def remove_doc(self, doc_id: str) -> list[ChunkRecord]:
        """Remove a document's chunks; return them (their KV keys are the caller's to delete)."""
        gone = [r for r in self.records.values() if r.doc_id == doc_id]
        if gone:
            self.vectors.remove_ids(np.array([r.row for r in gone], dtype=np.int64))
            for r in gone:
                del self.records[r.id]
                del self.by_row[r.row]
            self._bm25 = None
        return gone

    def copy(self) -> ChunkIndex:
        """An independent copy (records are shared: they are never changed once added)."""
        import faiss

        other = ChunkIndex.__new__(ChunkIndex)
        other.dim, other.vectors = self.dim, faiss.clone_index(self.vectors)
        other.records, other.by_row, other.next_row = dict(self.records), dict(self.by_row), self.next_row
        other._bm25 = self._bm25
        return other

    def docs(self) -> set[str]:
        return {r.doc_id for r in self.records.values()}

    def run_of(self, record: ChunkRecord) -> list[ChunkRecord]:
        """The chunks of `record`'s run, in document order: its document's consecutive chunks encoded in one
        context with it (`ChunkRecord.after` counts a run's earlier chunks; `kvrag.engine.runs`); itself alone
        where it was encoded alone."""
        doc, _, n = record.id.rpartition("#")
        if doc != record.doc_id or not n.isdigit():
            return [record]
        start = int(n) - record.after
        run: list[ChunkRecord] = []
        while (mate := self.records.get(f"{doc}#{start + len(run)}")) is not None and mate.after == len(run):
            run.append(mate)
        return run if record in run else [record]

    def similarity(self, vector: np.ndarray, record: ChunkRecord) -> float:
        """The cosine similarity of a unit `vector` and `record`'s chunk, as a dense search scores it."""
        return float(np.dot(np.asarray(vector, dtype=np.float32).ravel(), self.vectors.reconstruct(record.row)))

    def search(
        self, vector: np.ndarray, question: str, *, top_k: int, filters: Filters | None = None, bm25: bool = False
    ) -> list[tuple[ChunkRecord, float]]:
        """Top-k (record, score), best first, among the chunks that pass `filters`.

        Dense scores are cosine similarities. With `bm25`, the dense and BM25 rankings are fused by
        reciprocal rank (`kvrag.rank.fuse`).
        """
        if top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1, got {top_k}")
        import faiss

        allowed = [r.row for r in self.records.values() if not filters or _matches(r.metadata, filters)]
        if not allowed:
            return []
        k = min(top_k, len(allowed))
        params = None
        if filters:
            params = faiss.SearchParameters(sel=faiss.IDSelectorBatch(np.array(allowed, dtype=np.int64)))
        depth = len(allowed) if bm25 else k
        scores, rows = self.vectors.search(
            np.ascontiguousarray(vector.reshape(1, -1), dtype=np.float32), depth, params=params
        )
        dense = [(self.records[self.by_row[int(r)]], float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0]
        if not bm25:
            return dense[:k]
        lexical = self._bm25_rank(question, allowed)
        fused = fuse([[record.id for record, _ in ranking] for ranking in (dense, lexical)])
        best = sorted(fused.items(), key=lambda item: -item[1])[:k]
        return [(self.records[rid], score) for rid, score in best]

    def _bm25_rank(self, question: str, allowed_rows: Iterable[int]) -> list[tuple[ChunkRecord, float]]:
        ordered = sorted(self.records.values(), key=lambda r: r.row)
        if self._bm25 is None:
            self._bm25 = (bm25([r.text for r in ordered]), ordered)
        index, records = self._bm25
        scores = bm25_scores(index, question)
        allowed = set(allowed_rows)
        ranked = sorted((i for i, r in enumerate(records) if r.row in allowed), key=lambda i: -scores[i])
        return [(records[i], scores[i]) for i in ranked]

    # -- persistence ------------------------------------------------------------------------------------

    def save(self, folder: Path, generation: str = "") -> list[Path]:
        """Write `vectors[-generation].safetensors` and `chunks[-generation].jsonl` under `folder`; return them.

        Each file is written to a temporary name, fsynced and renamed into place. A caller that commits
        both at once (the engine's manifest) names a fresh `generation` each time, so a reader never pairs
        the vectors of one save with the records of another.
        """
        from safetensors.numpy import save as np_save

        make_dirs(folder)
        records = sorted(self.records.values(), key=lambda r: r.row)
        vectors = np.stack([self.vectors.reconstruct(r.row) for r in records]) if records else None
        rows = np.array([r.row for r in records], dtype=np.int64)
        blobs = {
            _name("vectors", generation, ".safetensors"): np_save(
                {"vectors": np.zeros((0, self.dim), np.float32) if vectors is None else vectors, "rows": rows},
                metadata={"dim": str(self.dim), "next_row": str(self.next_row)},
            ),
            _name("chunks", generation, ".jsonl"): "".join(
                json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in records
            ).encode("utf-8"),
        }
        written = []
        for name, blob in blobs.items():
            write_atomic(folder / name, blob)
            written.append(folder / name)
        return written

    @classmethod
    def load(cls, folder: Path, dim: int, generation: str = "") -> ChunkIndex:
        """Read what `save` wrote (only safetensors and JSON); raise ValueError or OSError when it is damaged."""
        vectors, chunks = index_files(generation)
        return cls.from_bytes(dim, (folder / vectors).read_bytes(), (folder / chunks).read_bytes())

    @classmethod
    def from_bytes(
        cls,
        dim: int,
        vectors_blob: bytes | None,
        chunks_blob: bytes,
        embed: Callable[[list[str]], np.ndarray] | None = None,
    ) -> ChunkIndex:
        """The index in a saved vectors file and records file; raise ValueError when either is damaged.

        `vectors_blob` None (known damaged) or unreadable, with `embed` given: the vectors are rebuilt by
        embedding the records' texts, so a damaged vectors file costs an embedding pass, never the index.
        """
        index = cls(dim)
        try:
            lines = chunks_blob.decode("utf-8").splitlines()
            records = [_record(json.loads(line)) for line in lines if line.strip()]
        except (UnicodeDecodeError, ValueError, TypeError) as err:
            raise ValueError(f"the chunks file is not kvrag's chunk records ({err})") from None
        for record in records:
            index.records[record.id] = record
            index.by_row[record.row] = record.id
        if len(index.by_row) != len(records) or len(index.records) != len(records):
            raise ValueError("the chunks file repeats a chunk id or a row")
        rows = np.array(sorted(index.by_row), dtype=np.int64)
        vectors = None
        if vectors_blob is not None:
            try:
                vectors = _vectors_in(vectors_blob, dim, rows)
            except ValueError:
                if embed is None:
                    raise
        if vectors is None:
            if embed is None:
                raise ValueError("the vectors file is damaged")
            texts = [index.records[index.by_row[int(r)]].text for r in rows]
            vectors = np.asarray(embed(texts), dtype=np.float32).reshape(len(rows), dim)
        if len(rows):
            index.vectors.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), rows)
        index.next_row = max(index.by_row, default=-1) + 1
        return index


_RECORD_TYPES = {
    "id": str, "doc_id": str, "text": str, "metadata": dict, "key": str, "n_tokens": int, "row": int, "after": int
}


def _record(fields: Any) -> ChunkRecord:
    """A chunk record read back, every field of its type (a row FAISS can hold); `after` may be missing (an index
    written before documents were encoded in context: every chunk alone)."""
    if isinstance(fields, dict) and "after" not in fields:
        fields = {**fields, "after": 0}
    if not isinstance(fields, dict) or set(fields) != set(_RECORD_TYPES):
        raise ValueError(f"a record with the fields {sorted(fields) if isinstance(fields, dict) else fields!r}")
    for name, kind in _RECORD_TYPES.items():
        if not isinstance(fields[name], kind) or isinstance(fields[name], bool):
            raise ValueError(f"a record whose {name} is {fields[name]!r}")
    if not 0 <= fields["row"] < 2**62 or fields["n_tokens"] < 0 or fields["after"] < 0:
        raise ValueError(f"a record whose row is {fields['row']} or n_tokens {fields['n_tokens']}")
    return ChunkRecord(**fields)


def _vectors_in(blob: bytes, dim: int, rows: np.ndarray) -> np.ndarray:
    """The [rows, dim] vectors of a saved vectors file, in the order of `rows` (sorted); ValueError if damaged."""
    from safetensors.numpy import load as np_load

    try:
        tensors = np_load(blob)
        vectors, stored_rows = tensors["vectors"], tensors["rows"]
    except Exception as err:  # safetensors raises its own error type on damaged bytes
        raise ValueError(f"the vectors file is not readable safetensors ({err})") from None
    if vectors.ndim != 2 or vectors.shape[1] != dim or stored_rows.shape != (vectors.shape[0],):
        raise ValueError(f"vectors of shape {vectors.shape} for {stored_rows.shape} rows and dimension {dim}")
    if sorted(stored_rows.tolist()) != rows.tolist():
        raise ValueError(f"the vectors file holds {len(stored_rows)} vectors for {len(rows)} chunks")
    if not np.isfinite(vectors).all():
        raise ValueError("the vectors file holds values that are not finite")
    return vectors[np.argsort(stored_rows, kind="stable")]


def index_files(generation: str) -> tuple[str, str]:
    """The vectors file's and the records file's names of an index generation."""
    return _name("vectors", generation, ".safetensors"), _name("chunks", generation, ".jsonl")


def _name(stem: str, generation: str, suffix: str) -> str:
    return f"{stem}-{generation}{suffix}" if generation else f"{stem}{suffix}"
