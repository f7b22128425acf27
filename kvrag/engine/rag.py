"""KVRAG: the KV-aware retrieval engine. Documents in, answers out; every chunk's KV computed once and kept.

It owns the index (records, vectors), the KV store and one KVModel, and wires them: ingestion splits,
embeds, encodes and stores; a query retrieves, makes the request, and hands it with its chunks (through
the store: only the KV a plan reuses is read, misses are encoded) to `kvrag.run.pipeline`. Planning and
model work stay out of it; the index folder on disk is `kvrag.engine.folder`'s.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence

from kvrag.answer import Answer, Source
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.codec import check_storage_dtype
from kvrag.cache.secret import check_secret, resolve_secret
from kvrag.cache.store import (
    DiskStore,
    KVStore,
    MemoryStore,
    StoreWarning,
    TieredStore,
    check_namespace,
)
from kvrag.engine.aio import in_thread, to_thread
from kvrag.engine.embed import Embedder
from kvrag.engine.folder import MANIFEST, IndexFolder
from kvrag.engine.index import ChunkIndex
from kvrag.model.layout import CONTEXT_HEADER
from kvrag.engine.ingest import Ingesting, IngestStats, check_encoding  # noqa: E402
from kvrag.engine.query import Querying  # noqa: E402
from kvrag.engine.upkeep import Upkeep, describe_store, durable_store
from kvrag.errors import (
    IndexLoadError,
    InvalidRequestError,
    ModelNotFoundError,
    StoreError,
)
from kvrag.files import make_dirs
from kvrag.kvmodel import KVModel
from kvrag.model.catalog import shipped_encoding, shipped_storage_dtype
from kvrag.plan.defaults import load_default
from kvrag.run.executor import Executor

__all__ = ["IngestStats", "KVRAG", "MANIFEST", "StoreWarning"]


class KVRAG(Ingesting, Querying, Upkeep):
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
        executor: what runs the plans (`kvrag.run.executor`); default the model's in-process one. A serving
            engine's (`vllm_kvrag.executor.VLLMExecutor`) runs them there; retrieval and planning stay here.
        secret: the secret entries are keyed with (bytes or str of 16 bytes or more). Store keys become HMACs
            under it and stored entries and index files are checksummed with it, so another writer of the store
            can neither probe this engine's chunks nor forge its KV. The index keeps only a check value: opening
            it needs the same secret again. None (default): the user's own key (`kvrag.cache.secret`, made on
            first use) for an engine with a path or a disk or Redis store, none for memory alone. "" keys nothing
            (anyone who can write the store can forge its entries: for indexes built before keys were the default).
        read_only: never write: nothing stored, committed, deleted or created (what `kvrag ask` opens).
        max_in_flight: queries admitted at once (one runs on the model, the rest wait for it); one more
            raises BusyError at once instead of growing memory without bound.
        lock_timeout_s: the longest wait for the index folder's lock held by another process, then
            LockTimeoutError naming it; None (default): a few seconds to read, longer to write (`IndexFolder`).
        encoding: how ingestion encodes a document's chunks: "document", each behind its document's earlier
            chunks (in runs within the model's context window, `KVModel.encode_in_context`): a document's chunks
            read in order are then exactly its full prefill, and each chunk's KV has read what came before it; or
            "alone", each behind the prompt prefix only (what indexes built before "document" hold). None
            (default): the model's choice (`kvrag.model.catalog`: "alone" for the embedded 135M, whose one-chunk
            default answered as many right and sooner so, "document" for any other model). Kept with the index;
            its records say how each chunk was encoded (a chunk whose in-context KV is missing from the store is
            encoded alone). Chosen on held-out sources: docs/study.md.

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
        lock_timeout_s: float | None = None,
        encoding: str | None = None,
    ) -> None:
        self.kvmodel = kv
        self.encoding = check_encoding(encoding or shipped_encoding(kv.fingerprint.weights))
        self.executor = executor or kv.executor  # what runs the plans: in-process by default
        self.embedder = embedder
        self.namespace = check_namespace(namespace) if namespace else ""
        self.secret = resolve_secret(secret, durable=path is not None or durable_store(store))
        self._unkeyed_by_choice = secret is not None and not self.secret  # secret="": never key a folder
        self.read_only = bool(read_only)
        self.kv_on_demand = False  # an ingest left chunks' KV to their first retrieval (kept in the manifest)
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
            IndexFolder(self.path, read_only=self.read_only, secret=self.secret, lock_timeout_s=lock_timeout_s)
            if self.path is not None
            else None
        )
        dim = int(embedder.embed(["dimension probe"]).shape[1])
        self.index = index or ChunkIndex(dim)
        self.chunk_tokens, self.overlap = chunk_tokens, overlap
        self.model_source = model_source
        self._generation = generation  # the committed index generation this engine's index reflects
        # the strategy, picker and budget a query runs with when it names no strategy: `kvrag tune`'s choice
        # saved with the index, else the model's shipped default (kvrag.plan.defaults)
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
        model: str | KVModel | None = None,
        embedder: str | None = None,
        store: KVStore | None = None,
        storage_dtype: str | None = None,
        memory_bytes: int = 1 << 30,
        max_kv_bytes: int | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        chunk_tokens: int = 200,
        overlap: int = 20,
        cache_dir: str | Path | None = None,
        namespace: str = "",
        require_store: bool = False,
        secret: bytes | str | None = None,
        compile_decode: bool = False,
        decode_weights: str | None = None,
        cpu_kernels: bool = True,
        create: bool = True,
        lock_timeout_s: float | None = None,
        encoding: str | None = None,
        header: str | None = None,
    ) -> KVRAG:
        """An engine on the embedded defaults (or the given model and embedder), loading `path` if it holds an index.

        The KV store defaults to memory in front of a disk store in `path/kv` (memory only without a path).
        `storage_dtype` is the default disk store's (`DiskStore`); None: the model's shipped choice (int4 entries
        for the 0.5B and the 1.5B, `kvrag.model.catalog`, float16 for any other model).
        `max_kv_bytes` bounds the default disk store (least recently used entries evicted past it: `DiskStore`; kept
        in the manifest, so the folder keeps its bound when opened again).
        `namespace`, `require_store` and `secret` are those of `KVRAG`; `compile_decode`, `decode_weights` and
        `cpu_kernels` those of `KVModel`. `model` is a named model (`kvrag models`), a Hugging Face id or a
        folder, or a `KVModel` already loaded (the one a `KVRAGLLM` or `ChatKVRAG` holds: one copy of the weights
        serves both; an index at `path` must have been built with that model). `create=False` refuses a `path`
        that holds no index (IndexLoadError naming it) instead of starting a new, empty one there: for code that
        only reads an index, where a mistyped path would otherwise answer from nothing. `lock_timeout_s` and
        `encoding` are `KVRAG`'s (None: the index's, the model's choice for a new one). `header`: the prompts' context
        header of a new index (`kvrag.model.layout`; None: the model's choice); an existing index keeps its own, and
        another given is refused.
        """
        # a bad secret, encoding, storage dtype or namespace is refused before the model loads or a folder is made
        check_secret(secret)
        if encoding is not None:
            check_encoding(encoding)
        if storage_dtype is not None:
            check_storage_dtype(storage_dtype)
        if namespace:
            check_namespace(namespace)
        if not create and path is not None and IndexFolder(path).uncommitted():
            raise IndexFolder(path).absent()
        if not create and (path is None or not IndexFolder(path).exists()):
            raise IndexLoadError(
                f"no kvrag index at {path}: check the path, or build one there with `kvrag ingest PATH --index {path}` "
                "(create=True starts an empty one)"
            )
        if path is not None and IndexFolder(path).exists():
            engine = cls.load(
                path,
                store=store,
                memory_bytes=memory_bytes,
                max_kv_bytes=max_kv_bytes,
                device=device,
                cache_dir=cache_dir,
                namespace=namespace or None,
                require_store=require_store,
                secret=secret,
                compile_decode=compile_decode,
                decode_weights=decode_weights,
                cpu_kernels=cpu_kernels,
                model=model if isinstance(model, KVModel) else None,
                lock_timeout_s=lock_timeout_s,
                encoding=encoding,
            )
            if header is not None and header != engine.kvmodel.layout.header:
                raise InvalidRequestError(
                    f"the index at {path} was built under the header {engine.kvmodel.layout.header!r}, not "
                    f"{header!r}: its chunks were encoded behind it; drop the header or ingest into a new folder"
                )
            return engine
        if isinstance(model, KVModel):
            kv, source = model.with_header(header) if header is not None else model, model.loaded_from
        else:
            kv, source = (
                KVModel.from_pretrained(
                    model,
                    dtype=dtype,
                    device=device,
                    cache_dir=cache_dir,
                    compile_decode=compile_decode,
                    decode_weights=decode_weights,
                    cpu_kernels=cpu_kernels,
                    **({"header": header} if header is not None else {}),
                ),
                model,
            )
        if store is None:
            store = MemoryStore(memory_bytes)
            if path is not None:
                storage_dtype = storage_dtype or shipped_storage_dtype(kv.fingerprint.weights)
                disk = DiskStore(IndexFolder(path).kv_folder(), storage_dtype, max_bytes=max_kv_bytes)
                store = TieredStore(store, disk)
        return cls(
            kv,
            embedder=Embedder(embedder, device=device),
            store=store,
            path=path,
            chunk_tokens=chunk_tokens,
            overlap=overlap,
            model_source=source,
            namespace=namespace,
            require_store=require_store,
            secret=secret,
            lock_timeout_s=lock_timeout_s,
            encoding=encoding,
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        store: KVStore | None = None,
        memory_bytes: int = 1 << 30,
        max_kv_bytes: int | None = None,
        device: str = "cpu",
        cache_dir: str | Path | None = None,
        namespace: str | None = None,
        require_store: bool = False,
        secret: bytes | str | None = None,
        read_only: bool = False,
        compile_decode: bool = False,
        decode_weights: str | None = None,
        cpu_kernels: bool = True,
        model: KVModel | None = None,
        lock_timeout_s: float | None = None,
        encoding: str | None = None,
    ) -> KVRAG:
        """Open an index folder written by an engine with a path; the model and embedder are those it was built with.

        The namespace is the one the index was built with; passing another raises IndexLoadError, and so does
        a `secret` other than the one it was built with. `read_only` opens it without writing anything (a
        chunk recomputed for lack of stored KV is not stored). `max_kv_bytes` bounds its disk store (default: the
        bound it was built with, if any). `compile_decode`, `decode_weights` and `cpu_kernels` are those of `KVModel`;
        `model`, a `KVModel` already loaded with the index's model, is used instead of loading another copy
        (refused, naming both, when its weights are not the index's). `lock_timeout_s` is `KVRAG`'s; `encoding`
        too, for what is ingested from now on (None: the index's). The prompts take the index's context header (its
        chunks were encoded behind it): a model given with another header answers through a runtime that has it.
        """
        folder = IndexFolder(
            path,
            read_only=read_only,
            secret=None if secret is None else check_secret(secret),
            lock_timeout_s=lock_timeout_s,
        )
        if not folder.exists():
            raise folder.absent()
        with folder.lock(shared=True):
            manifest = folder.manifest()
            if namespace is not None and namespace != manifest.get("namespace", ""):
                raise IndexLoadError(
                    f"the index at {folder.path} was built for namespace {manifest.get('namespace', '')!r}, not "
                    f"{namespace!r}: open it without a namespace or ingest into another folder"
                )
            header = manifest.get("header", CONTEXT_HEADER)  # an index from before headers: kvrag's own
            kv = model or KVModel.from_pretrained(
                manifest["model"],
                dtype=manifest["dtype"],
                device=device,
                cache_dir=cache_dir,
                compile_decode=compile_decode,
                decode_weights=decode_weights,
                cpu_kernels=cpu_kernels,
                header=header,
            )
            kv = kv.with_header(header)  # its chunks were encoded under it (the given model's, where they are one)
            if kv.fingerprint.digest != manifest["fingerprint"]:
                given = f", not {kv.fingerprint.architecture} {kv.fingerprint.weights} ({kv.fingerprint.dtype})"
                raise IndexLoadError(
                    f"the index at {folder.path} was built with another model ({manifest['architecture']}, "
                    f"{manifest['weights']}, {manifest['dtype']}{given if model is not None else ''}): open it with "
                    "that model or re-ingest"
                )
            try:
                embedder = Embedder(manifest["embedder"], device=device)
            except ModelNotFoundError as err:
                raise IndexLoadError(
                    f"the index manifest {folder.path / MANIFEST} names an embedder kvrag cannot load (field "
                    f"'embedder'): {err}"
                ) from None
            index = folder.load_index(manifest, embed=embedder.embed)
        # an index ingested with KV on demand keeps each chunk's KV when it is first computed, read-only or not
        kv_writes = not read_only or manifest.get("kv_on_demand") is True
        if store is None:
            bound = manifest.get("kv_max_bytes") if max_kv_bytes is None else max_kv_bytes
            disk = DiskStore(folder.kv_folder(), manifest["storage_dtype"], read_only=not kv_writes, max_bytes=bound)
            store = TieredStore(MemoryStore(memory_bytes), disk)
        engine = cls(
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
            lock_timeout_s=lock_timeout_s,
            encoding=encoding or manifest.get("encoding", "alone"),  # an index from before encodings: alone
        )
        engine.kv_on_demand = manifest.get("kv_on_demand") is True
        engine.source.read_only = not kv_writes
        return engine

    def persist(self, path: str | Path | None = None) -> Path:
        """Write the index and manifest to `path` (default: the engine's path). KV in a disk store is already there.

        The index files are written under a fresh generation name and committed by renaming the manifest
        over the old one: a process killed at any point leaves the previous index or the new one, whole. A
        write that fails (a full disk) raises StoreError and leaves the index on disk as it was.
        """
        if path is not None:  # a memory-only engine's folder is keyed as any other (the user's key by default)
            keyed = self.secret or (b"" if self._unkeyed_by_choice else resolve_secret(None, durable=True))
            folder = IndexFolder(path, secret=keyed)
        else:
            folder = self.folder
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
                "kv_max_bytes": getattr(getattr(self.store, "back", self.store), "max_bytes", None),
                "kv_on_demand": self.kv_on_demand,
                "encoding": self.encoding,
                "header": self.kvmodel.layout.header,  # every chunk's prefix: the index answers under it
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
            make_dirs(self.folder.path)
            with self.folder.lock():
                self._take_in_commits()
                yield

    @property
    def kv(self) -> KVModel:
        """Deprecated name of `kvmodel`."""
        warnings.warn("KVRAG.kv is renamed KVRAG.kvmodel", DeprecationWarning, stacklevel=2)
        return self.kvmodel

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
