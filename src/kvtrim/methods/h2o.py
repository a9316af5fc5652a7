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
  causal), so the extra memory is `prefill_block x n` per query head. The sums are exact (each row's
  softmax is independent of the others); the cost is the prompt's `QK^T` once more plus a softmax, paid
  once: about one SDPA attention per layer on the CPU (SmolLM2, 6,000 tokens: 1.4x the full prefill).
  Starting at the first decode step instead would leave every prompt entry at score 0, making the first
  cut arbitrary - the paper's method ranks prompt tokens by their prompt attention.
  Inside the vLLM engine the same function runs on each prefill chunk's queries as the chunk is computed
  (the sums are additive over query rows) and the method gets the prompt's sums (`LayerView.attention_sums`)
  instead of its queries.
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
smaller half), or `compression_ratio=` (the budget is `kept_count(n, compression_ratio)` of the prompt,
fixed when the prompt ends, split the same way and kept while decoding).

Phases: every forward accumulates its attention; prompt blocks, appends (a question after the prompt)
and decode steps all cut back to the budget when over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.attention_scores import grouped
from kvtrim.methods.base import Schedule, ScoringMethod, check, kept_count, lowest_slot, span, top_indices


# ---- pure tensor functions ----------------------------------------------------------------------
def prompt_attention_sums(queries: torch.Tensor, keys: torch.Tensor, scaling: float, block: int = 64) -> torch.Tensor:
    """Column sums of the causal attention of the last `q_len` positions, per KV head (summed over its group).

    Computed in blocks of `block` query rows: one `(group * block) x visible` product per KV head into a
    buffer reused by every block, the causal mask on the block's diagonal tile only, a softmax in that same
    buffer, and the column sums as one more product with ones. The extra memory is one block's logits
    (float32); on the CPU this costs about one SDPA attention of the prompt (the `QK^T` product dominates).

    Args:
        queries: `(batch, q_heads, q_len, head_dim)`, the last `q_len` of the `n` positions of `keys`.
        keys: `(batch, kv_heads, n, head_dim)`.
        block: query rows per step.
    Returns:
        `(batch, kv_heads, n)` float32.
    """
    b, h, q, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group, rows, block = h // hkv, b * hkv, min(block, q)
    device = keys.device
    scaled = (queries.float() * scaling).reshape(rows, group, q, d)  # the scale folded into the queries once
    keys_t = keys.float().reshape(rows, n, d).transpose(1, 2)  # (rows, d, n)
    future = torch.ones(block, block, dtype=torch.bool, device=device).triu_(1)
    ones = torch.ones(rows, 1, group * block, dtype=torch.float32, device=device)
    buffer = torch.empty(rows * group * block * n, dtype=torch.float32, device=device)
    total = torch.zeros(rows, n, dtype=torch.float32, device=device)
    for start in range(0, q, block):
        m = min(q, start + block) - start
        visible = n - q + start + m  # rows sit at positions n - q + start ..; later keys are masked anyway
        logits = buffer[: rows * group * m * visible].view(rows, group * m, visible)
        torch.bmm(scaled[:, :, start : start + m].reshape(rows, group * m, d), keys_t[:, :, :visible], out=logits)
        # only the block's own tile (its last m columns) holds keys later than some of its rows
        logits.view(rows, group, m, visible)[..., visible - m :].masked_fill_(future[:m, :m], float("-inf"))
        # softmax in place (the row-wise kernel reads a row before writing it): no second block-sized tensor
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)
        total[:, :visible] += torch.bmm(ones[:, :, : group * m], probs)[:, 0]
    return total.view(b, hkv, n)


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


