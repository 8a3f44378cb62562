"""(process) Keep freed memory in the process under glibc, so big step tensors are not page-faulted back in.

torch's CPU allocator takes every tensor from malloc. glibc serves blocks above its mmap threshold
with fresh mmap()s and unmaps them on free, so each prompt step's activations (megabytes per
layer) were zero-filled by the kernel page by page on every step: ~25% of a bf16 prompt step.
Raising the mmap and trim thresholds makes malloc reuse those blocks from its heap instead. The
cost is that the process's RSS stays at its high-water mark instead of shrinking after a peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process (glibc only); True where they are in effect."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
