"""AdaKV: head-wise budget allocation on top of a scoring method (Feng et al., "Ada-KV: Optimizing KV
Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", arXiv 2407.11550).

A layer holds `kv_heads × budget` entries per sequence, as with the uniform method, but they are shared
across its KV heads: heads whose scores are concentrated keep few entries, diffuse heads many. The rule
(the paper's Algorithm 1 with its safeguard, as kvpress's `AdaKVPress` implements it):

1. `n_keep` = the wrapped method's per-head count (`budget`, or `kept_count(prompt, compression_ratio)`);
2. every head keeps its own top `n_safe = int(n_keep × alpha_safeguard)` entries (the safeguard);
3. the layer's remaining `kv_heads × n_keep − (safeguarded)` slots go to the best remaining entries of
   all heads together: one top-k over the flattened `(kv_heads × n)` scores of the sequence.

The kept counts then differ per head and the cache layer switches to ragged storage
(`kvtrim.storage`): the evicted entries are really freed, unlike kvpress, which keeps them and hides
them from attention ("fake keys"), and so does not reduce memory.

Deviations (documented, deliberate):
* Protected entries of the wrapped method (`protected()`: SnapKV's observation window, KeyDiff's
  sinks / recent entries) are kept in every head and count against that head's share, ahead of the
  safeguard. kvpress gets the same effect because its scorers give the window the highest scores.
* Ties: the earlier entry wins, heads in order (the flattened index), as `top_indices` everywhere in
  kvtrim; kvpress's `torch.topk` leaves ties unspecified.
* When: once, at the end of the prompt (the paper's and kvpress's setting: prefill compression).
  The wrapped method's own schedule is not used: under AdaKV a method sized with `budget=` is not
  evicted block by block, and decoding and appends keep every new entry. (Scoring a ragged layer
  again would need every scorer to respect `view.valid`, which they do not yet.)
* Scores are those of the wrapped method as it computes them; the paper also proposes scores
  normalised across heads for some scorers — not done here.

Refused, with a one-line error: methods that rank nothing (LagKV's reference mode, KVzip, which
allocates across heads itself), that pick entries by their own rule (StreamingLLM, H2O), keep
per-entry state, or whose scores cannot be compared across heads (`headwise_refusal`: TOVA's one set
for all heads; LagKV's global scores, per-partition ranks that are the same in every head, so a top-k
across heads allocates uniformly — measured on SmolLM2: every head kept exactly the uniform count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtrim.methods.base import (
    EvictionMethod,
    LayerView,
    Phase,
    ScoringMethod,
    check,
    kept_count,
    top_indices,
)


def protected_mask(n: int, n_keep: int, first: int, last: int, device=None) -> torch.Tensor:
    """`(n,)` bool: the first `first` and last `last` of `n` entries, at most `n_keep` of them (the
    earliest win, as `keep_top`)."""
    idx = torch.arange(n, device=device)
    prot = (idx < first) | (idx >= n - last)
    return prot & (prot.cumsum(-1) <= n_keep)


def adakv_keep(scores: torch.Tensor, n_keep: int, alpha_safeguard: float, first: int = 0,
               last: int = 0) -> torch.Tensor:
    """AdaKV's allocation for one layer: the keep mask `(batch, kv_heads, n)` for `scores`
    `(batch, kv_heads, n)` (higher = keep), every sequence keeping `kv_heads × min(n_keep, n)` entries.

    Each head keeps its protected entries (`first` / `last`, see `protected_mask`) and its own top
    `int(n_keep × alpha_safeguard)`; the rest of the sequence's `kv_heads × n_keep` go to the best
    remaining entries of all heads (one top-k over the flattened scores; ties -> the earlier flat index).
    """
    b, h, n = scores.shape
    if n_keep >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    prio = scores.float().masked_fill(protected_mask(n, n_keep, first, last, scores.device), torch.inf)
    n_safe = int(n_keep * alpha_safeguard)
    if n_safe > 0:
        safe = torch.zeros_like(prio, dtype=torch.bool).scatter_(-1, top_indices(prio, n_safe), True)
        prio = prio.masked_fill(safe, torch.inf)
    kept = top_indices(prio.reshape(b, h * n), h * n_keep)
    return torch.zeros(b, h * n, dtype=torch.bool, device=scores.device).scatter_(1, kept, True).view(b, h, n)


@dataclass
class AdaKV(EvictionMethod):
    """Head-wise budgets for a scoring method: `AdaKV(SnapKV(compression_ratio=0.5))`.

    Args:
        method: the scoring method whose scores and size are used (a `ScoringMethod` sized with
            `budget=` or `compression_ratio=`).
        alpha_safeguard: fraction of the per-head budget every head keeps (its own best entries), in [0, 1].
            1 gives the uniform method back; 0 a pure layer-wide top-k.

    Spec: `adakv:method=snapkv:compression_ratio=0.5` — the wrapped method's parameters (its size
    included) follow `method=` in the same spec (`kvtrim.specs`).
    """

    name: ClassVar[str] = "adakv"
    summary: ClassVar[str] = ("head-wise budgets: a layer's kv_heads x budget by one top-k over all heads' scores, "
                              "alpha_safeguard x budget per head (AdaKV); wraps a scoring method")
    #: the parameter that names the wrapped method in a spec (`kvtrim.specs`)
    wraps: ClassVar[str] = "method"
    same_count_per_head: ClassVar[bool] = False  # head-wise budgets: head lengths differ (ragged)

    method: EvictionMethod | None = None
    alpha_safeguard: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        inner = self.method
        name = type(inner).__name__
        check(inner is not None, "AdaKV needs the scoring method it allocates for: AdaKV(SnapKV(compression_ratio=0.5))")
        check(isinstance(inner, ScoringMethod),
              f"AdaKV shares the budget of a scoring method across heads; {name} is not one (it ranks no entries)")
        check(type(inner).select is ScoringMethod.select,
              f"AdaKV cannot share {name}'s budget: it picks entries by its own rule, not by one score per entry")
        check(type(inner).gather_state is EvictionMethod.gather_state,
              f"AdaKV cannot wrap {name}: it keeps per-entry state across evictions")
        check(inner.headwise_refusal is None, f"AdaKV cannot wrap {name}: {inner.headwise_refusal}")
        check(inner.fixed_budget() is not None or getattr(inner, "compression_ratio", None) is not None,
              f"AdaKV needs {name} sized by budget= or compression_ratio=")
        check(0 <= self.alpha_safeguard <= 1, f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}")

    @classmethod
    def at_budget(cls, budget: int, context_length: int, method: str | EvictionMethod | None = None,
                  alpha_safeguard: float = 0.2, **params) -> AdaKV:
        """AdaKV over `method` (a registered name, with its `params`) sized with `budget=`: `kv_heads × budget`
        entries per layer once the prompt of `context_length` tokens ends (what `kvtrim.specs` builds)."""
        from kvtrim.methods import METHODS  # the registry imports this module

        check(isinstance(method, str) and method in METHODS,
              f"adakv: method= must name a registered method, got {method!r}")
        clash = sorted(set(params) & set(METHODS[method].size_params))
        check(not clash, f"adakv: {', '.join(clash)} fixes the size already; the sweep sizes it by budget")
        return cls(METHODS[method](budget=budget, **params), alpha_safeguard=alpha_safeguard)

    def label(self) -> str:
        alpha = "" if self.alpha_safeguard == 0.2 else f", alpha_safeguard={self.alpha_safeguard:.3g}"
        return f"AdaKV({self.method.label()}{alpha})"

    # ---- what the cache asks -----------------------------------------------------------------
    @property
    def needs_queries(self) -> bool:  # the wrapped scorer's needs, at the prompt's end only
        return self.method.waits_for_attention

    def prompt_queries(self) -> int:
        return self.method.prompt_queries()

    def new_state(self, layer_idx):
        return self.method.new_state(layer_idx)

    def check_config(self, config) -> None:
        self.method.check_config(config)

    def evicts_layer(self, layer_idx: int) -> bool:
        return self.method.evicts_layer(layer_idx)

    # ---- hooks: decide once, when the prompt ends ------------------------------------------------
    def on_update(self, view: LayerView):
        if self.waits_for_attention:
            return None
        self.method.observe(view)
        return self.decide(view)

    def on_attention(self, view: LayerView):
        self.method.observe(view)
        return self.decide(view)

    def on_prompt_end(self, view: LayerView):
        return self.decide(view)

    def budget_for(self, view: LayerView) -> int:
        """The per-head budget `n_keep` the layer's total is `kv_heads ×` of."""
        inner = self.method
        budget = inner.fixed_budget()
        return budget if budget is not None else kept_count(view.prompt_tokens, inner.compression_ratio)

    def decide(self, view: LayerView) -> torch.Tensor | None:
        """The keep mask `(batch, kv_heads, n)` at the end of the prompt, else None."""
        if not (view.phase is Phase.PREFILL and view.prompt_end) or not self.method.evicts_layer(view.layer_idx):
            return None
        n_keep = self.budget_for(view)
        if view.stored <= n_keep:
            return None
        check(view.valid is None, "AdaKV decides once per layer, on a dense layer")
        scores = self.method.score(view)
        if scores is None:
            return None
        first, last = self.method.protected(view, n_keep)
        return adakv_keep(scores, n_keep, self.alpha_safeguard, first, last)
