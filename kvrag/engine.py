"""KVRAG: the KV-aware retrieval engine. Documents in, answers out; every chunk's KV computed once and kept.

It owns the index (records, vectors), the KV store and one KVModel, and wires them: ingestion splits,
embeds, encodes and stores; a query retrieves, makes the request, and hands it with its chunks (through
the store: only the KV a plan reuses is read, misses are encoded) to `kvrag.pipeline`. Planning and
model work stay out of it; the index folder on disk is `kvrag.folder`'s.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from kvrag import pipeline
from kvrag.aio import in_thread, to_thread
from kvrag.answer import Answer, Source, last_answer
from kvrag.chunks import Chunks, ChunkSource
from kvrag.defaults import default_parts, load_default, shipped_default
from kvrag.documents import MAX_FILE_BYTES, Item, split_text, to_documents
from kvrag.embed import Embedder
from kvrag.errors import (
    BusyError,
    EmptyInputError,
    IndexLoadError,
    InvalidRequestError,
    NoMatchError,
    StoreError,
)
from kvrag.executor import Executor
from kvrag.folder import MANIFEST, IndexFolder
from kvrag.index import ChunkIndex, ChunkRecord, Filters, check_filters, check_top_k
from kvrag.kvmodel import KVModel
from kvrag.layout import check_unicode
from kvrag.parts import Part, resolve_parts
from kvrag.request import Request
from kvrag.store import (
    DiskStore,
    KVStore,
    MemoryStore,
    StoreWarning,
    TieredStore,
    check_namespace,
)
from kvrag.timing import Phases

__all__ = ["IngestStats", "KVRAG", "MANIFEST", "StoreWarning"]


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
        executor: what runs the plans (`kvrag.executor`); default the model's in-process one. A serving
            engine's (`vllm_kvrag.executor.VLLMExecutor`) runs them there; retrieval and planning stay here.
        secret: a tenant secret (bytes or str; 32 random bytes is plenty). Store keys become HMACs under it
            and stored entries and index files are checksummed with it, so another tenant of the store can
            neither probe this one's chunks from its namespace label nor forge its KV. The index keeps only a
            check value: opening it needs the same secret again.
        read_only: never write: nothing stored, committed, deleted or created (what `kvrag ask` opens).
        max_in_flight: queries admitted at once (one runs on the model, the rest wait for it); one more
            raises BusyError at once instead of growing memory without bound.

    With a namespace the store is that namespace's view (`KVStore.scoped`): its own Redis key prefix or
    disk subfolder, so `info`, `keys()` and `gc` see this tenant's entries only.

    Many processes may open one index folder: ingest and delete encode without the folder's lock, then
    hold it exclusively to take in what another process committed and commit; loading holds a shared lock.
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
        executor: Executor | None = None,
        secret: bytes | str | None = None,
        read_only: bool = False,
        max_in_flight: int = 32,
    ) -> None:
        self.kvmodel = kv
        self.executor = executor or kv.executor  # what runs the plans: in-process by default
        self.embedder = embedder
        self.namespace = check_namespace(namespace) if namespace else ""
        self.secret = check_secret(secret)
        self.read_only = bool(read_only)
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise InvalidRequestError(f"max_in_flight must be an int of at least 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self.store = store.view_of(self.namespace)
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
        # the one chunk key; binds the store
        self.source = ChunkSource(kv, self.store, self.namespace, self.secret, read_only=self.read_only)
        self.path = Path(path) if path is not None else None
        self.folder = (
            IndexFolder(self.path, read_only=self.read_only, secret=self.secret) if self.path is not None else None
        )
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
        self._lock = kv.lock  # one lock: the model, the index and the store change together

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
        secret: bytes | str | None = None,
        compile_decode: bool = False,
        create: bool = True,
    ) -> KVRAG:
        """An engine on the embedded defaults (or the given model and embedder), loading `path` if it holds an index.

        The KV store defaults to memory in front of a disk store in `path/kv` (memory only without a path).
        `namespace`, `require_store` and `secret` are those of `KVRAG`; `compile_decode` that of `KVModel`.
        `model` is a named model (`kvrag models`), a Hugging Face id or a folder. `create=False` refuses a `path`
        that holds no index (IndexLoadError naming it) instead of starting a new, empty one there: for code that
        only reads an index, where a mistyped path would otherwise answer from nothing.
        """
        check_secret(secret)  # a bad secret or namespace is refused before the model loads or a folder is made
        if namespace:
            check_namespace(namespace)
        if not create and (path is None or not IndexFolder(path).exists()):
            raise IndexLoadError(
                f"no kvrag index at {path}: check the path, or build one there with `kvrag ingest PATH --index {path}` "
                "(create=True starts an empty one)"
            )
        if path is not None and IndexFolder(path).exists():
            return cls.load(
                path,
                store=store,
                memory_bytes=memory_bytes,
                device=device,
                cache_dir=cache_dir,
                namespace=namespace or None,
                require_store=require_store,
                secret=secret,
                compile_decode=compile_decode,
            )
        kv = KVModel.from_pretrained(
            model, dtype=dtype, device=device, cache_dir=cache_dir, compile_decode=compile_decode
        )
        if store is None:
            store = MemoryStore(memory_bytes)
            if path is not None:
                store = TieredStore(store, DiskStore(IndexFolder(path).kv_folder(), storage_dtype))
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
            secret=secret,
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
        secret: bytes | str | None = None,
        read_only: bool = False,
        compile_decode: bool = False,
    ) -> KVRAG:
        """Open an index folder written by an engine with a path; the model and embedder are those it was built with.

        The namespace is the one the index was built with; passing another raises IndexLoadError, and so does
        a `secret` other than the one it was built with. `read_only` opens it without writing anything (a
        chunk recomputed for lack of stored KV is not stored). `compile_decode` is that of `KVModel`.
        """
        folder = IndexFolder(path, read_only=read_only, secret=check_secret(secret))
        if not folder.exists():
            raise IndexLoadError(
                f"no kvrag index at {folder.path}: create one with `kvrag ingest PATH --index {folder.path}`"
            )
        with folder.lock(shared=True):
            manifest = folder.manifest()
            if namespace is not None and namespace != manifest.get("namespace", ""):
                raise IndexLoadError(
                    f"the index at {folder.path} was built for namespace {manifest.get('namespace', '')!r}, not "
                    f"{namespace!r}: open it without a namespace or ingest into another folder"
                )
            kv = KVModel.from_pretrained(
                manifest["model"],
                dtype=manifest["dtype"],
                device=device,
                cache_dir=cache_dir,
                compile_decode=compile_decode,
            )
            if kv.fingerprint.digest != manifest["fingerprint"]:
                raise IndexLoadError(
                    f"the index at {folder.path} was built with another model ({manifest['architecture']}, "
                    f"{manifest['weights']}): open it with that model or re-ingest"
                )
            embedder = Embedder(manifest["embedder"], device=device)
            index = folder.load_index(manifest, embed=embedder.embed)
        if store is None:
            disk = DiskStore(folder.kv_folder(), manifest["storage_dtype"], read_only=read_only)
            store = TieredStore(MemoryStore(memory_bytes), disk)
        return cls(
            kv,
            embedder=embedder,
            store=store,
            path=folder.path,
            index=index,
            chunk_tokens=manifest["chunk_tokens"],
            overlap=manifest["overlap"],
            model_source=manifest["model"],
            namespace=manifest.get("namespace", ""),
            require_store=require_store,
            generation=manifest["index"],
            secret=secret,
            read_only=read_only,
        )

    def persist(self, path: str | Path | None = None) -> Path:
        """Write the index and manifest to `path` (default: the engine's path). KV in a disk store is already there.

        The index files are written under a fresh generation name and committed by renaming the manifest
        over the old one: a process killed at any point leaves the previous index or the new one, whole. A
        write that fails (a full disk) raises StoreError and leaves the index on disk as it was.
        """
        folder = IndexFolder(path, secret=self.secret) if path is not None else self.folder
        if folder is None:
            raise InvalidRequestError("this engine has no path: pass persist(path)")
        self._check_writable("persist")
        with self._lock, folder.lock():
            self._commit(folder)
        return folder.path

    def _commit(self, folder: IndexFolder) -> None:
        """Commit the index to `folder` (the caller holds the locks)."""
        fp = self.kvmodel.fingerprint
        generation = folder.commit(
            self.index,
            {
                "model": self.model_source,
                "dtype": fp.dtype,
                "fingerprint": fp.digest,
                "architecture": fp.architecture,
                "weights": fp.weights,
                "embedder": self.embedder.name,
                "dim": self.index.dim,
                "chunk_tokens": self.chunk_tokens,
                "overlap": self.overlap,
                "storage_dtype": getattr(getattr(self.store, "back", self.store), "storage_dtype", "float16"),
                "namespace": self.namespace,
                "kv_store": describe_store(self.store),  # where the KV went (`info` shows it beside the store opened)
            },
        )
        if self.path is not None and folder.path.resolve() == self.path.resolve():
            self._generation = generation

    def _take_in_commits(self) -> None:
        """Reload the index if another process committed a newer one (the caller holds the folder lock)."""
        if self.folder is None or not self.folder.exists():
            return
        manifest = self.folder.manifest()
        if manifest["index"] == self._generation:
            return
        if (
            manifest["fingerprint"] != self.kvmodel.fingerprint.digest
            or manifest.get("namespace", "") != self.namespace
        ):
            raise IndexLoadError(
                f"another process wrote an index at {self.path} with another model or namespace: "
                "ingest into another folder"
            )
        self.index = self.folder.load_index(manifest, embed=self.embedder.embed)
        self._generation = manifest["index"]

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise InvalidRequestError(f"this engine was opened read-only: it cannot {what}; open it without read_only")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the engine's lock and, with a path, the folder's exclusive lock, with the latest commit taken in."""
        with self._lock:
            if self.folder is None:
                yield
                return
            self.folder.path.mkdir(parents=True, exist_ok=True)
            with self.folder.lock():
                self._take_in_commits()
                yield

    @property
    def kv(self) -> KVModel:
        """Deprecated name of `kvmodel`."""
        warnings.warn("KVRAG.kv is renamed KVRAG.kvmodel", DeprecationWarning, stacklevel=2)
        return self.kvmodel

    # -- ingestion --------------------------------------------------------------------------------------

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
    ) -> IngestStats:
        """Split, embed and index documents; encode and store each chunk's KV unless it is stored already.

        Args:
            items: texts (str), files or folders (pathlib.Path), (text, metadata) pairs or Documents.
            metadata: merged into every document's metadata. Metadata keys are str, values a str, finite number,
                bool or None or a list of them (what JSON keeps as it was); anything else raises InvalidRequestError.
            split: False keeps each document as one chunk (caller-given chunks).
            progress: show a tqdm progress bar over chunk encoding.
            on_progress: called with (chunks done, chunks total) after each encoding batch.
            follow_symlinks: read files and folders reached through symbolic links (refused by default).
            max_file_bytes: the largest file read (default 64 MiB); a larger one is a DocumentError.
        """
        t0 = time.perf_counter()
        self._check_writable("ingest")
        docs = to_documents(items, metadata, follow_symlinks=follow_symlinks, max_file_bytes=max_file_bytes)
        # Encoding takes the model's lock one group at a time and no folder lock: queries in this process and
        # readers in others go on meanwhile. Only the commit holds the locks.
        records, chunk_ids = self._chunk_records(docs, split)
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
        with self._writing():
            # a `gc` or `delete` may have removed an entry this ingest found stored or wrote: store it again
            again = {r.key: i for i, r in enumerate(records) if r.key not in self.store}
            if again:
                self.source.encode_and_store([chunk_ids[i] for i in again.values()], list(again))
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
        return IngestStats(
            documents=len(docs),
            chunks=len(records),
            tokens=sum(r.n_tokens for r in records),
            encoded=len(missing),
            store_hits=sum(stored),
            seconds=time.perf_counter() - t0,
            encode_s=encode_s,
        )

    def _chunk_records(self, docs: Sequence[Any], split: bool) -> tuple[list[ChunkRecord], list[list[int]]]:
        """Each document's chunks as index records (ids, text, metadata, store key), and their token ids."""
        records: list[ChunkRecord] = []
        chunk_ids: list[list[int]] = []
        for doc in docs:
            texts = (
                split_text(doc.text, self.kvmodel.tokenizer, chunk_tokens=self.chunk_tokens, overlap=self.overlap)
                if split
                else [doc.text.strip()]
            )
            for n, text in enumerate(texts):
                ids = self.kvmodel.chunk_ids(n, text)
                records.append(
                    ChunkRecord(
                        id=f"{doc.id}#{n}",
                        doc_id=doc.id,
                        text=text,
                        metadata=dict(doc.metadata),
                        key=self.source.key(ids),
                        n_tokens=len(ids),
                    )
                )
                chunk_ids.append(ids)
        return records, chunk_ids

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
            self.source.encode_and_store(ids, [r.key for r in records], on_batch=advance)
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

    # -- retrieval and answers --------------------------------------------------------------------------

    def retrieve(
        self,
        question: str,
        *,
        top_k: int = 5,
        filters: Filters | None = None,
        bm25: bool = False,
        hybrid: bool | None = None,
    ) -> list[Source]:
        """Top-k chunks for a question, best first, among those that pass `filters` (applied before top-k).

        `bm25=True` fuses the dense ranking with BM25's by reciprocal rank (`hybrid` is its deprecated name).
        """
        bm25 = _bm25_flag(bm25, hybrid)
        if not isinstance(question, str):
            raise InvalidRequestError(f"the question is a {type(question).__name__}: give a str")
        if not question.strip():
            raise EmptyInputError("the question is empty or whitespace only: ask something")
        check_top_k(top_k)
        check_unicode(question, "the question")
        filters = check_filters(filters)
        vector = self.embedder.embed([question])[0]
        with self._lock:
            if not len(self.index):
                where = f" at {self.path}" if self.path is not None else ""
                raise EmptyInputError(f"the index{where} holds no chunks: ingest documents first")
            hits = self.index.search(vector, question, top_k=top_k, filters=filters, bm25=bm25)
        return [Source(id=r.id, text=r.text, score=s, metadata=dict(r.metadata)) for r, s in hits]

    def stream(
        self,
        question: str,
        *,
        started_at: float | None = None,
        phases: Phases | None = None,
        top_k: int = 5,
        filters: Filters | None = None,
        bm25: bool = False,
        hybrid: bool | None = None,
        **options: Any,
    ) -> Iterator[str | Answer]:
        """Retrieve, then yield the answer's text pieces as decoded, then the final Answer (with sources).

        `options` are the request's (`KVModel.stream`: strategy, picker, budget, strict and decoding). With
        no `strategy`, the index's tuned default runs (`kvrag tune`), else the model's shipped default
        (`kvrag.defaults`: target_only on the named models, target_recompute on others); a `budget` or
        `picker` left out comes with that default. A stream answers whole (`query` splits as the default says).
        """
        t0 = started_at if started_at is not None else time.perf_counter()
        request = Request.of(question, **options)  # checked before any retrieval work
        with self._admitted():
            sources = self.retrieve(question, top_k=top_k, filters=filters, bm25=_bm25_flag(bm25, hybrid))
            if not sources:
                raise NoMatchError(f"no chunk matches the filters {dict(filters or {})}: loosen them")
            request.with_chunks([s.text for s in sources], [s.score for s in sources])
            yield from self._answer(request, sources, t0, time.perf_counter() - t0, phases)

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[None]:
        """One of the `max_in_flight` query slots, or BusyError at once when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            raise BusyError(
                f"{self.max_in_flight} queries are already in flight, this engine's bound (max_in_flight): retry "
                "when one ends, or open the engine with a larger max_in_flight"
            )
        try:
            yield
        finally:
            self._slots.release()

    def _answer(
        self,
        request: Request,
        sources: list[Source],
        t0: float,
        retrieve_s: float,
        phases: Phases | None,
        chunks: Chunks | None = None,
    ) -> Iterator[str | Answer]:
        request.with_default(self.defaults)  # the index's tuned default; else the model's shipped one (pipeline)
        chunks = chunks if chunks is not None else self.source.chunks(request.chunks)
        yield from pipeline.stream(
            self.kvmodel,
            request,
            chunks,
            self.executor,
            started_at=t0,
            phases=phases,
            sources=sources,
            retrieve_s=retrieve_s,
        )

    def query(self, question: str, *, parts: str | Sequence[str] | None = None, **kwargs: Any) -> Answer:
        """Retrieve and answer; the arguments are those of `stream`.

        `parts`: answer a part at a time (`KVModel.answer`'s `parts`: a list of part questions, or "auto" for the
        built-in splitter). The chunks are retrieved once for the whole question and their KV read once; each
        part's retrieval scores are its own question's against those chunks, so each part picks its own target.
        None with no strategy named: as the default says (the index's tuned one, else the model's shipped one;
        "auto" on Qwen2.5-Coder-0.5B). `stream` answers whole.
        """
        if parts is None and kwargs.get("strategy") in (None, "default"):  # the default may split questions
            parts = default_parts(self.defaults or shipped_default(self.kvmodel.fingerprint.weights))
        if parts is None:
            return last_answer(self.stream(question, **kwargs))
        split_parts = resolve_parts(question, parts)
        if split_parts is None:
            return last_answer(self.stream(question, **kwargs))
        return self._query_parts(question, split_parts, **kwargs)

    def _query_parts(
        self,
        question: str,
        parts: list[Part],
        *,
        top_k: int = 5,
        filters: Filters | None = None,
        bm25: bool = False,
        hybrid: bool | None = None,
        **options: Any,
    ) -> Answer:
        t0 = time.perf_counter()
        request = Request.of(question, **options)
        with self._admitted():
            sources = self.retrieve(question, top_k=top_k, filters=filters, bm25=_bm25_flag(bm25, hybrid))
            if not sources:
                raise NoMatchError(f"no chunk matches the filters {dict(filters or {})}: loosen them")
            request.with_chunks([s.text for s in sources], [s.score for s in sources])
            request.with_default(self.defaults)
            vectors = torch.as_tensor(self.embedder.embed([s.text for s in sources]))

            def scores_of(part: str) -> list[float]:
                return (vectors @ torch.as_tensor(self.embedder.embed([part]))[0]).tolist()

            return pipeline.answer_parts(
                self.kvmodel,
                request,
                parts,
                self.source.chunks(request.chunks),
                self.executor,
                started_at=t0,
                scores_of=scores_of,
                sources=sources,
                retrieve_s=time.perf_counter() - t0,
            )

    def stream_over(
        self,
        question: str,
        chunks: Sequence[str | Source],
        *,
        scores: Sequence[float] | None = None,
        started_at: float | None = None,
        retrieve_s: float = 0.0,
        phases: Phases | None = None,
        **options: Any,
    ) -> Iterator[str | Answer]:
        """`stream` over caller-given chunks (no retrieval); their KV comes from the store when stored.

        `chunks` are texts, or the `Source`s of a `retrieve` the caller ran itself (their ids, scores and
        metadata are kept; `retrieve_s` is the seconds it took, reported in the stats).
        """
        t0 = started_at if started_at is not None else time.perf_counter()
        if isinstance(chunks, (str, bytes, bytearray, Mapping)) or not isinstance(chunks, Iterable):
            raise InvalidRequestError(
                f"chunks is a {type(chunks).__name__}: give a list of chunk texts (or of Sources from retrieve)"
            )
        chunks = list(chunks)
        if not chunks:
            raise EmptyInputError("no chunks given: pass at least one chunk text")
        retrieved = all(isinstance(c, Source) for c in chunks)
        texts = [c.text for c in chunks] if retrieved else list(chunks)
        if retrieved and scores is None:
            scores = [c.score for c in chunks]
        request = Request.of(question, texts, scores=scores, **options)
        with self._admitted():
            given = self.source.chunks(request.chunks)  # tokenized once: the keys here, the KV in the pipeline
            if retrieved:
                sources = [replace(c, metadata=dict(c.metadata)) for c in chunks]
            else:
                sources = self._sources_of(request, given)
            yield from self._answer(request, sources, t0, retrieve_s, phases, given)

    def _sources_of(self, request: Request, given: Chunks) -> list[Source]:
        """Sources for caller-given texts: the indexed chunk's id and metadata where the text is indexed."""
        with self._lock:
            by_key = {r.key: r for r in self.index.records.values()}
        sources = []
        for i, text in enumerate(request.chunks):
            record = by_key.get(self.source.key(given.ids[i]))
            sources.append(
                Source(
                    id=record.id if record else f"given#{i}",
                    text=str(text),
                    score=request.scores[i] if request.scores is not None else 0.0,
                    metadata=dict(record.metadata) if record else {},
                )
            )
        return sources

    def answer(self, question: str, chunks: Sequence[str | Source], **kwargs: Any) -> Answer:
        """Answer over caller-given chunk texts; the arguments are those of `stream_over`."""
        return last_answer(self.stream_over(question, chunks, **kwargs))

    async def aquery(self, question: str, **kwargs: Any) -> Answer:
        """`query` in a worker thread, so the event loop keeps running."""
        return await to_thread(self.query, question, **kwargs)

    async def astream(self, question: str, **kwargs: Any) -> AsyncIterator[str | Answer]:
        """`stream` in a worker thread; pieces arrive as they are decoded, then the Answer."""
        async for item in in_thread(lambda: self.stream(question, **kwargs)):
            yield item

    async def astream_over(
        self, question: str, chunks: Sequence[str | Source], **kwargs: Any
    ) -> AsyncIterator[str | Answer]:
        """`stream_over` in a worker thread."""
        async for item in in_thread(lambda: self.stream_over(question, chunks, **kwargs)):
            yield item

    async def aanswer(self, question: str, chunks: Sequence[str | Source], **kwargs: Any) -> Answer:
        """`answer` in a worker thread."""
        return await to_thread(self.answer, question, chunks, **kwargs)

    def _ingested_into(self) -> str | None:
        """The store the committed index was last ingested into, as its manifest records it."""
        if self.folder is None or not self.folder.exists():
            return None
        return self.folder.manifest().get("kv_store")

    def gc(self, *, dry_run: bool = False) -> dict[str, int]:
        """Delete the store's entries that no indexed chunk refers to (a killed ingest's, a deleted document's
        when another chunk shared nothing) and dead writers' temporary files; return what was (or, with
        `dry_run`, would be) removed.

        The store is this engine's namespace's view. Entries that `store_kv` wrote for another framework's
        chunks are not indexed either: they go too (re-encoded on their next use). Run it only on a store no
        other index writes to (the index folder's own `kv/`, or a namespace this index alone uses). A dry run
        removes nothing and works on an engine opened read-only.
        """
        if not dry_run:
            self._check_writable("collect garbage")
        with self._lock if dry_run else self._writing():  # an ingest re-checks its entries under this lock
            live = {r.key for r in self.index.records.values()}
            orphans = [k for k in self.store.keys() if k not in live]
            if not dry_run:
                for key in orphans:
                    self.store.delete(key)
            temp = sum(len(d.stale_temp_files(remove=not dry_run)) for d in _disk_stores(self.store))
        return {"orphan_entries": len(orphans), "temp_files": temp}

    def info(self) -> dict[str, Any]:
        """Counts, bytes and the model fingerprint; the store's entries, and how many are orphans (no indexed
        chunk refers to them: `gc` removes them) or missing (indexed, not stored: recomputed when read)."""
        with self._lock:
            live = {r.key for r in self.index.records.values()}
            index = self.index
        stored = set(self.store.keys())  # outside the lock: a long listing holds up no query
        return {
            "path": str(self.path) if self.path else None,
            "documents": len(index.docs()),
            "chunks": len(index),
            "tokens": sum(r.n_tokens for r in index.records.values()),
            "kv_store": describe_store(self.store),
            "kv_store_at_ingest": self._ingested_into(),
            "kv_entries": len(stored),
            "kv_bytes": self.store.nbytes,
            "kv_orphans": len(stored - live),
            "kv_missing": len(live - stored),
            "model": asdict(self.kvmodel.fingerprint),
            "fingerprint": self.kvmodel.fingerprint.digest,
            "embedder": self.embedder.source,
            "chunk_tokens": self.chunk_tokens,
            "overlap": self.overlap,
            "namespace": self.namespace,
        }


