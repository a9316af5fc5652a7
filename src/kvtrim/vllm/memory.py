"""The worker gives the heap memory it freed back to the system (glibc's `malloc_trim`), now and then.

A compaction allocates and frees tensors of many sizes at every step (positions, scores, gathers, a step's
probabilities); glibc's malloc keeps what was freed for reuse, fragmented, and the worker's resident memory grows
under a long mixed load although what it holds stays the same (the chaos load: +525 MB in 11 minutes, given back by
one `malloc_trim(0)` called into the running worker). The worker calls it when it goes idle and at most every
`every_s` seconds of a busy worker (each call costs a few milliseconds). Where the C library has no `malloc_trim`
(not glibc) nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """`trim(idle)`: `malloc_trim(0)` when the worker went idle, or `every_s` seconds after the last one."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self._trim = _malloc_trim()
        self._last = time.monotonic()

    def trim(self, idle: bool = False) -> float:
        """Trim if due; returns the seconds it took (0.0 when not due or not available)."""
        now = time.monotonic()
        if self._trim is None or not (idle or now - self._last >= self.every_s):
            return 0.0
        self._trim(0)
        self._last = time.monotonic()
        return self._last - now
