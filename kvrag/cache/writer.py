"""Chunk KV written to a store behind the encoding: one thread, a bounded queue, failures raised where it is fed.

`StoreWriter` takes each encoding forward's (key, KV) pairs and puts them in the store on its own thread, so their
serialization, checksum and disk write overlap the next forward (torch ops and kvrag's C kernels let go of the GIL).
At most `queued` forwards' KV wait, so memory holds a bounded number of forwards' KV however many chunks. A write
that fails is raised in the feeding thread at its next `put` or at the end; nothing is written after it. It never
encodes and never decides what is stored.
"""

from __future__ import annotations

import queue
import threading
from types import TracebackType
from typing import Sequence

from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import KVStore

_POLL_S = 0.05  # how often a blocked feeder looks whether the writer has failed (a dead writer drains nothing)
_END = None  # what `close` queues: no more writes


class StoreWriter:
    """Writes groups of (key, KV) to `store` on a thread of its own; a context manager.

    Leaving the `with` block normally waits for every write and raises the first failure; leaving it by an
    exception (an interrupt, a caller stopping the ingest) drops the groups still waiting and does not wait for
    the one being written.

    Args:
        store: where the KV goes (`store.put`).
        queued: groups that may wait to be written while the feeder encodes the next (at least 1).
    """

    def __init__(self, store: KVStore, *, queued: int = 1) -> None:
        self.store = store
        self._queue: queue.Queue[list[tuple[str, ChunkKV]] | None] = queue.Queue(maxsize=max(queued, 1))
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        # a daemon: an interrupted process exits without waiting for a write (a killed writer's temporary file is
        # what `gc` sweeps); the entries themselves are written whole or not at all by the store
        self._thread = threading.Thread(target=self._run, name="kvrag-store-writer", daemon=True)
        self._thread.start()

    def put(self, items: Sequence[tuple[str, ChunkKV]]) -> None:
        """Queue one group's writes; blocks while `queued` groups wait. Raises a failed write's error."""
        self._hand(list(items))

    def close(self) -> None:
        """Wait for every queued write; raise the first failure."""
        self._hand(_END)
        self._thread.join()
        self._raise()

    def abandon(self) -> None:
        """Stop after the write under way, dropping what waits; returns at once."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put_nowait(_END)  # wakes a writer waiting for work
        except queue.Full:
            pass

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()

    def _hand(self, items: list[tuple[str, ChunkKV]] | None) -> None:
        while True:
            self._raise()
            try:
                self._queue.put(items, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _raise(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        while not self._stop.is_set():
            items = self._queue.get()
            if items is _END:
                return
            try:
                for key, kv in items:
                    if self._stop.is_set():
                        return
                    self.store.put(key, kv)
            except BaseException as err:  # raised in the feeding thread; nothing after it is written
                self._failure = err
                self._stop.set()
                return
