"""The full-cache baseline: keeps every entry (what `DynamicCache` does)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim.methods.base import EvictionMethod


@dataclass(kw_only=True)
class FullCache(EvictionMethod):
    """Keep everything. With it, `TrimCache` gives bit-identical results to `DynamicCache`."""

    name = "full"
    summary = "no eviction (the full-cache baseline)"

    @classmethod
    def at_budget(cls, budget, context_length, **params):
        return cls(**params)
