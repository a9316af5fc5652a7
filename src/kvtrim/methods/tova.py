"""TOVA, Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104).

Whenever a layer's cache holds more than `budget` entries, the current query's attention, **averaged over
all query heads of the layer**, scores every entry; the layer keeps the `budget` best. One retained set
per layer: every KV head keeps the same positions. During decoding the cache is one over the budget
after each append, so the single lowest entry leaves (possibly the new token itself, as in the official
`TOVACache.reduce`, which protects nothing).

Prompt: the official code applies the same rule after the prompt's forward with the attention row of the
prompt's **last** query (so a long prompt is cut to `budget` in one go); kvpress's TOVA press does the
same (and additionally protects the last token). Here the last query's row is recomputed from the
handed-over post-RoPE query (one `1 x n` product per head, float32); decode steps use the exact
probabilities that produced the layer's output. Every multi-token forward is treated like the prompt,
so a chunked prefill (`prefill_chunk_size=`) cuts the cache back to `budget` after each chunk with that
chunk's last query (block-wise TOVA).

Deviations (documented): ties go to the earlier entry (official `topk`: arbitrary); kept indices are
sorted by position (official: score order; attention is unaffected). GQA needs no choice: the mean over
all query heads is the paper's layer-wide score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.attention_scores import causal_attention, layer_scaling, require_queries
from kvtrim.methods.base import EvictionMethod, check, top_indices


# ---- pure tensor functions ----------------------------------------------------------------------
def tova_scores(last_row: torch.Tensor) -> torch.Tensor:
    """`(batch, q_heads, n)` attention of the current query -> `(batch, n)` mean over heads (float32)."""
    return last_row.float().mean(dim=1)


def tova_keep(scores: torch.Tensor, budget: int, kv_heads: int) -> torch.Tensor | None:
    """The layer-wide top `budget` of `scores` `(batch, n)`, as `(batch, kv_heads, budget)` sorted indices,
    or None when within budget."""
    if scores.shape[-1] <= budget:
        return None
    keep = top_indices(scores, budget)
    return keep[:, None, :].expand(-1, kv_heads, -1)


# ---- the method ---------------------------------------------------------------------------------
@dataclass
class TOVA(EvictionMethod):
    """TOVA: keep the `budget` entries the current query attends to most (mean over the layer's heads).

    Args:
        budget: entries kept per layer (the same positions in every KV head), >= 1.
    """

    name = "tova"
    summary = "current query's attention averaged over heads, one set per layer, step-wise (TOVA); needs kvtrim attention"
    needs_queries = True
    needs_attention = True

    budget: int | None = None

    def __post_init__(self):
        check(self.budget is not None, "TOVA needs budget=")
        check(self.budget >= 1, f"budget must be >= 1, got {self.budget}")


    def on_attention(self, layer, queries, attention):
        queries = require_queries(queries, "TOVA")
        keys = layer.keys
        if keys.shape[2] <= self.budget:
            return None
        if attention is not None:
            row = attention[:, :, -1]  # (b, q_heads, n)
        else:
            probs = causal_attention(queries[:, :, -1:], keys, layer_scaling(layer, queries))  # (b, hkv, g, 1, n)
            row = probs.flatten(1, 3)
        return tova_keep(tova_scores(row), self.budget, keys.shape[1])
