"""CPU tensors on transparent huge pages (2 MB), for the memory a decode step streams: its weights.

A decode step reads every weight once, front to back, and on CPU its time is the time the memory takes to
deliver them. From ordinary 4 KB pages every 4 KB of the stream needs its own translation, and the cores'
prefetchers, which follow a stream within a page, start over at each. `kvrag bench-decode` times the C step
over the decoder's weights and over a copy on small pages in the same rounds (`kvrag_small_pages`): in bfloat16
at 4,184 cached tokens 12.9 against 14.5 and 12.9 against 13.8 ms a token in two runs; at 1,095, 10.3 against
10.3 and 10.9 against 10.8 (docs/performance.md, "Weights on huge pages").

Linux gives an anonymous mapping huge pages where the process asks for them (`madvise(MADV_HUGEPAGE)`, the
default policy "madvise") or everywhere (policy "always"); elsewhere, or where the policy is "never", `empty`
is `torch.empty`. Huge pages are a request, not a promise: the kernel falls back to small pages when it has no
free 2 MB page, and the tensor is the same either way.
"""

from __future__ import annotations

import math
import mmap
import sys
from pathlib import Path
from typing import Sequence

import torch

HUGE = 1 << 21  # bytes of a transparent huge page on x86-64 and arm64 (4 KB base pages)
POLICY = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this process can ask for huge pages: Linux, with transparent huge pages not turned off."""
    if sys.platform != "linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in POLICY.read_text()
    except OSError:
        return False


_AVAILABLE = available()


def empty(shape: Sequence[int], dtype: torch.dtype, *, huge: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory starts on a 2 MB boundary and is asked for in huge pages
    (`torch.empty` where huge pages are not available, or for less than one huge page). With `huge=False` its
    memory is kept on small pages whatever the system's policy (what `kvrag bench-decode` compares with). Its
    memory is freed with the last tensor that views it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not _AVAILABLE or nbytes < HUGE:
        return torch.empty(shape, dtype=dtype)
    try:  # private, so that the pages are this process's anonymous memory (shared ones are shmem's to page)
        region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    try:
        region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    except OSError:
        pass  # small pages: the same tensor, only slower to stream
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` (and its mapping) while any view lives
    start = -raw.data_ptr() % HUGE  # the head before the boundary is never touched, so never backed
    return raw[start : start + nbytes].view(dtype).view(shape)
