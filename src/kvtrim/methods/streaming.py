"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.base import EvictionMethod, check, check_compression_ratio, span


def streaming_keep(n: int, sink_size: int, n_keep: int, like: torch.Tensor) -> torch.Tensor | None:
    """Indices `(batch, kv_heads, n_keep)` of the first `sink_size` and the last `n_keep - sink_size`
    of `n` entries, or None when nothing has to go. `like`: any `(batch, kv_heads, ...)` tensor."""
    if n <= n_keep:
        return None
    return torch.cat([span(0, sink_size, like), span(n - (n_keep - sink_size), n, like)], dim=-1)


@dataclass
class StreamingLLM(EvictionMethod):
    """Keep the first `sink_size` entries ("attention sinks") and the most recent ones.

    Exactly one of:
        budget: entries kept per KV head per layer; evicts at every step once the cache exceeds it
            (prefill and decoding), as the paper's rolling cache does.
        compression_ratio: fraction removed once, after the first forward (the prefill), kvpress style;
            keeps `int(n * (1 - compression_ratio))` entries; later tokens are appended without eviction.

    Deviation from the paper: kept keys retain their original RoPE positions (the paper re-assigns
    positions inside the rolling cache). kvpress does the same unless wrapped in `KeyRerotationPress`.
    """

    name = "streaming"
    summary = "attention sinks + most recent tokens (StreamingLLM)"

    sink_size: int = 4
    budget: int | None = None
    compression_ratio: float | None = None

    def __post_init__(self):
        check(self.sink_size >= 0, f"sink_size must be >= 0, got {self.sink_size}")
        check(
            (self.budget is None) != (self.compression_ratio is None),
            "StreamingLLM needs exactly one of budget= or compression_ratio=",
        )
        if self.budget is not None:
            check(self.budget > self.sink_size, f"budget ({self.budget}) must exceed sink_size ({self.sink_size})")
        else:
            check_compression_ratio(self.compression_ratio)


    def on_update(self, layer, n_new):
        n = layer.stored
        if self.budget is not None:
            return streaming_keep(n, self.sink_size, self.budget, layer.keys)
        if layer.seen != n_new:  # ratio mode acts on the prefill only
            return None
        n_keep = max(int(n * (1 - self.compression_ratio)), min(n, self.sink_size + 1))
        return streaming_keep(n, min(self.sink_size, n_keep - 1), n_keep, layer.keys)
