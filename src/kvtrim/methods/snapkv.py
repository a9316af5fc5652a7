"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

After the prompt's forward pass, the last `window` prompt queries (the observation window) vote for the
earlier entries: `score_i = mean over window queries (and over the query heads of the KV head's GQA
group) of softmax(q K^T * scale)_i`, smoothed by a 1-D pooling (`max` or `avg`, odd `kernel`, stride 1,
zero/-inf padding `kernel // 2` as `max_pool1d` / `avg_pool1d` with `count_include_pad` do). Each KV
head keeps its top `budget - window` scored entries plus the window itself. Decoding appends without
eviction, as in the paper.

The window attention is recomputed from the queries kvtrim's attention function hands over (one small
`window x n` product per KV head, float32, causal inside the window), so the model runs SDPA.

Modes: `budget=` (entries per KV head; prompts of at most `budget` entries are left alone) or
`compression_ratio=` (once, when the prompt ends: keep `kept_count(n, compression_ratio)`, the window
shrinking to that number when it is smaller; kvpress convention).

Deviations and choices (documented):
* GQA: the official code predates GQA (it repeats K/V per query head); the score is averaged over the
  query heads of each group so that one selection per KV head frees memory (kvpress does the same).
* Ties (frequent after max pooling) go to the earlier entry; the official `topk` breaks them arbitrarily.
* Budget mode acts after *every* prompt block whose cache exceeds the budget, so a chunked prefill
  (`generate(..., prefill_chunk_size=)`) becomes block-wise SnapKV (each chunk's last queries score the
  retained cache plus the chunk); with a one-shot prefill this is exactly the paper's rule. `block_size=`
  names that block (an extension, not the paper's): `kvtrim.prefill`, `kvtrim.generate` and the vLLM
  engine read the prompt in blocks of it, so a layer never holds more than `budget + block_size` entries
  while the prompt is read. Appends
  after the prompt (a question, a new turn) and decode steps never evict. (Before the phase contract a
  multi-token question forward also re-selected with the question's queries, which let the question
  into a query-agnostic protocol; it no longer does.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtrim.methods.attention_scores import causal_attention
from kvtrim.methods.base import Schedule, ScoringMethod, check, span, top_indices


# ---- pure tensor functions ----------------------------------------------------------------------
def snapkv_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    window: int,
    kernel: int,
    pooling: str,
    scaling: float,
) -> torch.Tensor:
    """Pooled observation-window scores of the entries before the last `window` keys.

    Args:
        queries: `(batch, q_heads, q_len, head_dim)`, the queries of the last `q_len` positions; the last
            `min(window, q_len)` of them form the observation window.
        keys: `(batch, kv_heads, n, head_dim)`, n > window.
    Returns:
        `(batch, kv_heads, n - window)` float32 scores (higher = keep).
    """
    obs = queries[:, :, -min(window, queries.shape[2]):]
    probs = causal_attention(obs, keys, scaling)  # (b, hkv, group, w, n)
    n = keys.shape[2]
    scores = probs[..., : n - window].mean(dim=(2, 3))  # (b, hkv, n - window)
    b, h, m = scores.shape
    flat = scores.reshape(b * h, 1, m)
    if pooling == "max":
        flat = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        flat = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return flat.view(b, h, m)


def snapkv_keep(scores: torch.Tensor, n: int, window: int, n_keep: int) -> torch.Tensor:
    """Top `n_keep - window` of `scores` `(batch, kv_heads, n - window)` plus the last `window` of `n`
    entries: indices `(batch, kv_heads, n_keep)` sorted ascending."""
    return torch.cat([top_indices(scores, n_keep - window), span(n - window, n, scores)], dim=-1)


# ---- the method ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SnapKV(ScoringMethod):
    """SnapKV: prompt compression by the observation window's pooled attention.

    Args:
        window: observation window (last prompt queries; those entries are always kept), >= 1.
        kernel: pooling kernel, odd, >= 1 (1 = no pooling).
        pooling: "max" or "avg".
        budget: entries kept per KV head per layer after the prompt (>= window).
        block_size: with `budget=`, the prompt block (default None: the prompt in one forward, the paper's
            rule); each block's last `window` queries score what the earlier blocks kept plus the block.
        compression_ratio: alternatively, the fraction of the prompt removed, in [0, 1).
    """

    name = "snapkv"
    summary = "observation-window attention, pooled, once after the prompt (SnapKV); needs kvtrim attention"
    needs_queries = True
    reads_values = False
    counts_ignore_attention = True  # its queries pick which entries, the schedule how many

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    block_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check(self.window >= 1, f"window must be >= 1, got {self.window}")
        check(self.kernel >= 1 and self.kernel % 2 == 1, f"kernel must be an odd integer >= 1, got {self.kernel}")
        check(self.pooling in ("max", "avg"), f"pooling must be 'max' or 'avg', got '{self.pooling}'")
        if self.budget is not None:
            check(self.budget >= self.window, f"budget ({self.budget}) must be >= window ({self.window})")
        if self.block_size is not None:
            check(self.budget is not None, "SnapKV: block_size= needs budget= (a ratio's budget is known only when "
                                           "the prompt ends)")
            check(self.block_size >= 1, f"SnapKV: block_size must be >= 1, got {self.block_size}")

    def schedule(self):
        return Schedule(prefill="block", block_size=self.block_size) if self.budget is not None else Schedule()

    def prompt_queries(self):
        return self.window

    def score(self, view):
        queries = view.require_queries("SnapKV")
        window = min(self.window, view.stored - 1)
        pooled = snapkv_scores(queries, view.keys, window, self.kernel, self.pooling, view.softmax_scale())
        return F.pad(pooled, (0, window))  # the window itself is protected

    def protected(self, view, n_keep):
        # ratio mode: a budget below the window keeps the last `n_keep` entries (the window shrinks)
        return 0, min(self.window, n_keep)
