"""Ingestion: documents split, embedded, encoded and stored; a document's chunks deleted; the files passed over
reported (`IngestStats.skipped`). The KVRAG engine's half that writes (`KVRAG` takes it in as a base class);
committing the index is `kvrag.engine.rag`'s."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvrag.engine.documents import MAX_FILE_BYTES, Item, Skipped, named, split_text, to_documents
from kvrag.engine.index import ChunkRecord
from kvrag.errors import (
    DocumentError,
    InvalidRequestError,
    StoreError,
)

logger = logging.getLogger(__name__)

# How ingestion encodes a document's chunks (`KVRAG(encoding=...)`): each alone behind the prompt prefix, or each
# behind its document's earlier chunks (`KVModel.encode_in_context`).
ENCODINGS = ("alone", "document")


def check_encoding(encoding: Any) -> str:
    """An engine's encoding, one of ENCODINGS."""
    if encoding not in ENCODINGS:
        raise InvalidRequestError(f"encoding must be one of {', '.join(map(repr, ENCODINGS))}, got {encoding!r}")
    return encoding


@dataclass(slots=True)
class IngestStats:
    """What one ingest did."""

    documents: int  # documents read
    chunks: int  # chunks indexed
    tokens: int  # LM tokens in those chunks
    encoded: int  # chunks whose KV was computed now
    store_hits: int  # chunks whose KV was already stored (nothing encoded)
    seconds: float  # wall time of the whole ingest
    encode_s: float  # of which encoding KV
    skipped: list[Skipped] = field(default_factory=list)  # files passed over (binary, not UTF-8, empty), and why


