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

`TensorPeak` measures tensors only, on both devices alike: on CUDA as above, on the CPU from torch's own
allocation records (the profiler's memory events: every CPU tensor allocated and freed inside the block,
in time order; `kind` "cpu-tensors"). The resident set also counts the allocator's retained pages and
Python's objects; tensors are what a method's scratch and its cache are made of, and what CUDA reports.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
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


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null for the block (C++ code writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class TensorPeak:
    """Context manager: the most tensor memory a block adds above what it starts with, on CPU or CUDA.
    `with TensorPeak(device) as m: ...; m.reading.peak_bytes`. On the CPU it runs torch's profiler with
    memory recording for the block (a few % slower: not for timed blocks)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.reading: PeakReading | None = None
        self._cuda = PeakMemory(self.device) if self.device.type == "cuda" else None  # CUDA counts tensors itself
        self._profiler = None

    def __enter__(self) -> TensorPeak:
        if self._cuda is not None:
            self._cuda.__enter__()
            return self
        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _stderr_silenced():  # the profiler's tracing backend prints a line at start and stop
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda is not None:
            self._cuda.__exit__(*exc)
            self.reading = self._cuda.reading
            return
        with _stderr_silenced():
            self._profiler.__exit__(*exc)
        if exc[0] is not None:
            return
        self.reading = PeakReading(peak_of(self._profiler.profiler.kineto_results.events()), "cpu-tensors", 0)


def peak_of(events) -> int:
    """The highest running sum of the CPU memory events (`[memory]`, bytes allocated > 0, freed < 0) taken in
    time order: the most tensor memory held above the start at any instant. Frees of tensors allocated
    before the start are not recorded by torch (they would have made room): measure blocks that create
    what they free (a fresh cache), as the benchmark's path measurements do."""
    changes = sorted((e.start_ns(), e.nbytes()) for e in events
                     if e.name() == "[memory]" and e.device_type().name == "CPU")
    held = peak = 0
    for _, nbytes in changes:
        held += nbytes
        peak = max(peak, held)
    return peak
