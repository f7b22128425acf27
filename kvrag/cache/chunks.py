"""From a request's chunks (texts or ChunkKV) to their token ids and, when asked, their KV: the one way to get it.

`ChunkSource` binds a model runtime (`kvrag.model.runtime`; a KVModel is one) to an optional store and
namespace; it owns the one chunk key (namespace included) that the engine, the study and the bench all use. `Chunks` is one request's set: token ids at
once (checked), KV only for the chunks a plan or a picker reads, each fetched once: from the store, else
encoded (and stored). It never plans and never runs a prefill.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Callable, Iterable, Iterator, Sequence

from kvrag.cache.kv import ChunkKey, ChunkKV, StoredChunk
from kvrag.cache.store import KVStore, StoreWarning
from kvrag.cache.writer import StoreWriter
from kvrag.errors import StoreError
from kvrag.model.encode import length_batches
from kvrag.model.runtime import ModelRuntime

logger = logging.getLogger(__name__)


class ChunkSource:
    """Where a model's chunk KV comes from: a store (optional) under a namespace, else fresh encoding.

    Args:
        kvmodel: the model the KV belongs to.
        store: where chunk KV is kept; None encodes every text chunk a request reads.
        namespace: enters every key, so namespaces sharing one store never serve each other's KV.
        secret: a tenant secret: keys are HMACs under it and stored entries' checksums are keyed with it, so
            neither a label nor write access to the store lets anyone else probe or forge this tenant's KV.
    """

    def __init__(
        self,
        kvmodel: ModelRuntime,
        store: KVStore | None = None,
        namespace: str = "",
        secret: bytes = b"",
        *,
        read_only: bool = False,
    ) -> None:
        self.kvmodel, self.store, self.namespace, self.secret = kvmodel, store, namespace, secret
        self.read_only = read_only  # recomputed chunks are never written (an engine opened read-only)
        if store is not None:  # the store serves this model's entries only, read back as the model runs
            store.bind(
                encoder=kvmodel.encoder_id,
                dtype=kvmodel.prefix.keys.dtype,
                device=kvmodel.prefix.keys.device,
                secret=secret,
            )

    def key(self, ids: Sequence[int], context: Sequence[int] = ()) -> ChunkKey:
        """A chunk's store key under this model, its chunk prefix, this namespace and secret; `context`: the ids it
        was encoded behind in its document's run (none: alone)."""
        return self.kvmodel.chunk_key(ids, namespace=self.namespace, secret=self.secret, context=context)

    def chunks(self, given: Sequence[str | ChunkKV], keys: Sequence[str | None] | None = None) -> Chunks:
        """One request's chunks (their ids checked against the model now, their KV fetched when read); `keys`: the
        store keys of chunks encoded in their document's context (None for one encoded alone)."""
        return Chunks(self, given, keys)

    def load(self, key: str, ids: Sequence[int] | None = None) -> ChunkKV | None:
        """A chunk's stored KV; a store that fails to answer is a miss (the chunk is recomputed) and a warning.

        With `ids` (the chunk's token ids), an entry holding other tokens is a miss and a warning too: another
        chunk's KV written at this key (forged, or a bug elsewhere) is never used for this chunk.
        """
        if self.store is None:
            return None
        try:
            kv = self.store.get(key)
        except StoreError as err:
            warnings.warn(f"kvrag: the KV store failed ({err}); recomputing the chunk instead", StoreWarning, 4)
            return None
        return self._checked(key, kv, ids)

    def holds(self, key: str) -> bool:
        """Whether the store has an entry at `key` (not read, so not verified); a store that fails is a warning."""
        if self.store is None:
            return False
        try:
            return key in self.store
        except StoreError as err:
            warnings.warn(f"kvrag: the KV store failed ({err}); recomputing the chunk instead", StoreWarning, 4)
            return False

    def peek(self, key: str, ids: Sequence[int]) -> ChunkKV | None:
        """A chunk's KV if this process holds it in memory already (another request stored it meanwhile)."""
        if self.store is None:
            return None
        return self._checked(key, self.store.peek(key), ids)

    def _checked(self, key: str, kv: ChunkKV | None, ids: Sequence[int] | None) -> ChunkKV | None:
        if kv is not None and ids is not None and kv.token_ids.tolist() != list(ids):
            warnings.warn(
                f"kvrag: the stored entry {key[:16]}... holds the KV of other tokens than its chunk's (a forged or "
                "misplaced entry); recomputing the chunk instead",
                StoreWarning,
                4,
            )
            return None
        return kv

    def encode_and_store(
        self,
        ids: Sequence[Sequence[int]],
        keys: Sequence[str],
        *,
        runs: Sequence[Sequence[int]] | None = None,
        on_batch: Callable[[int, int], None] | None = None,
        queued: int = 1,
    ) -> None:
        """Encode chunks and store their KV under `keys` (ingestion), one full encoding forward at a time.

        `runs`: indices into `ids`, a document's chunks each encoded behind its run's earlier ones
        (`kvrag.model.encode.encode_runs`); None encodes each chunk alone.

        The chunks are sorted by length into forwards of at most `batch_tokens` rows x width (the least padding);
        each forward's KV goes to a writer thread (`kvrag.cache.writer`) that stores it while the next forward runs.
        At most `queued` forwards' KV wait for it, so memory holds `queued` + 2 forwards' KV (the one encoding,
        those waiting, the one being written) however many chunks.

        The model's lock is held for each forward only, so queries interleave with a long ingest; the store is
        written outside it. A store that fails raises StoreError here (ingestion must not lose KV) and nothing
        after it is written. `on_batch(chunks, tokens)` after each forward.
        """
        model = self.kvmodel
        runs = [[i] for i in range(len(ids))] if runs is None else runs
        lengths = [sum(len(ids[i]) for i in run) for run in runs]
        with StoreWriter(self.store, queued=queued) as writer:  # type: ignore[arg-type]
            for batch in length_batches(lengths, max(model.batch_tokens, 1)):
                chunks = [i for r in batch for i in runs[r]]
                with model.lock:  # one forward: the batch fits batch_tokens
                    encoded = model.encode_runs_ids([[ids[i] for i in runs[r]] for r in batch])
                kvs = [kv for run in encoded for kv in run]
                del encoded
                writer.put([(keys[i], kv) for i, kv in zip(chunks, kvs)])
                del kvs
                if on_batch is not None:
                    on_batch(len(chunks), sum(lengths[r] for r in batch))

    def keep(self, key: str, kv: ChunkKV, *, later: list[tuple[str, ChunkKV]] | None = None) -> ChunkKV:
        """Store freshly encoded KV; return it as a later load would (the same answer either way).

        With `later`, the write is appended there instead, for the caller to `put` once it has let go of
        the model's lock (`Chunks.deferring`): a slow store then holds up no other request.
        """
        if self.store is None:
            return kv
        if later is not None:
            later.append((key, kv))
        else:
            self.put(key, kv)
        return self.store.as_stored(kv)

    def put(self, key: str, kv: ChunkKV) -> bool:
        """Write a chunk's KV; a store that fails is a warning (the answer never needed it). True if written."""
        if self.read_only:
            return False
        try:
            self.store.put(key, kv)  # type: ignore[union-attr]
            return True
        except StoreError as err:
            warnings.warn(f"kvrag: could not store a chunk's KV ({err}); answering anyway", StoreWarning, 4)
            return False


