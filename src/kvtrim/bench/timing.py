"""Opt-in timing of the eviction work inside a `TrimCache`: scoring (the method's hooks) and gather.

`EvictionTimer.instrument(method)` returns a copy of `method` whose hooks (`on_update`, `on_attention`,
`on_prompt_end`, and the cross-layer `select_layers`) are timed; `EvictionTimer.attach(cache)` times every `TrimLayer.evict` (the gather of keys, values,
positions and the method's state). Both wrap instance attributes of objects the benchmark built itself,
so nothing global is patched and a normal run (no timer) pays nothing.

What is timed, per phase ("prefill", "scoring": the method's own scoring passes, "decode"):
* `score`: the method's hooks, i.e. everything the method does to decide what to keep (for
  attention-based methods this includes recomputing window attention from the handed-over queries,
  but not the attention the model computes anyway);
* `gather`: building the smaller tensors from the kept indices (`TrimLayer.evict`).
The appends (`torch.cat` in `TrimLayer.update`) are not eviction work: a full cache does them too.

Clocks: on CPU `time.perf_counter` (or an injected clock, for tests); on CUDA a pair of CUDA events per
call, resolved after one synchronize in `totals()`, so timing adds no synchronisation to the run.

The timer also follows the KV entries held by all evicting layers at once (after each append, before
eviction: the copies made by `cat` and `gather` are not counted), which gives the analytic
simultaneous KV peak `live_peak_bytes`.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from typing import Callable

import torch

from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import EvictionMethod

PARTS = ("score", "gather")
PHASES = ("prefill", "scoring", "decode")


class EvictionTimer:
    """Accumulates eviction time per (phase, part). Set `phase` before each phase of a run.

    Args:
        device: "cpu" (wall clock) or a CUDA device (CUDA events).
        clock: a zero-argument function returning seconds (CPU only; default `time.perf_counter`).
    """

    def __init__(self, device: str | torch.device = "cpu", clock: Callable[[], float] | None = None):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda and clock is not None:
            raise ValueError("an injected clock is only supported on CPU")
        self.clock = clock or time.perf_counter
        self.phase = "prefill"
        self._seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._events: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.evictions: dict[str, int] = defaultdict(int)  # evict calls that removed entries
        self._layers: list[TrimLayer] = []
        self._held: dict[int, int] = {}  # id(layer) -> entries last seen
        self._held_total = 0
        self.live_peak_bytes = 0

    # ---- wrapping ----------------------------------------------------------------------------
    def _timed(self, part: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            phase = self.phase
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                result = fn(*args, **kwargs)
                end.record()
                self._events.append((phase, part, start, end))
            else:
                t0 = self.clock()
                result = fn(*args, **kwargs)
                self._seconds[(phase, part)] += self.clock() - t0
            self.calls[(phase, part)] += 1
            return result

        return wrapper

    def instrument(self, method: EvictionMethod) -> EvictionMethod:
        """A shallow copy of `method` whose hooks are timed as `score` (the original is untouched)."""
        timed = copy.copy(method)
        timed.on_update = self._timed("score", method.__class__.on_update.__get__(timed))
        timed.on_attention = self._timed("score", method.__class__.on_attention.__get__(timed))
        timed.on_prompt_end = self._timed("score", method.__class__.on_prompt_end.__get__(timed))
        timed.select_layers = self._timed("score", method.__class__.select_layers.__get__(timed))
        return timed

    def attach(self, cache: TrimCache) -> TrimCache:
        """Time the gather of every evicting layer of `cache` and follow the entries they hold."""
        for layer in cache.layers:
            if isinstance(layer, TrimLayer) and layer not in self._layers:
                self._layers.append(layer)
                layer.evict = self._tracked(layer, self._timed("gather", layer.evict))
        return cache

    def _tracked(self, layer: TrimLayer, evict: Callable) -> Callable:
        """Keep the running count of entries held by all layers (outside the timed region)."""

        def wrapper(keep):
            held = layer.ideal_bytes()  # the entries held (ragged layers: the sum of their rows)
            before = self._held.get(id(layer), 0)
            self._held_total += held - before
            self.live_peak_bytes = max(self.live_peak_bytes, self._held_total)
            evict(keep)
            if keep is not None:
                self.evictions[self.phase] += 1
            after = layer.ideal_bytes()
            self._held_total += after - held
            self._held[id(layer)] = after
            return None

        return wrapper

    def detach(self) -> None:
        """Remove the wrappers from the layers (they reference their layer: a cycle refcounting cannot free)."""
        for layer in self._layers:
            layer.__dict__.pop("evict", None)
        self._layers.clear()

    def wrapped_layers(self) -> int:
        return len(self._layers)

    # ---- results -----------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        """Seconds per `"{phase}_{part}"` and per `"{phase}_evict"` (score + gather)."""
        seconds = dict(self._seconds)
        if self._events:
            torch.cuda.synchronize()
            for phase, part, start, end in self._events:
                seconds[(phase, part)] = seconds.get((phase, part), 0.0) + start.elapsed_time(end) / 1000.0
        out: dict[str, float] = {}
        for phase in PHASES:
            total = 0.0
            for part in PARTS:
                value = seconds.get((phase, part), 0.0)
                out[f"{phase}_{part}_s"] = value
                total += value
            out[f"{phase}_evict_s"] = total
        return out
