"""KeyDiff (Park et al., arXiv 2504.15364): attention-free eviction by key diversity.

Keys that point away from the "typical" key tend to receive high attention, so the most typical keys
go first. Per layer and KV head, over the candidates (the retained cache plus the new entries):

    anchor  = mean_i( k_i / ||k_i|| )
    score_i = -cos(k_i, anchor)          # higher = more distinctive = keep

and the `budget` highest-scoring entries are kept. Ranking by this anchor cosine is the same as
ranking by the mean pairwise cosine `sum_j cos(k_i, k_j)` (both are `khat_i . anchor` up to a positive
factor), so nothing is approximated beyond the paper's relaxation of the subset objective.

Budget mode (`budget=`, the paper's setting): the cache holds at most `budget + block_size` entries
per KV head and layer, whatever the prompt length.

* Every prompt block (`Phase.PREFILL`) and every append after the prompt (`Phase.APPEND`: a question,
  a new turn) evicts back to `budget` as soon as the stored cache exceeds it. Fed block by block
  (`kvtrim.prefill(model, ids, cache)`, or `model.generate(..., prefill_chunk_size=block_size)`), each
  block attends only to what earlier blocks retained plus itself, and the cache never holds more than
  `budget + block_size` entries: this is the paper's block-wise prompt processing, done for real
  (kvpress's `BlockPress` only replays the selection after a full-attention prefill).
* Decoding appends until the cache reaches `budget + block_size`, then evicts back to `budget`
  (the top-k cost is paid once per `block_size` generated tokens). Under stock `generate` the cache
  cannot tell a one-token last prompt chunk from a decode step (it becomes one); `kvtrim.prefill`
  declares its blocks, so there a one-token block is a prompt block.
* "Attend, then evict": the step that triggers an eviction still attends to every candidate.

Ratio mode (`compression_ratio=`, kvpress's `KeyDiffPress` without `BlockPress`): once, when the prompt
ends (one-shot or chunked), keep `kept_count(n, compression_ratio)` of its `n` entries; later tokens
(appends, decoding) are kept.

Choices and deviations (documented):
* Keys are scored post-RoPE, as stored in the cache and as kvpress does; whether the paper scores
  pre- or post-RoPE keys is not verified.
* Scores are computed in float32; ties go to the older entry; kept indices are sorted by position
  (kvpress keeps `topk`'s arbitrary choice among ties and its order).
* `sink_size` / `recent_size` (default 0, as in the paper and kvpress) protect the first and the most
  recent entries; protected entries still count in the anchor and in the budget. They stand in for
  the paper's sliding-window extension, whose details are not verified.
* Decoding cadence (grow to `budget + block_size`, evict back to `budget`) is our choice: the paper's
  decode-time schedule is not verified (kvpress's `DecodingPress` compresses every 512 steps).
* Padded batches are not supported (TrimCache refuses them), so no padding slot enters the anchor.
* Under the contract's base (`ScoringMethod`): sizes, schedule, protection and top-k are shared code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.base import Schedule, ScoringMethod, check, keep_top


# ---- pure tensor functions ----------------------------------------------------------------------
def keydiff_scores(keys: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """KeyDiff scores `-cos(k_i, anchor)`, anchor = mean of the L2-normalised keys.

    Args:
        keys: `(batch, kv_heads, n, head_dim)`, the candidate set (the anchor is taken over all of it).
    Returns:
        `(batch, kv_heads, n)` float32 scores (higher = more distinctive = keep).

    Written for few operations (on CPU an eviction costs per operation more than per byte): the
    negation rides on the anchor's normalisation (`a / -|a|` is exactly `-(a / |a|)`) and the products
    are taken in place, so the scores are the same bits as `-(unit * anchor).sum(-1)`, with the
    anchor and the cosines summed in the same order.
    """
    k = keys if keys.dtype == torch.float32 else keys.float()
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min_(eps)
    anchor = unit.mean(dim=-2, keepdim=True)
    anchor = anchor.div_(anchor.norm(dim=-1, keepdim=True).clamp_min_(eps).neg_())  # -anchor / |anchor|
    return unit.mul_(anchor).sum(dim=-1)


def keydiff_keep(
    keys: torch.Tensor, n_keep: int, sink_size: int = 0, recent_size: int = 0, eps: float = 1e-12
) -> torch.Tensor | None:
    """Indices `(batch, kv_heads, n_keep)` of the entries KeyDiff keeps, sorted ascending, or None when
    all `n` entries fit. The first `sink_size` and last `recent_size` entries are kept first (when
    they alone exceed `n_keep`, the earliest of them win); ties go to the older entry.

    Args:
        keys: `(batch, kv_heads, n, head_dim)`.
    """
    if keys.shape[-2] <= n_keep:
        return None
    return keep_top(keydiff_scores(keys, eps), n_keep, sink_size, recent_size)  # ties -> older entry


# ---- the method ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class KeyDiff(ScoringMethod):
    """KeyDiff eviction. Exactly one of `budget=` (block-wise, the paper) or `compression_ratio=`.

    Args:
        budget: entries kept per KV head per layer after each eviction (N).
        block_size: prefill block length (B, 128 as in kvpress's `BlockPress`) and decode slack: the
            cache never exceeds `budget + block_size` when the prompt is fed in blocks of at most
            `block_size` tokens. `kvtrim.prefill` and `kvtrim.generate` use it as their chunk size.
        compression_ratio: one-shot mode: fraction of the prompt removed, in [0, 1).
        sink_size: first entries never evicted (0 in the paper).
        recent_size: most recent entries never evicted (0 in the paper).
    """

    name = "keydiff"
    summary = "key diversity: evict keys most similar to the mean key; attention-free, block-wise (KeyDiff)"
    reads_values = False

    block_size: int = 128
    sink_size: int = 0
    recent_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        check(self.sink_size >= 0, f"sink_size must be >= 0, got {self.sink_size}")
        check(self.recent_size >= 0, f"recent_size must be >= 0, got {self.recent_size}")
        if self.budget is not None:
            check(
                self.sink_size + self.recent_size <= self.budget,
                f"sink_size + recent_size ({self.sink_size} + {self.recent_size}) must not exceed "
                f"budget ({self.budget})",
            )

    def schedule(self):
        if self.budget is None:  # ratio mode: once, when the prompt ends
            return Schedule()
        # every prompt block and every append over budget; decoding waits for a full block
        return Schedule(prefill="block", append=True, decode_slack=self.block_size, block_size=self.block_size)

    def layers_alike(self):
        return True

    def score(self, view):
        return keydiff_scores(view.keys)

    def protected(self, view, n_keep):
        return self.sink_size, self.recent_size
