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
probabilities that produced the layer's output. Every multi-token forward (prompt blocks, and appends such as
a question after the prompt) is treated like the prompt,
so a chunked prefill (`prefill_chunk_size=`) cuts the cache back to `budget` after each chunk with that
chunk's last query (block-wise TOVA).

Deviations (documented): ties go to the earlier entry (official `topk`: arbitrary); kept indices are
sorted by position (official: score order; attention is unaffected). GQA needs no choice: the mean over
all query heads is the paper's layer-wide score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.attention_scores import causal_attention
from kvtrim.methods.base import Schedule, ScoringMethod


# ---- pure tensor functions ----------------------------------------------------------------------
def tova_scores(last_row: torch.Tensor) -> torch.Tensor:
    """`(batch, q_heads, n)` attention of the current query -> `(batch, n)` mean over heads (float32)."""
    return last_row.float().mean(dim=1)


# ---- the method ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TOVA(ScoringMethod):
    """TOVA: keep the `budget` entries the current query attends to most (mean over the layer's heads).

    Args:
        budget: entries kept per layer (the same positions in every KV head), >= 1.
        compression_ratio: alternatively (a kvtrim sizing, not in the paper), the fraction of the prompt
            removed; the budget it gives when the prompt ends stays fixed while decoding.
    """

    name = "tova"
    summary = "current query's attention averaged over heads, one set per layer, step-wise (TOVA); needs kvtrim attention"
    needs_queries = True
    needs_attention = True
    attention_only_decode = True
    reads_values = False
    in_place_decode = True  # the default `evicted_slot`: the lowest score, ties -> the latest position
    counts_ignore_attention = True  # attention picks which entries, the schedule how many
    decides_across_heads = True  # its attention averaged over all the layer's heads
    headwise_refusal = "it scores one set of entries shared by all heads (nothing to allocate)"

    def schedule(self):
        # every forward over budget (a ratio fixes the budget when the prompt ends)
        return Schedule(prefill="block" if self.budget is not None else "end", append=True, decode_slack=1)

    def layers_alike(self):  # each layer from its own attention; state per batch row
        return True

    def prompt_queries(self):
        return 1  # a deferred prompt end (ratio mode) scores with the prompt's last query

    def score(self, view):
        if view.attention is not None:
            row = view.attention[:, :, -1]  # (b, q_heads, n)
        else:
            queries = view.require_queries("TOVA")
            row = causal_attention(queries[:, :, -1:], view.keys, view.softmax_scale()).flatten(1, 3)
        return tova_scores(row)[:, None, :].expand(-1, view.kv_heads, -1)  # one set for every KV head
