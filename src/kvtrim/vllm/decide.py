"""The method's decision on a request's stored entries: a `TrimLayer` resumed from them in position order,
told a forward's steps and handed its attention as kvtrim's attention hands it in transformers. Shared by
the worker's compaction (`kvtrim.vllm.compact`) and the scheduler's stand-in (`kvtrim.vllm.planning`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvtrim.attention import attend_with_probabilities
from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import Phase, check

if TYPE_CHECKING:  # (planning imports `hand_over` from here)
    from kvtrim.vllm.planning import Step


def decide(cache: TrimCache, idx: int, keys: torch.Tensor | None, values: torch.Tensor | None,
           slot_positions: torch.Tensor, old: int, told: int, steps: list[Step], prompt_tokens: int, state: Any,
           queries: torch.Tensor | None = None, scale: float | None = None, last: torch.Tensor | None = None,
           sums: torch.Tensor | None = None):
    """The method's decision on stored entries `(b, h, stored, d)` in slot order (`slot_positions` `(b, h,
    stored)`; the first `old` stored before this forward; keys None for a positions-only method, values None for
    one that reads none: stand-ins): one layer's
    (`b = 1`), or a request's layers as one batch (`layers_alike` methods), as a `TrimLayer` (index `idx`)
    resumed from them in position order and fed the forward's `steps`. Returns the layer, what it keeps as a
    slot mask `(b, h, stored)` and the kept count.

    A method that waits for its attention (`needs_queries`: SnapKV) gets it after each step as kvtrim's
    attention hands it over in transformers (`TrimLayer.after_attention`): `queries` `(b, q_heads, W,
    head_dim)`, the prompt block's last post-RoPE queries, with the step that ends the block (the prompt's, for
    a method that reads it in one), and the layer's softmax `scale`. A method that `needs_attention` (TOVA, H2O, LazyEviction) gets `last` `(b, q_heads, q, head_dim)`, the queries of
    the step after the prompt (a decode step: with its probabilities over the layer's entries after the step's
    append, computed here as kvtrim's attention computes them, `attend_with_probabilities`; an append: its
    queries, as kvtrim's attention hands them). Any other step gets None. (A decode step whose probabilities the
    caller computed runs on the request's kept decision layer instead: `kvtrim.vllm.live`.) `sums`
    `(b, kv_heads, prompt)`: instead of `queries`, the prompt's attention column sums (`kvtrim.vllm.spec.prompt_sums`: H2O),
    handed over with the step that ends the prompt."""
    b, h, stored = slot_positions.shape
    # the method sees the entries in position order (this forward's tokens last: theirs are the latest positions,
    # wherever they lie: the first may have filled a hole)
    by_position = slot_positions.argsort(dim=-1)
    sorted_positions = slot_positions.gather(-1, by_position)
    real = keys if keys is not None else values
    if real is None:  # a positions-only method: stand-ins, it reads no keys or values
        keys = values = torch.zeros(1, 1, 1, 1).expand(b, h, stored, 1)
    else:  # whole rows: index_select is far faster than gather
        rows = (by_position + stored * torch.arange(b * h).view(b, h, 1)).flatten()
        # stand-in values (of the keys' dtype) for a method that reads none (`reads_values`)
        keys, values = (torch.zeros(1, 1, 1, 1, dtype=real.dtype).expand(b, h, stored, 1) if t is None
                        else t.reshape(b * h * stored, -1).index_select(0, rows).view(b, h, stored, -1)
                        for t in (keys, values))
    layer = TrimLayer(cache.method, idx, owner=cache, in_place_decode=False)
    cache.layers.append(layer)
    if told:
        ended = prompt_tokens if told >= prompt_tokens else None  # resumed inside the prompt (blocks): not ended
        layer.resume(keys[:, :, :old], values[:, :, :old], sorted_positions[:, :, :old], told, ended,
                     layer.state if state is None else state)
    start = old
    for step in steps:
        q = step.tokens
        with cache.phase(step.phase, ends_prompt=step.ends_prompt):
            full = cache.update(keys[:, :, start:start + q], values[:, :, start:start + q], len(cache.layers) - 1)
        if layer.awaiting_attention:  # attend, then evict: the hand-over of kvtrim's attention
            hand_over(layer, step.phase, q, full, queries if step.phase is Phase.PREFILL else None, last, scale,
                      sums=sums if step.ends_prompt else None)
        start += q
    check(not layer.is_ragged, f"{type(cache.method).__name__} kept different numbers of entries per KV head, which "
                               "vLLM's shared block table cannot hold")
    kept, n_keep = kept_slots(layer, slot_positions)
    return layer, kept, n_keep


def kept_slots(layer: TrimLayer, slot_positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What `layer` kept of the entries at `slot_positions` `(b, h, stored)` (slot order) it held before its
    eviction: a slot mask `(b, h, stored)` (looked up by position: one scatter, one gather) and the kept count."""
    b, h, stored = slot_positions.shape
    pos = layer.positions  # (b, h, n_keep)
    if pos.shape[-1] == stored:  # nothing evicted
        return torch.ones(b, h, stored, dtype=torch.bool), stored
    held = torch.zeros(b * h, layer.seen, dtype=torch.bool).scatter_(-1, pos.reshape(b * h, -1), True)
    return held.gather(-1, slot_positions.reshape(b * h, stored)).view(b, h, stored), pos.shape[-1]


def hand_over(layer: TrimLayer, phase: Phase, q: int, full: tuple[torch.Tensor, torch.Tensor],
              prompt: torch.Tensor | None, step: torch.Tensor | None, scale: float | None,
              probs: torch.Tensor | None = None, sums: torch.Tensor | None = None) -> None:
    """Hand a layer that waits for its attention what kvtrim's attention hands it in transformers after a step of
    `q` tokens (`full`: the layer's keys and values after the step's append): with a prompt block's step (the
    whole prompt's, unless the method reads it in blocks), the block's last queries `prompt`; with a step after
    the prompt, its queries `step` (`(b, q_heads, q, head_dim)`, methods that need attention) and, for a decode
    step, the probabilities they attend with; else nothing (a decode step's `probs`, when the caller computed
    them: those). `sums`: the prompt's attention column sums instead of queries (H2O in the engine). The worker's
    compaction and the scheduler's stand-in both hand over through this one rule."""
    if phase is Phase.PREFILL:
        layer.after_attention(prompt, None, scale, sums)
    elif step is not None:
        if probs is None and q == 1:
            probs = attend_with_probabilities(step, *full, None, scale)[1]
        layer.after_attention(step, probs if q == 1 else None, scale)
    else:
        layer.after_attention(None, None, scale)

