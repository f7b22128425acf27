"""The async bridge: blocking engine calls run in a worker thread while the event loop keeps running.

Nothing here knows what it runs; the engine's `a*` methods and the adapters' async paths use it.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")


async def to_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a worker thread."""
    return await asyncio.to_thread(fn, *args, **kwargs)


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