@dataclass(kw_only=True)
class H2O(ScoringMethod):
    """H2O: accumulated-attention heavy hitters plus a recent window, evicting one entry per decode step.

    Exactly one form:
        heavy_budget, recent_budget: entries kept per KV head per layer (both given; heavy >= 0, recent >= 1).
        budget: total, split half/half.
        compression_ratio: fraction of the prompt removed, in [0, 1); the budget it gives when the prompt
            ends stays fixed while decoding.
    Args:
        prefill_block: query rows per block when recomputing the prompt's attention sums.
    """

    name = "h2o"
    summary = "accumulated attention (heavy hitters) + recent window, step-wise at decode (H2O); needs kvtrim attention"
    needs_queries = True
    needs_attention = True
    attention_only_decode = True
    reads_values = False
    in_place_decode = True
    counts_ignore_attention = True  # its accumulated attention picks which entries, its budget how many
    prompt_attention_summary = "sums"  # its scores start with the prompt's attention column sums
    size_params = ("budget", "compression_ratio", "heavy_budget", "recent_budget")

    heavy_budget: int | None = None
    recent_budget: int | None = None
    prefill_block: int = 64

    def check_size(self):
        split = self.heavy_budget is not None or self.recent_budget is not None
        forms = [split, self.budget is not None, self.compression_ratio is not None]
        check(sum(forms) == 1, "H2O needs exactly one of heavy_budget= + recent_budget=, budget= or compression_ratio=")
        if split:
            check(
                self.heavy_budget is not None and self.recent_budget is not None,
                "H2O needs both heavy_budget= and recent_budget=",
            )
            check(self.heavy_budget >= 0, f"heavy_budget must be >= 0, got {self.heavy_budget}")
            check(self.recent_budget >= 1, f"recent_budget must be >= 1, got {self.recent_budget}")
        elif self.budget is not None:
            check(self.budget >= 2, f"budget must be >= 2, got {self.budget}")
        else:
            super().check_size()

    def __post_init__(self):
        super().__post_init__()
        check(self.prefill_block >= 1, f"prefill_block must be >= 1, got {self.prefill_block}")

    def budgets(self, prompt_length: int | None = None) -> tuple[int, int]:
        """`(heavy, recent)` entries per KV head (`prompt_length` needed in compression_ratio mode)."""
        if self.heavy_budget is not None:
            return self.heavy_budget, self.recent_budget
        if self.budget is not None:
            return split_budget(self.budget)
        return split_budget(kept_count(prompt_length, self.compression_ratio))

    def fixed_budget(self):
        return sum(self.budgets()) if self.compression_ratio is None else None

    def peak_stored(self, prompt_tokens, total_tokens):  # the base's rule on its own budget (heavy + recent)
        # (`counts_ignore_attention` alone would size a heavy + recent budget as a ratio's: its own sizing here)
        return self._scheduled_peak(prompt_tokens, total_tokens, sum(self.budgets(prompt_tokens)))

    def schedule(self):
        # every forward over budget: the prompt (once it has a budget), appends, each decode step
        return Schedule(prefill="block" if self.compression_ratio is None else "end", append=True, decode_slack=1)

    def layers_alike(self):  # each layer from its own attention; state per batch row
        return True

    def new_state(self, layer_idx):
        return _H2OState()

    def observe(self, view):
        state: _H2OState = view.state
        b, hkv, n = view.keys.shape[:3]
        old = 0 if state.scores is None else state.scores.shape[-1]
        if old == n and view.attention is not None:  # an in-place step: the new entry took a freed slot (score 0)
            state.scores += decode_attention_sums(view.attention, hkv)
            return
        grown = torch.zeros(b, hkv, n, dtype=torch.float32, device=view.keys.device)
        if state.scores is not None:
            grown[..., :old] = state.scores
        if view.attention is not None:
            grown += decode_attention_sums(view.attention, hkv)
        elif view.attention_sums is not None:  # a prompt's sums, reduced by the caller (the vLLM engine)
            grown += view.attention_sums
        else:
            queries = view.require_queries("H2O")
            grown += prompt_attention_sums(queries, view.keys, view.softmax_scale(), self.prefill_block)
        state.scores = grown

    def score(self, view):
        return view.state.scores

    def select(self, view, scores, n_keep):
        heavy, recent = (self.heavy_budget, self.recent_budget) if self.heavy_budget is not None else split_budget(n_keep)
        return h2o_keep(scores, heavy, recent)

    def evicted_slot(self, view, scores, n_keep):
        # the slot h2o_keep drops: the lowest score outside the `recent` newest positions. The window always
        # holds the last `recent` tokens appended (every cut keeps them), so with counted positions it is
        # the entries at positions >= seen - recent: no kthvalue needed to find it
        recent = self.recent_budget if self.heavy_budget is not None else split_budget(n_keep)[1]
        last_from = view.seen - recent if view.counted_positions else None
        return lowest_slot(scores, view.positions, last=recent, last_from=last_from)

    def gather_state(self, state: _H2OState, keep):
        state.scores = state.scores.gather(-1, keep)
        return state

    def free_state(self, state: _H2OState, slots):
        state.scores.scatter_(-1, slots[..., None], 0.0)  # the next entry in this slot starts at 0
        return state
