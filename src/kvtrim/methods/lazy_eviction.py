"""LazyEviction (arXiv 2506.15969): lagged, recurrence-aware eviction for long generations.

Faithful to the official code's rule:

* One step counter `t` per sequence (kept per layer, all layers in sync): 1 at the first decode step,
  +1 per decode step, back to 0 at any multi-token forward (a prefill), which also restarts tracking.
* Per stored entry: `TS`, the last step it was active, and `MRI`, its maximum recurrence interval.
  At the first decode step every entry (prompt and the new token) starts at `TS = MRI = 0`; later a new
  entry starts at `TS = t - 1, MRI = 0`. Then, from the current query's attention `a` over all stored
  entries: `active = a >= alpha`, `TS[active] = t`, `MRI = max(MRI, TS - TS_before)`.
* Every `window` steps (`t % window == 0`) when the cache holds more than `budget` entries, each KV head
  keeps the `budget - window` best of its older entries by
  `I = 2 sigmoid(-(1 + (t - TS) / (MRI + 1e-5))) + [MRI > 0] * 2 sigmoid(1 - MRI)` plus the `window`
  newest, which are always kept. The cache thus oscillates between `budget` and `budget + window`.
* The prompt is not compressed at prefill (it counts in the budget and is evictable while decoding).
* Evict after the step's attention ("attend, then evict"): the step that evicts still sees everything.

GQA (`gqa=`): the official code repeats K/V per query head before caching, so cache, state and eviction are
per *query* head (G times the KV memory). kvtrim stores native KV heads, which cannot hold G different
selections of one KV head without storing G copies, so:
* `"max"` (default): an entry of a KV head is active when *any* query head of its group gives it
  `>= alpha`; state and selection per KV head.
* `"mean"`: active when the group's mean probability is `>= alpha`.
* `"per_query_head"`: TS/MRI tracked per query head exactly as the official code does, and each KV head
  keeps the entries with the highest *maximum over its group* of the official per-query-head score.
  The state updates are the official ones; the selection is the closest per-KV-head rule. With one query
  head per KV head (MHA, the official code's effective setting) all three modes are the official method.

Deviations (documented):
* Step counters and TS/MRI are int32 (the official code keeps them in fp16, exact only up to 2048 steps).
* Ties go to the earlier entry; kept indices are in position order (official: `topk` order).
* State lives in the cache object, per sequence (official: one global state, batch size 1).

Phases: decode steps track and evict; a prompt block or an append after the prompt (a new turn)
restarts tracking, as the official code does at every prefill.

Calibration lives outside the method (`kvtrim.calibrate`): `lazy_eviction_preset(model, dataset)` returns
the official scripts' `window`/`alpha` (and budget); `estimate_window(...)` measures the paper's rule
(80th percentile of MRI) on your prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.methods.attention_scores import grouped
from kvtrim.methods.base import EvictionMethod, Phase, check, span, top_indices

MRI_EPS = 1e-5
GQA_MODES = ("max", "mean", "per_query_head")


# ---- pure tensor functions ----------------------------------------------------------------------
def activity(attention: torch.Tensor, kv_heads: int, alpha: float, gqa: str) -> torch.Tensor:
    """Which entries the current query attends to.

    Args:
        attention: `(batch, q_heads, n)` probabilities of the current query.
    Returns:
        bool `(batch, kv_heads, n)` ("max", "mean") or `(batch, q_heads, n)` ("per_query_head").
    """
    if gqa == "per_query_head":
        return attention.float() >= alpha
    if gqa == "max":  # a max is exact in any dtype: converted after it (a group's share of the elements)
        return grouped(attention, kv_heads).amax(dim=2).float() >= alpha
    return grouped(attention.float(), kv_heads).mean(dim=2) >= alpha


def track(ts: torch.Tensor, mri: torch.Tensor, active: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the official TS/MRI update: `TS[active] = step`, `MRI = max(MRI, TS - TS_before)`.

    Args:
        ts, mri: int32 `(batch, heads, n)`; active: bool, same shape.
    """
    new_ts = torch.where(active, torch.full_like(ts, step), ts)
    return new_ts, torch.maximum(mri, new_ts - ts)


def mri_scores(ts: torch.Tensor, mri: torch.Tensor, step: int) -> torch.Tensor:
    """The official importance `I = H1 + H2` (float32, higher = keep).

    `H1 = 2 sigmoid(-(1 + (step - TS) / (MRI + 1e-5)))`, `H2 = 0 if MRI == 0 else 2 sigmoid(1 - MRI)`.
    """
    m = mri.float()
    h1 = 2 * torch.sigmoid(-(1 + (step - ts).float() / (m + MRI_EPS)))
    h2 = torch.where(mri == 0, torch.zeros_like(m), 2 * torch.sigmoid(1 - m))
    return h1 + h2


