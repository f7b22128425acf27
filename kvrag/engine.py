"""KVRAG: the KV-aware retrieval engine. Documents in, answers out; every chunk's KV computed once and kept.

It owns the index (records, vectors), the KV store and one KVModel, and wires them: ingestion splits,
embeds, encodes and stores; a query retrieves, loads each chunk's KV from the store (encoding only the
misses), and answers with a strategy. Strategy and model logic stay in KVModel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

from kvrag.documents import Item, split_text, to_documents
from kvrag.embed import Embedder
from kvrag.defaults import load_default
from kvrag.encode import encode_chunks
from kvrag.errors import EmptyInputError, IndexLoadError, InvalidRequestError, StoreError
from kvrag.index import ChunkIndex, ChunkRecord, Filters, write_atomic
from kvrag.kv import ChunkKey, ChunkKV, chunk_key
from kvrag.kvmodel import Answer, KVModel, Source
from kvrag.layout import check_unicode
from kvrag.store import DiskStore, KVStore, MemoryStore, TieredStore, check_namespace
from kvrag.timing import phase

try:
    import fcntl
except ImportError:  # not POSIX: one process an index folder
    fcntl = None  # type: ignore[assignment]

# 2: vectors as safetensors (never a format that runs code when read), files named by a generation that the
# manifest commits.
INDEX_FORMAT = 2
LOCK_FILE = ".kvrag.lock"


class StoreWarning(UserWarning):
    """A KV store failed during a query; the answer was computed without it."""


MANIFEST = "kvrag-index.json"


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


class KVRAG:
    """Retrieval-augmented generation over stored per-chunk KV.

    Args:
        kv: the LM wrapper.
        embedder: scores chunks against questions.
        store: where chunk KV is kept (bound to `kv`'s model and prefix).
        path: the index folder; None keeps everything in memory.
        chunk_tokens, overlap: the splitter's window and overlap, in LM tokens.
        namespace: a tenant name that enters every chunk's store key, so engines of different namespaces
            sharing one store (one Redis, one folder, one MemoryStore) never serve each other's KV and
            cannot probe it by timing. "" (default) is the shared namespace.
        require_store: raise StoreError when the store cannot be reached at start; by default the engine
            starts with a StoreWarning and recomputes chunks until the store answers again.

    Many processes may open one index folder: ingest and delete hold an exclusive lock on it and first
    take in what another process committed; loading holds a shared lock.
    """

    def __init__(
        self,
        kv: KVModel,
        *,
        embedder: Embedder,
        store: KVStore,
        path: str | Path | None = None,
        index: ChunkIndex | None = None,
        chunk_tokens: int = 200,
        overlap: int = 20,
        model_source: str | None = None,
        namespace: str = "",
        require_store: bool = False,
        generation: str | None = None,
    ) -> None:
        self.kv = kv
        self.embedder = embedder
        self.store = store
        self.namespace = check_namespace(namespace) if namespace else ""
        try:
            self.store.check()
        except StoreError as err:
            if require_store:
                raise
            warnings.warn(
                f"kvrag: the KV store is unreachable at start ({err}); answering by recomputing chunks until "
                "it answers again",
                StoreWarning,
                stacklevel=2,
            )
        self.store.bind(encoder=kv.encoder_id, dtype=kv.prefix.keys.dtype, device=kv.prefix.keys.device)
        self.path = Path(path) if path is not None else None
        dim = int(embedder.embed(["dimension probe"]).shape[1])
        self.index = index or ChunkIndex(dim)
        self.chunk_tokens, self.overlap = chunk_tokens, overlap
        self.model_source = model_source
        self._generation = generation  # the committed index generation this engine's index reflects
        # the strategy, picker and budget a query runs with when it names no strategy: `kvrag tune`'s choice
        # saved with the index, else the model's shipped default (kvrag.defaults)
        self.defaults: dict[str, Any] | None = None
        if self.path is not None:
            self.defaults = load_default(self.path)
        self._lock: threading.RLock = kv.lock  # one lock: the model, the index and the store change together

    # -- construction -----------------------------------------------------------------------------------

    @classmethod
    def from_defaults(
        cls,
        path: str | Path | None = None,
        *,
        model: str | None = None,
        embedder: str | None = None,
        store: KVStore | None = None,
        storage_dtype: str = "float16",
        memory_bytes: int = 1 << 30,
        device: str = "cpu",
        dtype: str = "auto",
        chunk_tokens: int = 200,
        overlap: int = 20,
        cache_dir: str | Path | None = None,
        namespace: str = "",
        require_store: bool = False,
    ) -> KVRAG:
        """An engine on the embedded defaults (or the given model and embedder), loading `path` if it holds an index.

        The KV store defaults to memory in front of a disk store in `path/kv` (memory only without a path).
        `namespace` and `require_store` are those of `KVRAG`.
        """
        if path is not None and (Path(path) / MANIFEST).is_file():
            return cls.load(
                path,
                store=store,
                memory_bytes=memory_bytes,
                device=device,
                cache_dir=cache_dir,
                namespace=namespace or None,
                require_store=require_store,
            )
        kv = KVModel.from_pretrained(model, dtype=dtype, device=device, cache_dir=cache_dir)
        if store is None:
            store = MemoryStore(memory_bytes)
            if path is not None:
                store = TieredStore(store, DiskStore(Path(path) / "kv", storage_dtype))
        return cls(
            kv,
            embedder=Embedder(embedder, device=device),
            store=store,
            path=path,
            chunk_tokens=chunk_tokens,
            overlap=overlap,
            model_source=model,
            namespace=namespace,
            require_store=require_store,
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        store: KVStore | None = None,
        memory_bytes: int = 1 << 30,
        device: str = "cpu",
        cache_dir: str | Path | None = None,
        namespace: str | None = None,
        require_store: bool = False,
    ) -> KVRAG:
        """Open an index folder written by an engine with a path; the model and embedder are those it was built with.

        The namespace is the one the index was built with; passing another raises IndexLoadError.
        """
        folder = Path(path)
        if not (folder / MANIFEST).is_file():
            raise IndexLoadError(f"no kvrag index at {folder}: create one with `kvrag ingest PATH --index {folder}`")
        with _folder_lock(folder, shared=True):
            manifest = _read_manifest(folder)
            if namespace is not None and namespace != manifest.get("namespace", ""):
                raise IndexLoadError(
                    f"the index at {folder} was built for namespace {manifest.get('namespace', '')!r}, not "
                    f"{namespace!r}: open it without a namespace or ingest into another folder"
                )
            kv = KVModel.from_pretrained(manifest["model"], dtype=manifest["dtype"], device=device, cache_dir=cache_dir)
            if kv.fingerprint.digest != manifest["fingerprint"]:
                raise IndexLoadError(
                    f"the index at {folder} was built with another model ({manifest['architecture']}, "
                    f"{manifest['weights']}): open it with that model or re-ingest"
                )
            embedder = Embedder(manifest["embedder"], device=device)
            index = _load_index(folder, manifest)
        if store is None:
            store = TieredStore(MemoryStore(memory_bytes), DiskStore(folder / "kv", manifest["storage_dtype"]))
        return cls(
            kv,
            embedder=embedder,
            store=store,
            path=folder,
            index=index,
            chunk_tokens=manifest["chunk_tokens"],
            overlap=manifest["overlap"],
            model_source=manifest["model"],
            namespace=manifest.get("namespace", ""),
            require_store=require_store,
            generation=manifest["index"],
        )

    def persist(self, path: str | Path | None = None) -> Path:
        """Write the index and manifest to `path` (default: the engine's path). KV in a disk store is already there.

        The index files are written under a fresh generation name and committed by renaming the manifest
        over the old one: a process killed at any point leaves the previous index or the new one, whole. A
        write that fails (a full disk) raises StoreError and leaves the index on disk as it was.
        """
        folder = Path(path) if path is not None else self.path
        if folder is None:
            raise InvalidRequestError("this engine has no path: pass persist(path)")
        with self._lock, _folder_lock(folder):
            self._commit(folder)
        return folder

    def _commit(self, folder: Path) -> None:
        """Write the index under a new generation and commit it with the manifest (the caller holds the locks)."""
        generation = uuid.uuid4().hex[:16]
        fp = self.kv.fingerprint
        storage = getattr(getattr(self.store, "back", self.store), "storage_dtype", "float16")
        manifest = {
            "format": INDEX_FORMAT,
            "index": generation,
            "model": self.model_source,
            "dtype": fp.dtype,
            "fingerprint": fp.digest,
            "architecture": fp.architecture,
            "weights": fp.weights,
            "embedder": self.embedder.name,
            "dim": self.index.dim,
            "chunk_tokens": self.chunk_tokens,
            "overlap": self.overlap,
            "storage_dtype": storage,
            "namespace": self.namespace,
        }
        written: list[Path] = []
        try:
            written = self.index.save(folder / "index", generation)
            write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        except OSError as err:
            for file in written:  # never committed: nothing refers to them
                with contextlib.suppress(OSError):
                    file.unlink()
            raise StoreError(
                f"cannot write the index under {folder}: {err.strerror or err}; the index on disk is unchanged. "
                "Free space or choose another folder, then ingest again."
            ) from err
        if self.path is not None and folder.resolve() == self.path.resolve():
            self._generation = generation
        # Earlier generations are unreferenced now, and a temporary file can only be a dead writer's: every
        # writer of the index holds the folder's exclusive lock.
        for old in [*(folder / "index").glob("*"), *folder.glob(".*.tmp")]:
            if old.is_file() and (generation not in old.name or old.name.endswith(".tmp")):
                with contextlib.suppress(OSError):
                    old.unlink()

    def _take_in_commits(self) -> None:
        """Reload the index if another process committed a newer one (the caller holds the folder lock)."""
        if self.path is None or not (self.path / MANIFEST).is_file():
            return
        manifest = _read_manifest(self.path)
        if manifest["index"] == self._generation:
            return
        if manifest["fingerprint"] != self.kv.fingerprint.digest or manifest.get("namespace", "") != self.namespace:
            raise IndexLoadError(
                f"another process wrote an index at {self.path} with another model or namespace: "
                "ingest into another folder"
            )
        self.index = _load_index(self.path, manifest)
        self._generation = manifest["index"]

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the engine's lock and, with a path, the folder's exclusive lock, with the latest commit taken in."""
        with self._lock:
            if self.path is None:
                yield
                return
            self.path.mkdir(parents=True, exist_ok=True)
            with _folder_lock(self.path):
                self._take_in_commits()
                yield

    def _key(self, ids: Sequence[int]) -> ChunkKey:
        """A chunk's store key under this engine's model, prefix and namespace."""
        return chunk_key(self.kv.fingerprint.digest, self.kv.chunk_prefix_ids, ids, salt=self.namespace)

    # -- ingestion --------------------------------------------------------------------------------------

    def ingest(
        self,
        items: Item | Iterable[Item],
        *,
        metadata: Mapping[str, Any] | None = None,
        split: bool = True,
        progress: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> IngestStats:
        """Split, embed and index documents; encode and store each chunk's KV unless it is stored already.

        Args:
            items: texts (str), files or folders (pathlib.Path), (text, metadata) pairs or Documents.
            metadata: merged into every document's metadata.
            split: False keeps each document as one chunk (caller-given chunks).
            progress: show a tqdm progress bar over chunk encoding.
            on_progress: called with (chunks done, chunks total) after each encoding batch.
        """
        t0 = time.perf_counter()
        docs = to_documents(items, metadata)
        with self._writing():
            records: list[ChunkRecord] = []
            chunk_ids: list[list[int]] = []
            for doc in docs:
                texts = (
                    split_text(doc.text, self.kv.tokenizer, chunk_tokens=self.chunk_tokens, overlap=self.overlap)
                    if split
                    else [doc.text.strip()]
                )
                for n, text in enumerate(texts):
                    ids = self.kv.chunk_ids(n, text)
                    records.append(
                        ChunkRecord(
                            id=f"{doc.id}#{n}",
                            doc_id=doc.id,
                            text=text,
                            metadata=dict(doc.metadata),
                            key=self._key(ids),
                            n_tokens=len(ids),
                        )
                    )
                    chunk_ids.append(ids)
            seen: set[str] = set()
            stored = [r.key in self.store for r in records]
            missing = [i for i, r in enumerate(records) if not stored[i] and not (r.key in seen or seen.add(r.key))]
            encode_s = self._encode_and_store(
                [records[i] for i in missing],
                [chunk_ids[i] for i in missing],
                progress=progress,
                on_progress=on_progress,
            )
            vectors = self.embedder.embed([r.text for r in records])
            before = self.index
            self.index = before.copy()
            try:
                for doc in docs:  # re-ingesting a document replaces its chunks (their KV stays stored)
                    self.index.remove_doc(doc.id)
                self.index.add(records, vectors)
                if self.path is not None:
                    self._commit(self.path)
            except BaseException:
                self.index = before  # nothing half-added: the index stays as committed
                raise
        return IngestStats(
            documents=len(docs),
            chunks=len(records),
            tokens=sum(r.n_tokens for r in records),
            encoded=len(missing),
            store_hits=sum(stored),
            seconds=time.perf_counter() - t0,
            encode_s=encode_s,
        )

    def _encode_and_store(
        self,
        records: Sequence[ChunkRecord],
        ids: Sequence[list[int]],
        *,
        progress: bool,
        on_progress: Callable[[int, int], None] | None,
    ) -> float:
        if not records:
            return 0.0
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        bar = tqdm(total=len(records), desc="encoding chunk KV", unit="chunk", disable=not progress)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            bar.update(n)
            if on_progress is not None:
                on_progress(done, len(records))

        try:
            # A group of about one encoding forward at a time, stored before the next is encoded: ingestion
            # holds one group's KV in memory, however large the corpus.
            for group in _groups([len(i) for i in ids], max(self.kv.batch_tokens, 1)):
                kvs = encode_chunks(
                    self.kv.model,
                    self.kv.chunk_prefix,
                    [ids[i] for i in group],
                    batch_tokens=self.kv.batch_tokens,
                    on_batch=advance,
                    encoder=self.kv.encoder_id,
                )
                for i, kv in zip(group, kvs):
                    self.store.put(records[i].key, kv)
                del kvs
        finally:
            bar.close()
        return time.perf_counter() - t0

    def store_kv(self, texts: Sequence[str], *, progress: bool = False) -> IngestStats:
        """Encode and store the KV of chunk texts that are not stored yet, without indexing them.

        For chunks that another framework retrieves (a LlamaIndex node, a LangChain document): a later
        `answer(question, chunks=texts)` then loads their KV instead of encoding it.
        """
        t0 = time.perf_counter()
        with self._lock:
            ids = [self.kv.chunk_ids(i, t) for i, t in enumerate(texts)]
            keys = [self._key(c) for c in ids]
            seen: set[str] = set()
            missing = [i for i, k in enumerate(keys) if k not in self.store and not (k in seen or seen.add(k))]
            records = [ChunkRecord(id=f"given#{i}", doc_id="", text=texts[i], key=keys[i]) for i in missing]
            encode_s = self._encode_and_store(records, [ids[i] for i in missing], progress=progress, on_progress=None)
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
        with self._writing():
            before = self.index
            self.index = before.copy()
            gone = self.index.remove_doc(doc_id)
            try:
                if gone and self.path is not None:
                    self._commit(self.path)
            except BaseException:
                self.index = before
                raise
            live = {r.key for r in self.index.records.values()}
            for record in gone:  # after the commit: a crash before it leaves the document whole
                if record.key not in live:
                    self.store.delete(record.key)
        return len(gone)

    # -- retrieval and answers --------------------------------------------------------------------------

    def retrieve(
        self, question: str, *, top_k: int = 5, filters: Filters | None = None, hybrid: bool = False
    ) -> list[Source]:
        """Top-k chunks for a question, best first, among those that pass `filters` (applied before top-k)."""
        if not question or not question.strip():
            raise EmptyInputError("the question is empty or whitespace only: ask something")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 10_000:
            raise InvalidRequestError(f"top_k must be an int in 1..10000, got {top_k!r}")
        check_unicode(question, "the question")
        vector = self.embedder.embed([question])[0]
        with self._lock:
            if not len(self.index):
                raise EmptyInputError("the index holds no chunks: ingest documents first")
            hits = self.index.search(vector, question, top_k=top_k, filters=filters, hybrid=hybrid)
        return [Source(id=r.id, text=r.text, score=s, metadata=dict(r.metadata)) for r, s in hits]

    def _chunk_kv(self, sources: Sequence[Source]) -> tuple[list[ChunkKV], int, int]:
        """Each source's KV: from the store, or encoded now (and stored). Returns (kv, store hits, encoded)."""
        keys = []
        for i, s in enumerate(sources):
            record = self.index.records.get(s.id)
            keys.append(
                record.key if record is not None and record.text == s.text else self._key(self.kv.chunk_ids(i, s.text))
            )
        kvs: list[ChunkKV | None] = [self._load(k) for k in keys]
        misses = [i for i, kv in enumerate(kvs) if kv is None]
        if misses:
            ids = [self.kv.chunk_ids(i, sources[i].text) for i in misses]
            fresh = encode_chunks(
                self.kv.model, self.kv.chunk_prefix, ids, batch_tokens=self.kv.batch_tokens, encoder=self.kv.encoder_id
            )
            for i, kv in zip(misses, fresh):
                kvs[i] = self.store.as_stored(kv)  # as a later hit will read it: the same answer either way
                try:
                    self.store.put(keys[i], kv)
                except StoreError as err:
                    warnings.warn(
                        f"kvrag: could not store a chunk's KV ({err}); answering anyway", StoreWarning, stacklevel=3
                    )
        return kvs, len(sources) - len(misses), len(misses)  # type: ignore[return-value]

    def _load(self, key: str) -> ChunkKV | None:
        """A chunk's stored KV; a store that fails to answer is a miss (the chunk is recomputed) and a warning."""
        try:
            return self.store.get(key)
        except StoreError as err:
            warnings.warn(
                f"kvrag: the KV store failed ({err}); recomputing the chunk instead", StoreWarning, stacklevel=4
            )
            return None

    def stream(
        self,
        question: str,
        *,
        strategy: str | None = None,
        budget: float | None = None,
        top_k: int = 5,
        filters: Filters | None = None,
        picker: str | None = None,
        hybrid: bool = False,
        **generation: Any,
    ) -> Iterator[str | Answer]:
        """Retrieve, then yield the answer's text pieces as decoded, then the final Answer (with sources).

        With no `strategy`, the index's tuned default runs (`kvrag tune`), else the model's shipped default
        (`kvrag.defaults`: target_only on the embedded model, target_recompute on others); a `budget` or
        `picker` left out comes with that default.
        """
        t0 = time.perf_counter()
        sources = self.retrieve(question, top_k=top_k, filters=filters, hybrid=hybrid)
        if not sources:
            raise EmptyInputError(f"no chunk matches the filters {dict(filters or {})}: loosen them")
        yield from self._answer(
            question,
            sources,
            t0,
            strategy=strategy,
            budget=budget,
            picker=picker,
            scores=[s.score for s in sources],
            **generation,
        )

    def _answer(self, question: str, sources: list[Source], t0: float, **kwargs: Any) -> Iterator[str | Answer]:
        if kwargs.get("strategy") is None and self.defaults:  # else KVModel runs the model's shipped default
            kwargs["strategy"] = self.defaults["strategy"]
            if kwargs.get("picker") is None:
                kwargs["picker"] = self.defaults["picker"]
            if kwargs.get("budget") is None:
                kwargs["budget"] = self.defaults["budget"]
        with self._lock, phase(kwargs.get("phases"), "store load"):  # the lock is never held across a yield
            kvs, hits, encoded = self._chunk_kv(sources)
        retrieve_s = time.perf_counter() - t0
        for item in self.kv.stream(question, kvs, started_at=t0, **kwargs):
            if isinstance(item, Answer):
                item.sources = sources
                item.stats.store_hits, item.stats.chunks_encoded = hits, item.stats.chunks_encoded + encoded
                item.stats.retrieve_s = retrieve_s
            yield item

    def query(self, question: str, **kwargs: Any) -> Answer:
        """Retrieve and answer; the arguments are those of `stream` (and KVModel.stream's decoding ones)."""
        return _last(self.stream(question, **kwargs))

    def stream_over(
        self, question: str, chunks: Sequence[str], *, scores: Sequence[float] | None = None, **kwargs: Any
    ) -> Iterator[str | Answer]:
        """`stream` over caller-given chunk texts (no retrieval); their KV comes from the store when stored."""
        if not chunks:
            raise EmptyInputError("no chunks given: pass at least one chunk text")
        t0 = time.perf_counter()
        with self._lock:
            by_key = {r.key: r for r in self.index.records.values()}
        sources = []
        for i, text in enumerate(chunks):
            record = by_key.get(self._key(self.kv.chunk_ids(i, text)))
            sources.append(
                Source(
                    id=record.id if record else f"given#{i}",
                    text=text,
                    score=float(scores[i]) if scores is not None and i < len(scores) else 0.0,
                    metadata=dict(record.metadata) if record else {},
                )
            )
        yield from self._answer(question, sources, t0, scores=scores, **kwargs)

    def answer(self, question: str, chunks: Sequence[str], **kwargs: Any) -> Answer:
        """Answer over caller-given chunk texts; the arguments are those of `stream_over`."""
        return _last(self.stream_over(question, chunks, **kwargs))

    async def aquery(self, question: str, **kwargs: Any) -> Answer:
        """`query` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.query, question, **kwargs)

    async def astream(self, question: str, **kwargs: Any) -> AsyncIterator[str | Answer]:
        """`stream` in a worker thread; pieces arrive as they are decoded, then the Answer."""
        async for item in in_thread(lambda: self.stream(question, **kwargs)):
            yield item

    async def astream_over(self, question: str, chunks: Sequence[str], **kwargs: Any) -> AsyncIterator[str | Answer]:
        """`stream_over` in a worker thread."""
        async for item in in_thread(lambda: self.stream_over(question, chunks, **kwargs)):
            yield item

    async def aanswer(self, question: str, chunks: Sequence[str], **kwargs: Any) -> Answer:
        """`answer` in a worker thread."""
        return await asyncio.to_thread(self.answer, question, chunks, **kwargs)

    def info(self) -> dict[str, Any]:
        """Counts, bytes and the model fingerprint."""
        with self._lock:
            return {
                "path": str(self.path) if self.path else None,
                "documents": len(self.index.docs()),
                "chunks": len(self.index),
                "tokens": sum(r.n_tokens for r in self.index.records.values()),
                "kv_entries": len(self.store),
                "kv_bytes": self.store.nbytes,
                "model": asdict(self.kv.fingerprint),
                "fingerprint": self.kv.fingerprint.digest,
                "embedder": self.embedder.source,
                "chunk_tokens": self.chunk_tokens,
                "overlap": self.overlap,
                "namespace": self.namespace,
            }


def _groups(lengths: Sequence[int], tokens: int) -> list[list[int]]:
    """Consecutive chunk indices in groups of about `tokens` tokens (at least one chunk a group)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(lengths):
        if groups[-1] and total + n > tokens:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return [g for g in groups if g]


@contextlib.contextmanager
def _folder_lock(folder: Path, *, shared: bool = False) -> Iterator[None]:
    """An advisory lock on an index folder across processes (exclusive to write, shared to read)."""
    if fcntl is None or not folder.is_dir():
        yield
        return
    with open(folder / LOCK_FILE, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IndexLoadError(
            f"no kvrag index at {folder}: create one with `kvrag ingest PATH --index {folder}`"
        ) from None
    except (OSError, ValueError) as err:
        raise IndexLoadError(f"the index manifest {folder / MANIFEST} is unreadable ({err}): re-ingest") from err
    if not isinstance(manifest, dict) or manifest.get("format") != INDEX_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise IndexLoadError(f"{folder} holds index format {found}, this kvrag reads {INDEX_FORMAT}: re-ingest")
    return manifest


def _load_index(folder: Path, manifest: Mapping[str, Any]) -> ChunkIndex:
    try:
        return ChunkIndex.load(folder / "index", manifest["dim"], manifest["index"])
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as err:
        raise IndexLoadError(f"the index at {folder} is damaged ({err}): re-ingest into a new folder") from err


async def in_thread(make: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """Run a blocking iterator in a worker thread; its items arrive on the event loop as they come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    def run() -> None:
        try:
            for item in make():
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as err:  # handed to the awaiting side
            loop.call_soon_threadsafe(queue.put_nowait, err)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, done)

    worker = loop.run_in_executor(None, run)
    while True:
        item = await queue.get()
        if item is done:
            break
        if isinstance(item, BaseException):
            raise item
        yield item
    await worker


def _last(items: Iterator[str | Answer]) -> Answer:
    result = None
    for result in items:
        pass
    if not isinstance(result, Answer):
        raise RuntimeError("the answer stream ended without an Answer")
    return result
