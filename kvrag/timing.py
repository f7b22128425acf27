"""Phase timing inside the real code path: where one request's time to first token goes.

Opt-in: the code that runs a request takes an optional `Phases` and times its own steps with it (store
load, re-positioning, cache assembly and mask, forward, first token); without one nothing is measured.
On CUDA each phase synchronizes the device at its edges, so queued kernels are charged to the phase that
launched them. This module never decides anything.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class Phases:
    """Seconds spent in named phases, summed over every time a phase is entered.

    Args:
        device: the device the work runs on; a CUDA device is synchronized at each phase's edges.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.seconds: dict[str, float] = {}
        self._cuda = torch.device(device).type == "cuda"

    def sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def phase(phases: Phases | None, name: str) -> contextlib.AbstractContextManager[None]:
    """`phases(name)`, or nothing when no timing was asked for."""
    return phases(name) if phases is not None else contextlib.nullcontext()
