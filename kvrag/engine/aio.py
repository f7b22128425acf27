"""The async bridge: blocking engine calls run in a worker thread while the event loop keeps running.

Nothing here knows what it runs; the engine's `a*` methods and the adapters' async paths use it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")


async def to_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a worker thread."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def in_thread(make: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """Run a blocking iterator in a worker thread; its items arrive on the event loop as they come.

    Closing the async iterator early (a `break`, `aclose()`, a cancelled task) stops the worker after the item
    it is producing and closes the blocking iterator, so its forwards end and its resources are released.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()
    stop = threading.Event()

    def hand(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            stop.set()

    def run() -> None:
        items: Any = None
        try:
            items = make()
            for item in items:
                if stop.is_set():
                    break
                hand(item)
                if stop.is_set():
                    break
        except BaseException as err:  # handed to the awaiting side
            hand(err)
        finally:
            try:
                close = getattr(items, "close", None)
                if close is not None:
                    close()  # a generator's finally runs here, in its own thread
            finally:
                hand(done)

    worker = loop.run_in_executor(None, run)
    try:
        while True:
            item = await queue.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
    await worker