def lazy_keep(scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """Top `budget - window` of the older entries plus the `window` newest.

    Args:
        scores: `(batch, kv_heads, n)` with `n > budget > window`.
    Returns:
        `(batch, kv_heads, budget)` indices sorted ascending.
    """
    n = scores.shape[-1]
    return torch.cat([top_indices(scores[..., : n - window], budget - window), span(n - window, n, scores)], dim=-1)


# ---- the method ---------------------------------------------------------------------------------
@dataclass
class _LazyState:
    step: int = 0  # decode steps since the last prefill (t)
    ts: torch.Tensor | None = None  # int32 (batch, state_heads, n_stored)
    mri: torch.Tensor | None = None


@dataclass(kw_only=True)
class LazyEviction(EvictionMethod):
    """LazyEviction: every `window` decode steps, keep `budget - window` entries by recurrence score + the newest.

    Args:
        budget: entries per KV head per layer right after an eviction (B, the official
            `max_kv_capacity`; the peak is `budget + window`), > window.
        window: observation window W = eviction period = protected newest entries, >= 1.
        alpha: activity threshold on attention probabilities, in (0, 1).
        gqa: "max", "mean" or "per_query_head" (see the module docstring).

    The official scripts' window/alpha per model and dataset: `kvtrim.calibrate.lazy_eviction_preset`;
    the paper's rule for the window, measured on your prompts: `kvtrim.estimate_window`.
    """

    name = "lazyeviction"
    summary = "recurrence-interval tracking, evicts every W decode steps (LazyEviction); needs kvtrim attention"
    needs_attention = True
    attention_only_decode = True
    reads_values = False
    size_params = ("budget",)
    counts_by_decode_steps = True

    budget: int | None = None
    window: int = 128
    alpha: float = 1e-4
    gqa: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check(self.budget is not None, "LazyEviction needs budget=")
        check(self.window >= 1, f"window must be >= 1, got {self.window}")
        check(self.budget > self.window, f"budget ({self.budget}) must exceed window ({self.window})")
        check(0 < self.alpha < 1, f"alpha must be in (0, 1), got {self.alpha}")
        check(self.gqa in GQA_MODES, f"gqa must be one of {', '.join(GQA_MODES)}, got '{self.gqa}'")

    def layers_alike(self):  # each layer from its own attention; state per batch row
        return True

    def new_state(self, layer_idx):
        return _LazyState()

    def peak_stored(self, prompt_tokens, total_tokens):
        # the prompt stays whole; decode step t appends one entry, then evicts back to `budget` when t % window
        # == 0 and the layer holds more. The first eviction is at the first multiple of the window past the
        # budget; from then on the layer grows to at most budget + window before each eviction
        steps = total_tokens - prompt_tokens
        first = self.window * max(1, (self.budget - prompt_tokens) // self.window + 1)
        if steps < first:
            return total_tokens
        return max(prompt_tokens + first, self.budget + min(self.window, steps - first))

    def kept_after_decode(self, stored, decode_steps):
        # every `window` decode steps, back to the budget when over it
        return self.budget if stored > self.budget and decode_steps % self.window == 0 else None

    def on_attention(self, view):
        state: _LazyState = view.state
        if view.phase is not Phase.DECODE:  # a prompt block or an append: restart tracking, no eviction
            state.step, state.ts, state.mri = 0, None, None
            return None
        check(view.attention is not None, "LazyEviction needs the decode step's attention probabilities: "
                                          "run the model with kvtrim.enable(model)")
        hkv, n = view.keys.shape[1], view.keys.shape[2]
        active = activity(view.attention[:, :, -1], hkv, self.alpha, self.gqa)
        state.step += 1
        t = state.step
        if state.ts is None:
            state.ts = torch.zeros(active.shape, dtype=torch.int32, device=active.device)
            state.mri = torch.zeros_like(state.ts)
        else:
            new = n - state.ts.shape[-1]
            shape = (*active.shape[:2], new)
            state.ts = torch.cat([state.ts, torch.full(shape, t - 1, dtype=torch.int32, device=active.device)], -1)
            state.mri = torch.cat([state.mri, torch.zeros(shape, dtype=torch.int32, device=active.device)], -1)
        state.ts, state.mri = track(state.ts, state.mri, active, t)
        if self.kept_after_decode(n, t) is None:
            return None
        scores = mri_scores(state.ts, state.mri, t)
        if scores.shape[1] != hkv:  # per_query_head: the group's best official score
            scores = grouped(scores, hkv).amax(dim=2)
        return lazy_keep(scores, self.budget, self.window)

    def gather_state(self, state: _LazyState, keep):
        if state.ts is None:
            return state
        idx = keep.repeat_interleave(state.ts.shape[1] // keep.shape[1], dim=1)
        state.ts, state.mri = state.ts.gather(-1, idx), state.mri.gather(-1, idx)
        return state
