"""KNorm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
arXiv 2406.11430): keys with a *low* L2 norm attract high attention, so the highest-norm keys go first.

The proof that a ranking method is a few lines on `ScoringMethod`: it only defines `score`; sizes
(`budget=` / `compression_ratio=`), schedule, rounding and tie-stable top-k are the base's. Like kvpress's
`KnormPress` it compresses the prompt (once at its end with a ratio; every prompt block over a budget).
Keys are scored post-RoPE as stored (RoPE is a rotation: it does not change the norm).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim.methods.base import ScoringMethod


@dataclass(kw_only=True)
class KNorm(ScoringMethod):
    """Keep the keys with the lowest L2 norm. Exactly one of `budget=` or `compression_ratio=`."""

    name = "knorm"
    summary = "keep the keys with the lowest L2 norm (KNorm); attention-free"
    reads_values = False

    def layers_alike(self):
        return True

    def score(self, view):
        return -view.keys.float().norm(dim=-1)
