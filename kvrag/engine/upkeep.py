"""Upkeep of an engine's index and store: what they hold (`info`), whether every entry is whole (`verify`) and
what no chunk refers to any more (`gc`). The KVRAG engine's third half (`KVRAG` takes it in as a base class)."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

from kvrag import cpu
from kvrag.cache.store import DiskStore, KVStore, SerializedStore, StoreWarning, TieredStore


class Upkeep:
    """What `KVRAG` does to inspect and clean its index and store (see `kvrag.engine.rag.KVRAG` for the attributes
    it uses)."""

    def _ingested_into(self) -> str | None:
        """The store the committed index was last ingested into, as its manifest records it."""
        if self.folder is None or not self.folder.exists():
            return None
        return self.folder.manifest().get("kv_store")

    def _run_before(self, record: Any) -> list[Any] | None:
        """The records of the chunks a chunk encoded in its document's context was encoded behind (its run's earlier
        chunks), or None where they are not all indexed. The caller holds the lock."""
        n = int(record.id.rpartition("#")[2])
        earlier = [self.index.records.get(f"{record.doc_id}#{m}") for m in range(n - record.after, n)]
        return None if any(r is None for r in earlier) else earlier

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

    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Read every indexed chunk's stored KV and check it (its keyed checksum, and that it holds the chunk's own
        tokens); with `repair`, re-encode each entry that fails and write it back, and store each one missing.

        Something other than a regular file at a chunk's entry (a link, a folder, a FIFO) is damaged, as is an entry
        larger than an entry can be (never read whole): `repair` removes it (a link itself, never its target) and
        writes the entry. Returns the counts (`checked`, `ok`, `damaged`, `missing`: indexed, not stored; `repaired`:
        damaged entries written again; `filled`: missing ones stored by `repair`, except in an index with KV on
        demand or a bounded store, where a missing entry is how the index works and is computed when first read)
        and `damaged_chunks`, the chunk ids of the failed entries. A store that cannot be read raises StoreError.
        """
        if repair:
            self._check_writable("repair entries")
        with self._lock:
            records = sorted(self.index.records.values(), key=lambda r: r.id)
            before = {r.id: self._run_before(r) for r in records if r.after}
        disks = _disk_stores(self.store)
        ok, damaged, missing, absent = 0, [], 0, []
        with warnings.catch_warnings():  # each failure is reported in the result, not warned about one by one
            warnings.simplefilter("ignore", StoreWarning)
            for record in records:
                ids = self.kvmodel.chunk_ids(0, record.text)
                context = [t for r in before.get(record.id) or [] for t in self.kvmodel.chunk_ids(0, r.text)]
                if record.after and before.get(record.id) is None:
                    missing += 1  # its document's earlier chunks are not indexed as they were: recomputed alone
                elif self.source.key(ids, context) != record.key:
                    missing += 1  # another model's or prefix's key cannot be read here: recomputed when used
                elif any(d.irregular(record.key) for d in disks):
                    damaged.append((record, ids))  # a link, folder or FIFO at its name: never read, never an entry
                elif not self.source.holds(record.key):
                    missing += 1
                    absent.append((record, ids))
                elif self.source.load(record.key, ids) is None:
                    damaged.append((record, ids))
                else:
                    ok += 1
        bounded = any(d.max_bytes is not None for d in disks)
        fill = absent if repair and not (self.kv_on_demand or bounded) else []
        if repair and (damaged or fill):
            with self._writing():
                for record, _ in damaged:
                    self.store.delete(record.key)  # the bad entry goes first: a tier must not serve it again
                # one entry a key (chunks may share one); one in context is encoded behind its run's earlier chunks,
                # which are stored again with it (the same KV their entries hold)
                todo = {r.key: [*before.get(r.id, []), r] for r, _ in [*damaged, *fill]}
                chunks, keys, runs = [], [], []
                for run in todo.values():
                    runs.append(list(range(len(chunks), len(chunks) + len(run))))
                    chunks += [self.kvmodel.chunk_ids(0, r.text) for r in run]
                    keys += [r.key for r in run]
                self.source.encode_and_store(chunks, keys, runs=runs)
        return {
            "checked": len(records),
            "ok": ok,
            "damaged": len(damaged),
            "missing": missing,
            "repaired": len(damaged) if repair else 0,
            "filled": len(fill),
            "damaged_chunks": [r.id for r, _ in damaged],
        }

    def info(self) -> dict[str, Any]:
        """Counts, bytes and the model fingerprint; the store's entries, and how many are orphans (no indexed
        chunk refers to them: `gc` removes them) or missing (indexed, not stored: recomputed when read); the stored
        bytes a token (`kv_bytes` over the tokens of the indexed chunks whose entries are stored) and the storage
        dtype entries are written in (None for a store that keeps no serialized entries); the weights answers decode
        over ("model", or "int8" / "int4" copies: `KVModel(decode_weights=...)`)."""
        with self._lock:
            live = {r.key for r in self.index.records.values()}
            index = self.index
        stored = set(self.store.keys())  # outside the lock: a long listing holds up no query
        nbytes = self.store.nbytes
        # each stored entry's tokens once (chunks that share an entry share its bytes); orphans' bytes count too
        stored_tokens = sum({r.key: r.n_tokens for r in index.records.values() if r.key in stored}.values())
        return {
            "path": str(self.path) if self.path else None,
            "documents": len(index.docs()),
            "chunks": len(index),
            "tokens": sum(r.n_tokens for r in index.records.values()),
            "kv_store": describe_store(self.store),
            "kv_store_at_ingest": self._ingested_into(),
            "kv_entries": len(stored),
            "kv_bytes": nbytes,
            "kv_bytes_per_token": round(nbytes / stored_tokens, 1) if stored_tokens else None,
            "storage_dtype": getattr(getattr(self.store, "back", self.store), "storage_dtype", None),
            "kv_orphans": len(stored - live),
            "kv_missing": len(live - stored),
            "kv_max_bytes": next((d.max_bytes for d in _disk_stores(self.store) if d.max_bytes), None),
            "kv_evictions": sum(d.evictions for d in _disk_stores(self.store)),
            "kv_refused": sum(getattr(s, "refused", 0) for s in _stores(self.store)),
            "store_hits": self.store.hits,
            "store_misses": self.store.misses,
            "model": asdict(self.kvmodel.fingerprint),
            "decode_weights": cpu.weights_read(self.kvmodel.model),  # what its answers decode over
            "fingerprint": self.kvmodel.fingerprint.digest,
            "embedder": self.embedder.source,
            "chunk_tokens": self.chunk_tokens,
            "overlap": self.overlap,
            "encoding": self.encoding,  # how ingestion encodes a document's chunks
            "chunks_in_context": sum(r.after > 0 for r in index.records.values()),  # encoded behind earlier chunks
            "namespace": self.namespace,
        }


def _stores(store: KVStore) -> list[KVStore]:
    """A store and, for a tier, every store inside it."""
    if isinstance(store, TieredStore):
        return [store, *_stores(store.front), *_stores(store.back)]
    return [store]


def _disk_stores(store: KVStore) -> list[DiskStore]:
    if isinstance(store, TieredStore):
        return _disk_stores(store.front) + _disk_stores(store.back)
    return [store] if isinstance(store, DiskStore) else []


def durable_store(store: KVStore) -> bool:
    """Whether entries written to `store` outlive this process or are shared (disk, Redis, a tier over either)."""
    if isinstance(store, TieredStore):
        return durable_store(store.front) or durable_store(store.back)
    return isinstance(store, SerializedStore)


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