def _bm25_flag(bm25: bool, hybrid: bool | None) -> bool:
    """The retrieval flag, from its deprecated name when that is given."""
    if hybrid is not None:
        warnings.warn("the retrieval flag hybrid= is renamed bm25=", DeprecationWarning, stacklevel=3)
        bm25 = hybrid
    if not isinstance(bm25, bool):
        raise InvalidRequestError(f"bm25 must be True or False, got {bm25!r}")
    return bm25


def check_secret(secret: bytes | str | None) -> bytes:
    """A tenant secret as bytes (b"" for none): at least 16 bytes, e.g. `openssl rand -hex 32`."""
    if secret is None:
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


def _disk_stores(store: KVStore) -> list[DiskStore]:
    if isinstance(store, TieredStore):
        return _disk_stores(store.front) + _disk_stores(store.back)
    return [store] if isinstance(store, DiskStore) else []


def describe_store(store: KVStore) -> str:
    """Where a store keeps entries, in one line without credentials (for `info` and the manifest)."""
    if isinstance(store, TieredStore):
        return f"{describe_store(store.front)} in front of {describe_store(store.back)}"
    if isinstance(store, DiskStore):
        return f"disk {store.root}"
    url = getattr(store, "url", None)
    if url is not None:
        return f"redis {url} under {getattr(store, 'prefix', '')}*"
    return "memory" if "Memory" in type(store).__name__ else type(store).__name__


def _resolved(path: str) -> str:
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError, ValueError):
        return ""