class Ingesting:
    """What `KVRAG` does to take documents in (see `kvrag.engine.rag.KVRAG` for the attributes it uses)."""

    def ingest(
        self,
        items: Item | Iterable[Item],
        *,
        metadata: Mapping[str, Any] | None = None,
        split: bool = True,
        progress: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
        follow_symlinks: bool = False,
        max_file_bytes: int = MAX_FILE_BYTES,
        encode: bool = True,
        strict: bool = False,
    ) -> IngestStats:
        """Split, embed and index documents; encode and store each chunk's KV unless it is stored already.

        Args:
            items: texts (str), files or folders (pathlib.Path), (text, metadata) pairs or Documents.
            metadata: merged into every document's metadata. Metadata keys are str, values a str, finite number,
                bool or None or a list of them (what JSON keeps as it was); anything else raises InvalidRequestError.
            split: False keeps each document as one chunk (caller-given chunks).
            progress: show a tqdm progress bar over chunk encoding (tokens a second, and the time left).
            on_progress: called with (0, chunks to encode) before encoding starts (raising there stops the ingest
                with nothing written) and with (chunks done, chunks to encode) after each encoding batch.
            follow_symlinks: read files and folders reached through symbolic links (refused by default).
            max_file_bytes: the largest file read (default 64 MiB); a larger one is skipped.
            encode: False indexes and embeds the chunks only: each chunk's KV is computed at its first retrieval and
                stored then (KV on demand), so a corpus far larger than its store can be indexed (with a bounded
                `DiskStore`, its least recently used KV is evicted and computed again when needed).
            strict: refuse the whole ingest (DocumentError naming every one, nothing written) when a file is
                skipped; by default the other files are ingested and the skipped ones listed in the stats.

        A file whose content cannot be read as text (binary, not UTF-8, empty, over `max_file_bytes`; a hidden
        file or folder under a given folder) is skipped and named in `IngestStats.skipped` with its reason; when
        nothing is left to ingest the call raises DocumentError naming them. A link not followed, a FIFO or a
        missing path is refused with a DocumentError.
        """
        t0 = time.perf_counter()
        self._check_writable("ingest")
        skipped: list[Skipped] = []
        docs = to_documents(
            items, metadata, follow_symlinks=follow_symlinks, max_file_bytes=max_file_bytes, skipped=skipped
        )
        for skip in skipped:
            logger.info("ingest: skipped %s: %s", skip.path, skip.reason)
        if strict and skipped:
            raise DocumentError(
                f"{len(skipped)} file(s) could not be read, and the ingest is strict (nothing was ingested): "
                f"{named(skipped)}"
            )
        # Encoding takes the model's lock one group at a time and no folder lock: queries in this process and
        # readers in others go on meanwhile. Only the commit holds the locks.
        records, chunk_ids, runs = self._chunk_records(docs, split, in_context=encode and self.encoding == "document")
        stored = [r.key in self.store for r in records]
        missing_runs = _runs_holding(runs, records, [i for i in range(len(records)) if not stored[i]])
        if not encode:
            missing_runs = []  # KV on demand: computed at first retrieval (alone, whatever the encoding)
            self.kv_on_demand = True
        missing = [i for run in missing_runs for i in run]  # a run is encoded whole: its chunks' context
        if missing and on_progress is not None:
            on_progress(0, len(missing))  # before anything is encoded: a caller may stop here (raise)
        texts = [r.text for r in records]
        embedding: _Beside | None = None

        def embed() -> None:  # on a thread of its own, once: beside the forwards or beside the last writes
            nonlocal embedding
            if embedding is None:
                embedding = _Beside(self.embedder.embed, texts)

        if missing and _embeds_beside(self.kvmodel):
            embed()
        try:
            encode_s = self._encode_and_store(
                records, chunk_ids, missing_runs, progress=progress, on_progress=on_progress, on_encoded=embed
            )
        except StoreError as err:  # a full disk, a Redis out of memory: what this ingest wrote goes again
            logger.error("ingest: the store failed (%s); removing what this ingest wrote", err)
            left = self._remove_unindexed([records[i].key for i in missing])
            raise StoreError(
                f"{err} (the index is as last committed; "
                + (
                    f"{left} entries this ingest wrote could not be removed: `kvrag gc` removes them)"
                    if left
                    else "the entries this ingest wrote were removed)"
                )
            ) from err
        vectors = embedding.result() if embedding is not None else self.embedder.embed(texts)
        with self._writing():
            # a `gc` or `delete` may have removed an entry this ingest found stored or wrote: store it again
            again = [i for i, r in enumerate(records) if r.key not in self.store]
            bounded = getattr(getattr(self.store, "back", self.store), "max_bytes", None) is not None
            if again and encode and not bounded:  # in a bounded store an evicted entry is only a later miss
                self.source.encode_and_store(
                    chunk_ids, [r.key for r in records], runs=_runs_holding(runs, records, again)
                )
            before = self.index
            self.index = before.copy()
            try:
                for doc in docs:  # re-ingesting a document replaces its chunks (their KV stays stored)
                    self.index.remove_doc(doc.id)
                    source = doc.metadata.get("source")
                    if isinstance(source, str) and source != doc.id and doc.id == _resolved(source):
                        self.index.remove_doc(source)  # a file indexed before ids were resolved paths
                self.index.add(records, vectors)
                if self.folder is not None:
                    self._commit(self.folder)
            except BaseException:
                self.index = before  # nothing half-added: the index stays as committed
                raise
        hits = sum(stored) - sum(stored[i] for i in missing)  # a stored chunk of a run encoded again is not a hit
        logger.info(
            "ingest: %d documents, %d chunks, %d encoded, %d already stored", len(docs), len(records), len(missing), hits
        )
        return IngestStats(
            documents=len(docs),
            chunks=len(records),
            tokens=sum(r.n_tokens for r in records),
            encoded=len(missing),
            store_hits=hits,
            seconds=time.perf_counter() - t0,
            encode_s=encode_s,
            skipped=skipped,
        )

    def _remove_unindexed(self, keys: Sequence[str]) -> int:
        """Delete the entries among `keys` that no indexed chunk refers to; the number that could not be removed."""
        with self._lock:
            live = {r.key for r in self.index.records.values()}
        left = 0
        for key in set(keys) - live:
            try:
                self.store.delete(key)
            except (StoreError, OSError):
                left += 1
        return left

    def _chunk_records(
        self, docs: Sequence[Any], split: bool, *, in_context: bool
    ) -> tuple[list[ChunkRecord], list[list[int]], list[list[int]]]:
        """Each document's chunks as index records (ids, text, metadata, store key), their token ids, and the runs
        they are encoded in (record indices: a chunk a run, or `in_context` a document's consecutive chunks within
        the model's context window, each behind its run's earlier ones)."""
        records: list[ChunkRecord] = []
        chunk_ids: list[list[int]] = []
        runs: list[list[int]] = []
        for doc in docs:
            texts = (
                split_text(doc.text, self.kvmodel.tokenizer, chunk_tokens=self.chunk_tokens, overlap=self.overlap)
                if split
                else [doc.text.strip()]
            )
            ids = [self.kvmodel.chunk_ids(n, text) for n, text in enumerate(texts)]
            in_doc = self.kvmodel.context_runs(ids) if in_context else [[n] for n in range(len(ids))]
            first = len(records)
            for run in in_doc:
                for after, n in enumerate(run):
                    context = [t for m in run[:after] for t in ids[m]]
                    records.append(
                        ChunkRecord(
                            id=f"{doc.id}#{n}",
                            doc_id=doc.id,
                            text=texts[n],
                            metadata=dict(doc.metadata),
                            key=self.source.key(ids[n], context),
                            n_tokens=len(ids[n]),
                            after=after,
                        )
                    )
                    chunk_ids.append(ids[n])
                runs.append([first + n for n in run])
        return records, chunk_ids, runs

    def _encode_and_store(
        self,
        records: Sequence[ChunkRecord],
        ids: Sequence[list[int]],
        runs: Sequence[Sequence[int]],
        *,
        progress: bool,
        on_progress: Callable[[int, int], None] | None,
        on_encoded: Callable[[], None] | None = None,
    ) -> float:
        """Encode and store the KV of the chunks of `runs` (indices into `records` and `ids`) with a progress bar;
        the seconds it took. `on_encoded()` once the last forward is done, while the last writes may still go on."""
        todo = [i for run in runs for i in run]
        if not todo:
            return 0.0
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        # counted in tokens, so the bar shows tokens a second and its ETA: the model's rate, whatever the chunks' sizes
        tokens = sum(len(ids[i]) for i in todo)
        bar = tqdm(total=tokens, desc="encoding chunk KV", unit="tok", unit_scale=True, disable=not progress)
        done = 0

        def advance(chunks: int, batch_tokens: int) -> None:
            nonlocal done
            done += chunks
            bar.update(batch_tokens)
            if done == len(todo) and on_encoded is not None:
                on_encoded()
            if on_progress is not None:
                on_progress(done, len(todo))

        try:
            self.source.encode_and_store(ids, [r.key for r in records], runs=runs, on_batch=advance)
        finally:
            bar.close()
        return time.perf_counter() - t0

    def store_kv(self, texts: Sequence[str], *, progress: bool = False) -> IngestStats:
        """Encode and store the KV of chunk texts that are not stored yet, without indexing them.

        For chunks that another framework retrieves (a LlamaIndex node, a LangChain document): a later
        `answer(question, chunks=texts)` then loads their KV instead of encoding it.
        """
        t0 = time.perf_counter()
        self._check_writable("store KV")
        ids = [self.kvmodel.chunk_ids(i, t) for i, t in enumerate(texts)]
        keys = [self.source.key(c) for c in ids]
        seen: set[str] = set()
        missing = [i for i, k in enumerate(keys) if k not in self.store and not (k in seen or seen.add(k))]
        records = [ChunkRecord(id=f"given#{i}", doc_id="", text=texts[i], key=keys[i]) for i in missing]
        encode_s = self._encode_and_store(
            records, [ids[i] for i in missing], [[n] for n in range(len(missing))], progress=progress, on_progress=None
        )
        return IngestStats(
            documents=0,
            chunks=len(texts),
            tokens=sum(map(len, ids)),
            encoded=len(missing),
            store_hits=len(texts) - len(missing),
            seconds=time.perf_counter() - t0,
            encode_s=encode_s,
        )

    def delete(self, doc_id: str) -> int:
        """Remove a document's chunks, vectors and stored KV (unless another chunk shares it); return the count."""
        if not isinstance(doc_id, str):
            raise InvalidRequestError(
                f"doc_id is a {type(doc_id).__name__}: give a document's str id (a Source's id before its '#')"
            )
        self._check_writable("delete")
        with self._writing():
            before = self.index
            self.index = before.copy()
            gone = self.index.remove_doc(doc_id)
            try:
                if gone and self.folder is not None:
                    self._commit(self.folder)
            except BaseException:
                self.index = before
                raise
            live = {r.key for r in self.index.records.values()}
            for record in gone:  # after the commit: a crash before it leaves the document whole
                if record.key not in live:
                    self.store.delete(record.key)
        return len(gone)


