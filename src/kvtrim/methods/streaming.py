"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.base import Schedule, ScoringMethod, check, span


def streaming_keep(n: int, sink_size: int, n_keep: int, like: torch.Tensor) -> torch.Tensor | None:
    """Indices `(batch, kv_heads, n_keep)` of the first `sink_size` and the last `n_keep - sink_size`
    of `n` entries, or None when nothing has to go. `like`: any `(batch, kv_heads, ...)` tensor."""
    if n <= n_keep:
        return None
    return torch.cat([span(0, sink_size, like), span(n - (n_keep - sink_size), n, like)], dim=-1)


@dataclass(kw_only=True)
class StreamingLLM(ScoringMethod):
    """Keep the first `sink_size` entries ("attention sinks") and the most recent ones.

    Exactly one of:
        budget: entries kept per KV head per layer; evicts at every forward once the cache exceeds it
            (prompt blocks, appends and decode steps), as the paper's rolling cache does.
        compression_ratio: fraction removed once, when the prompt ends, kvpress style; keeps
            `kept_count(n, compression_ratio)` entries; later tokens are appended without eviction.

    The score is recency (the stored order is the position order, except in in-place decode steps:
    `evicted_slot` reads the positions); the selection is written directly (sinks + the last entries)
    instead of a sort. At least one recent entry is always kept (with a
    ratio leaving no more than `sink_size` entries, fewer sinks are kept).

    Deviation from the paper: kept keys retain their original RoPE positions (the paper re-assigns
    positions inside the rolling cache). kvpress does the same unless wrapped in `KeyRerotationPress`.
    """

    name = "streaming"
    summary = "attention sinks + most recent tokens (StreamingLLM)"
    in_place_decode = True
    positions_only = True
    reads_values = False

    sink_size: int = 4

    def __post_init__(self):
        super().__post_init__()
        check(self.sink_size >= 0, f"sink_size must be >= 0, got {self.sink_size}")
        if self.budget is not None:
            check(self.budget > self.sink_size, f"budget ({self.budget}) must exceed sink_size ({self.sink_size})")

    def schedule(self):
        if self.budget is None:
            return Schedule()
        return Schedule(prefill="block", append=True, decode_slack=1)

    def layers_alike(self):
        return True

    def score(self, view):
        return view.positions  # recency (select below needs no sort)

    def sinks(self, n_keep: int) -> int:
        """Sinks kept with `n_keep` entries: `sink_size`, but at least one recent entry stays."""
        return min(self.sink_size, n_keep - 1)

    def select(self, view, scores, n_keep):
        return streaming_keep(view.stored, self.sinks(n_keep), n_keep, view.keys)

    def evicted_slot(self, view, scores, n_keep):
        # the entry streaming_keep drops: the first one after the sinks, by position
        return view.positions.kthvalue(self.sinks(n_keep) + 1, dim=-1).indices
