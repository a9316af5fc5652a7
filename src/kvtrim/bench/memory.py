"""Peak memory of a block of work, measured as honestly as the platform allows.

* CUDA: `torch.cuda.max_memory_allocated()` minus what was allocated when the block started (the
  caching allocator's own view: tensors, not the reserved pool).
* CPU (Linux): the kernel's high-water mark of the resident set. Before the block the Python garbage
  is collected, glibc is asked to hand freed heap back (`malloc_trim`), and the high-water mark is
  reset to the current RSS (`/proc/self/clear_refs` <- "5"); after it, `VmHWM - RSS at start` is the
  most memory the block added at any instant, torch's allocations included. `tracemalloc` is not used:
  it sees only Python's allocator, not torch's.
* CPU elsewhere (no `clear_refs`): a sampling thread reads the RSS every `interval_s` (a short peak
  between two samples can be missed; `kind` says "rss-sampled").
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from dataclasses import dataclass

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes (0 if unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        kib = _status_kib("VmRSS")
        return 0 if kib is None else kib * 1024


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class PeakReading:
    peak_bytes: int  # most memory added above the start at any instant
    kind: str  # "cuda", "rss-hwm" or "rss-sampled"
    start_bytes: int = 0  # memory in use when the block started (allocated on CUDA, RSS on CPU)


class PeakMemory:
    """Context manager: `with PeakMemory(device) as m: ...; m.reading.peak_bytes`.

    Blocks must not nest (each start resets the high-water mark); measure consecutive blocks and
    combine them with `start_bytes`."""

    def __init__(self, device: str | torch.device = "cpu", interval_s: float = 0.002, collect: bool = True):
        self.device = torch.device(device)
        self.collect = collect  # run Python's garbage collector first (slow unless gc.freeze() was called)
        self.interval_s = interval_s
        self.reading: PeakReading | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled_peak = 0

    def __enter__(self) -> PeakMemory:
        if self.collect:
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._kind = "cuda"
            return self
        _trim_heap()
        self._start = current_rss()
        if _reset_high_water():
            self._kind = "rss-hwm"
        else:
            self._kind = "rss-sampled"
            self._sampled_peak = self._start
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sampled_peak = max(self._sampled_peak, current_rss())

    def __exit__(self, *exc) -> None:
        if self._kind == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._kind == "rss-hwm":
            peak = (_status_kib("VmHWM") or 0) * 1024
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._sampled_peak, current_rss())
        self.reading = PeakReading(max(0, peak - self._start), self._kind, self._start)