class Chunks:
    """One request's chunks: ids now, KV on first read, with what getting it cost.

    Attributes:
        ids: each chunk's token ids, in the given order.
        store_hits: chunks whose KV came from the store.
        encoded: chunks encoded by this request.
        encode_s: seconds spent encoding them; load_s: seconds spent reading the store.
    """

    def __init__(
        self, source: ChunkSource, given: Sequence[str | ChunkKV], keys: Sequence[str | None] | None = None
    ) -> None:
        self.source = source
        self.given = list(given)
        # a chunk encoded in its document's context is stored at its record's key; a miss of it is encoded alone
        # and not stored there (that key holds in-context KV only)
        self.context_keys = list(keys) if keys is not None else [None] * len(self.given)
        self.ids = [source.kvmodel.chunk_ids(i, c) for i, c in enumerate(self.given)]
        self._kv: list[ChunkKV | None] = [c if isinstance(c, ChunkKV) else None for c in self.given]
        self._tried = [False] * len(self.given)  # the store was asked (a miss is not asked again)
        self._hit = [False] * len(self.given)  # the KV came from the store
        self._used: set[int] = set()  # chunks whose KV a plan or a picker read
        self._writes: list[tuple[str, ChunkKV]] | None = None  # encoded KV to store after the lock (`deferring`)
        self.encoded = 0
        self.encode_s = self.load_s = 0.0

    def __len__(self) -> int:
        return len(self.given)

    @property
    def store_hits(self) -> int:
        """Chunks read by the request whose KV came from the store (prefetched ones the plan left out don't count)."""
        return sum(self._hit[i] for i in self._used)

    @property
    def lengths(self) -> list[int]:
        return [len(i) for i in self.ids]

    def texts(self) -> list[str]:
        """Each chunk's text (a ChunkKV's decoded from its ids)."""
        tok = self.source.kvmodel.tokenizer
        return [c if isinstance(c, str) else tok.decode(c.token_ids) for c in self.given]

    def kv(self, indices: Iterable[int] | None = None) -> list[ChunkKV]:
        """The KV of `indices` (default: every chunk), fetched once each: stored, else encoded together.

        The caller holds the model's lock (`kvrag.run.pipeline.prefill` does, and so does each probe measurement).
        """
        wanted = list(range(len(self.given)) if indices is None else indices)
        self._used.update(wanted)
        missing = list(dict.fromkeys(i for i in wanted if self._kv[i] is None))
        if missing:
            self._fetch(missing)
        return [self._kv[i] for i in wanted]  # type: ignore[misc]

    def stored(self, indices: Iterable[int]) -> list[ChunkKV | StoredChunk]:
        """For an executor that reads the store itself: each chunk the store holds as a `StoredChunk` (its entry
        is not read here). A miss is encoded and, since that executor reads it from the store, written at once
        (not when `deferring` ends) and handed over as stored too; KV in hand already, or a write that failed,
        comes as `kv` gives it."""
        wanted = list(indices)
        self._used.update(wanted)
        source, found, keys = self.source, {}, {}
        start = len(source.kvmodel.chunk_prefix)
        for i in dict.fromkeys(wanted):
            if self._kv[i] is not None or source.store is None or self.context_keys[i] is not None:
                continue  # an in-context entry's start is its own: read here, handed over as KV
            keys[i] = key = source.key(self.ids[i])
            self._tried[i] = True  # a miss here is not asked again: `kv` encodes it
            if source.holds(key):
                self._hit[i] = True
                found[i] = StoredChunk(key, start, len(self.ids[i]))
        rest = [i for i in wanted if i not in found]
        read = dict(zip(rest, self.kv(rest)))
        pending = dict(self._writes or [])
        for i in dict.fromkeys(rest):
            kv = pending.get(keys.get(i, ""))
            if kv is not None and source.put(keys[i], kv):
                self._writes = [w for w in self._writes or [] if w[0] != keys[i]]  # written: not again at the end
                found[i] = StoredChunk(keys[i], start, len(self.ids[i]))
        return [found[i] if i in found else read[i] for i in wanted]

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Within it, KV encoded for a miss is stored when it ends, not as it is encoded: a caller holding the
        model's lock inside it writes nothing to a slow store while other requests wait for the model."""
        self._writes = []
        try:
            yield
        finally:
            writes, self._writes = self._writes, None
            for key, kv in writes:
                self.source.put(key, kv)

    def holds(self, indices: Iterable[int]) -> bool:
        """Whether the KV of every one of `indices` is in hand (read or given): `kv` of them then encodes nothing."""
        return all(self._kv[i] is not None for i in indices)

    def prefetch(self, indices: Iterable[int] | None = None) -> None:
        """Read the stored KV of `indices` (default: every chunk) now, encoding nothing: called before the model's
        lock is taken, so a slow or hung store delays this request only, never another one waiting for the model."""
        if self.source.store is None:
            return
        for i in range(len(self.given)) if indices is None else indices:
            if self._kv[i] is None and not self._tried[i]:
                self._load(i, self.key(i))

    def _load(self, i: int, key: str) -> None:
        t0 = time.perf_counter()
        self._kv[i] = self.source.load(key, self.ids[i])
        self._tried[i] = True
        self.load_s += time.perf_counter() - t0
        self._hit[i] = self._kv[i] is not None
        logger.debug("chunk %d: %s from the store (%s...)", i, "read" if self._hit[i] else "missed", key[:16])

    def key(self, i: int) -> str:
        """Chunk i's store key: its record's, for one encoded in its document's context, else its ids'."""
        return self.context_keys[i] or self.source.key(self.ids[i])

    def _fetch(self, missing: list[int]) -> None:
        source, model = self.source, self.source.kvmodel
        keys = {i: self.key(i) for i in missing} if source.store is not None else {}
        for i in keys:
            if not self._tried[i]:
                self._load(i, keys[i])
            elif self._kv[i] is None:  # missed before the lock: another request may have stored it since
                self._kv[i] = source.peek(keys[i], self.ids[i])
                self._hit[i] = self._kv[i] is not None
        fresh = [i for i in missing if self._kv[i] is None]
        if not fresh:
            return
        t0 = time.perf_counter()
        encoded = model.encode_ids([self.ids[i] for i in fresh])
        self.encode_s += time.perf_counter() - t0
        self.encoded += len(fresh)
        logger.debug("chunks %s encoded (not stored: %s)", fresh, [i for i in fresh if i not in keys])
        alone = [i for i in fresh if self.context_keys[i] is not None]
        if alone:
            logger.info("chunks %s: their in-context KV is not stored (evicted or deleted): encoded alone", alone)
        for i, kv in zip(fresh, encoded):
            kept = i in keys and self.context_keys[i] is None  # in-context keys never get KV encoded alone
            self._kv[i] = source.keep(keys[i], kv, later=self._writes) if kept else kv