def _embeds_beside(kvmodel: Any) -> bool:
    """Whether the embedder runs beside the encoding forwards: where the model runs on an accelerator (torch lets go
    of the GIL while it works). On the CPU it starts after the last forward, beside the last writes: the forward's
    threads hold every core, and another torch thread pool beside them gains little on an idle machine and stalls
    both on a busy one (docs/performance.md)."""
    return kvmodel.prefix.keys.device.type != "cpu"


class _Beside:
    """`fn(*args)` on a thread of its own, its result (or its error) taken by `result`: work done beside the
    encoding forwards. A daemon: an interrupted ingest neither waits for it nor keeps the process alive for it."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="kvrag-ingest-embed", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._result = fn(*args)
        except BaseException as err:  # raised where the result is taken
            self._error = err


def _resolved(path: str) -> str:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError, ValueError):
        return ""


def _runs_holding(
    runs: Sequence[Sequence[int]], records: Sequence[ChunkRecord], wanted: Sequence[int]
) -> list[list[int]]:
    """The runs that hold any of the `wanted` records, each once (a run whose chunks' keys another run has, the same
    document ingested twice, is encoded once)."""
    wanted_set, seen = set(wanted), set()
    out = []
    for run in runs:
        keys = tuple(records[i].key for i in run)
        if wanted_set.intersection(run) and keys not in seen:
            seen.add(keys)
            out.append(list(run))
    return out
