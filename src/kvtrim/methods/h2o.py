"""H2O, Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048), decode-time and step-wise.

Every entry carries its accumulated attention: the sum, over every query that has attended to it, of the
attention probability it received. Whenever the cache holds more than `heavy_budget + recent_budget`
entries, each KV head keeps the `recent_budget` most recent entries plus the `heavy_budget` entries with
the largest accumulated attention among the others. During decoding the cache is one over the budget
after each append, so exactly one entry leaves per step; after a prompt longer than the budget, the same
rule cuts it back in one go. This is the official "real drop" implementation's rule
(`H2OKVCache_LayerWise`): prompt attention is accumulated too, then every decode step adds its row.

Where the probabilities come from:
* decode steps: the exact probabilities that produced the layer's output (kvtrim's attention function);
* prompt (multi-token) forwards: the full `n x n` attention is never materialised; the column sums are
  recomputed from the handed-over post-RoPE queries in blocks of `prefill_block` query rows (float32,
  causal), so the extra memory is `prefill_block x n` per head. The sums are exact (each row's softmax is
  independent of the others); the cost is a second prompt attention pass, paid once.
  Starting at the first decode step instead would leave every prompt entry at score 0, making the first
  cut arbitrary - the paper's method ranks prompt tokens by their prompt attention.
  A chunked prefill (`prefill_chunk_size=`) accumulates each chunk's attention over the retained cache
  plus the chunk and cuts after every chunk (block-wise H2O); a one-shot prefill is the paper's setting.

Deviations (documented):
* GQA: the paper's models have one KV head per query head. Here an entry's score is the **sum** over the
  query heads of its KV head's group (one selection per KV head, so memory is freed); with group size 1
  this is the paper's per-head score.
* Batches: each sequence keeps its own scores (the official code sums scores over the batch).
* Ties go to the earlier entry (the official `topk` breaks them arbitrarily).
* kvpress's `ObservedAttentionPress`/H2O is a prefill-only approximation; this is the decode-time method.

Budget forms: `heavy_budget` + `recent_budget` (paper), or `budget=` split half/half (heavy gets the
smaller half), or `compression_ratio=` (the budget is `int(n * (1 - compression_ratio))` of the first
forward, the prompt, then split the same way and kept fixed while decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.attention_scores import causal_attention, grouped, layer_scaling, require_queries
from kvtrim.methods.base import EvictionMethod, check, check_compression_ratio, span, top_indices


# ---- pure tensor functions ----------------------------------------------------------------------
def prompt_attention_sums(queries: torch.Tensor, keys: torch.Tensor, scaling: float, block: int = 256) -> torch.Tensor:
    """Column sums of the causal attention of the last `q_len` positions, per KV head (summed over its group).

    Args:
        queries: `(batch, q_heads, q_len, head_dim)`, the last `q_len` of the `n` positions of `keys`.
        keys: `(batch, kv_heads, n, head_dim)`.
        block: query rows per step (bounds the extra memory to `block x n` per head).
    Returns:
        `(batch, kv_heads, n)` float32.
    """
    b, h, q, _ = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    total = torch.zeros(b, hkv, n, dtype=torch.float32, device=keys.device)
    for start in range(0, q, block):
        stop = min(q, start + block)
        # rows start..stop sit at positions n - q + start ..; keys beyond the block's last row are masked anyway
        visible = n - q + stop
        probs = causal_attention(queries[:, :, start:stop], keys[:, :, :visible], scaling)
        total[:, :, :visible] += probs.sum(dim=(2, 3))
    return total


def decode_attention_sums(attention: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(batch, q_heads, q_len, n)` probabilities -> `(batch, kv_heads, n)` float32 sums over queries and group."""
    return grouped(attention.float(), kv_heads).sum(dim=(2, 3))


def h2o_keep(scores: torch.Tensor, heavy_budget: int, recent_budget: int) -> torch.Tensor | None:
    """Heavy hitters among the older entries plus the `recent_budget` newest, or None when within budget.

    Args:
        scores: `(batch, kv_heads, n)` accumulated attention.
    Returns:
        `(batch, kv_heads, heavy_budget + recent_budget)` indices sorted ascending, or None.
    """
    n = scores.shape[-1]
    if n <= heavy_budget + recent_budget:
        return None
    heavy = top_indices(scores[..., : n - recent_budget], heavy_budget)
    return torch.cat([heavy, span(n - recent_budget, n, scores)], dim=-1)


def split_budget(budget: int) -> tuple[int, int]:
    """`budget` -> `(heavy, recent)`, half each (the recent window gets the odd entry)."""
    return budget // 2, budget - budget // 2


# ---- the method ---------------------------------------------------------------------------------
@dataclass
class _H2OState:
    scores: torch.Tensor | None = None  # (batch, kv_heads, n_stored) accumulated attention, float32
    heavy: int | None = None  # budgets fixed at the first forward (compression_ratio mode)
    recent: int | None = None


@dataclass
class H2O(EvictionMethod):
    """H2O: accumulated-attention heavy hitters plus a recent window, evicting one entry per decode step.

    Exactly one form:
        heavy_budget, recent_budget: entries kept per KV head per layer (both given; heavy >= 0, recent >= 1).
        budget: total, split half/half.
        compression_ratio: fraction of the prompt removed, in [0, 1); the budget it gives stays fixed.
    Args:
        prefill_block: query rows per block when recomputing the prompt's attention sums.
    """

    name = "h2o"
    summary = "accumulated attention (heavy hitters) + recent window, step-wise at decode (H2O); needs kvtrim attention"
    needs_queries = True
    needs_attention = True

    heavy_budget: int | None = None
    recent_budget: int | None = None
    budget: int | None = None
    compression_ratio: float | None = None
    prefill_block: int = 256

    def __post_init__(self):
        forms = [self.heavy_budget is not None or self.recent_budget is not None, self.budget is not None,
                 self.compression_ratio is not None]
        check(sum(forms) == 1, "H2O needs exactly one of heavy_budget= + recent_budget=, budget= or compression_ratio=")
        if forms[0]:
            check(
                self.heavy_budget is not None and self.recent_budget is not None,
                "H2O needs both heavy_budget= and recent_budget=",
            )
            check(self.heavy_budget >= 0, f"heavy_budget must be >= 0, got {self.heavy_budget}")
            check(self.recent_budget >= 1, f"recent_budget must be >= 1, got {self.recent_budget}")
        elif forms[1]:
            check(self.budget >= 2, f"budget must be >= 2, got {self.budget}")
        else:
            check_compression_ratio(self.compression_ratio)
        check(self.prefill_block >= 1, f"prefill_block must be >= 1, got {self.prefill_block}")


    def budgets(self, prompt_length: int | None = None) -> tuple[int, int]:
        """`(heavy, recent)` entries per KV head (`prompt_length` needed in compression_ratio mode)."""
        if self.heavy_budget is not None:
            return self.heavy_budget, self.recent_budget
        if self.budget is not None:
            return split_budget(self.budget)
        return split_budget(max(2, int(prompt_length * (1 - self.compression_ratio))))

    def new_state(self, layer_idx):
        return _H2OState()

    def on_attention(self, layer, queries, attention):
        queries = require_queries(queries, "H2O")
        state: _H2OState = layer.state
        keys = layer.keys
        b, hkv, n = keys.shape[0], keys.shape[1], keys.shape[2]
        if state.heavy is None:
            state.heavy, state.recent = self.budgets(n)
        old = 0 if state.scores is None else state.scores.shape[-1]
        grown = torch.zeros(b, hkv, n, dtype=torch.float32, device=keys.device)
        if state.scores is not None:
            grown[..., :old] = state.scores
        if attention is not None:
            grown += decode_attention_sums(attention, hkv)
        else:
            grown += prompt_attention_sums(queries, keys, layer_scaling(layer, queries), self.prefill_block)
        state.scores = grown
        return h2o_keep(grown, state.heavy, state.recent)

    def gather_state(self, state: _H2OState, keep):
        state.scores = state.scores.gather(-1, keep)
        return state
