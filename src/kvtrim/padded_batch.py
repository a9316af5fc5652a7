"""A padded batch's per-sequence bookkeeping, beside `kvtrim.cache.TrimLayer` (its `seq`).

A padded batch (prompts of different lengths) is stored ragged from its first forward and never stores a
pad. The method then runs once per sequence on what that sequence alone would show it: a batch-1 view of
its stored entries (`view`), its own token counts, its own state and the queries / probabilities of its
real tokens only; each sequence's keep is mapped into one keep mask over the layer's padded view
(`keep_mask`). So the kept entries are those of the sequence run alone, for any method, through the
method contract only. Imports the method contract and the storage helpers, nothing of the cache.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
import torch

from kvtrim.methods.base import LayerView
from kvtrim.storage import PaddedView, as_keep, keep_mask


@dataclass
class PerSequence:
    """The keep decisions of a padded batch's sequences (one per sequence, None = keep all), made on
    `views` (batch-1 views of `padded`, the layer's padded view at decision time)."""

    keeps: list
    views: list
    padded: PaddedView


@dataclass
class PaddedBatch:
    """states: the method's state per sequence; seen: real (non-pad) tokens seen per sequence; new: real
    tokens of the current forward per sequence; prompt: each sequence's prompt length once it ended;
    step_valid: `(batch, q)` bool, the real tokens of the current forward (None: all real)."""

    states: list
    seen: list[int]
    new: list[int]
    prompt: list[int] | None = None
    step_valid: torch.Tensor | None = None

    @classmethod
    def start(cls, method, layer_idx: int, batch: int) -> PaddedBatch:
        return cls([method.new_state(layer_idx) for _ in range(batch)], [0] * batch, [0] * batch)

    def select(self, rows: list[int]) -> PaddedBatch:
        """Sequence `i` becomes old sequence `rows[i]` (state deep-copied: a repeated row is independent)."""
        return PaddedBatch([copy.deepcopy(self.states[i]) for i in rows], [self.seen[i] for i in rows],
                           [self.new[i] for i in rows], None if self.prompt is None else [self.prompt[i] for i in rows],
                           None if self.step_valid is None else self.step_valid[rows])

    # ---- the forward's counts --------------------------------------------------------------------
    def start_forward(self, valid: torch.Tensor | None, batch: int, q: int) -> None:
        """A forward of `q` columns, `valid` `(batch, q)` its real tokens (None: all real)."""
        self.new = valid.sum(-1).tolist() if valid is not None else [q] * batch
        self.seen = [s + n for s, n in zip(self.seen, self.new)]
        self.step_valid = valid

    def end_prompt(self) -> None:
        self.prompt = list(self.seen)

    def deferred_prompt_end(self) -> None:
        """The prompt ends outside a forward: no sequence has new tokens."""
        self.new = [0] * len(self.new)
        self.step_valid = None

    def tail_queries(self, queries: torch.Tensor, tail: int, old: list | None) -> list:
        """For a deferred prompt end: each sequence's own last `tail` real queries (a sequence without any
        in this forward keeps its `old` ones)."""
        old = old or [None] * queries.shape[0]
        # copies: a slice of the forward's queries would keep all of them alive until the prompt ends
        return [self.real_queries(b, queries)[:, :, -tail:].clone() if n else old[b] for b, n in enumerate(self.new)]

    # ---- the method, once per sequence ------------------------------------------------------------
    def real_queries(self, b: int, queries):
        """Sequence `b`'s queries `(1, q_heads, q_b, d)` of its real tokens (`queries`: the forward's, or a
        list of per-sequence queries)."""
        if isinstance(queries, list) or queries is None:
            return None if queries is None else queries[b]
        real = self.step_valid
        if real is None or queries.shape[2] != real.shape[1]:
            return queries[b : b + 1]
        return queries[b : b + 1, :, real[b]]

    def view(self, b: int, padded: PaddedView, forward: tuple, layer_idx: int, scaling: float | None,
             queries=None, attention: torch.Tensor | None = None) -> LayerView:
        """What sequence `b` would show the method alone: a batch-1 view of its stored entries
        `(1, kv_heads, n_b, head_dim)` (dense when its heads hold equal counts, else with `valid`), its own
        token counts and state, the queries / probabilities of its real tokens only. `forward`: the layer's
        `(phase, ends prompt, n_new, pass info)`."""
        lengths = padded.lengths[b]
        n = int(lengths.max()) if lengths.numel() else 0
        keys = padded.keys[b : b + 1, :, :n].contiguous()
        values = padded.values[b : b + 1, :, :n].contiguous()
        positions = padded.positions[b : b + 1, :, :n].contiguous()
        valid = None if bool((lengths == n).all()) else padded.valid[b : b + 1, :, :n].contiguous()
        real = None if self.step_valid is None else self.step_valid[b]
        queries = self.real_queries(b, queries)
        if attention is not None:
            attention = attention[b : b + 1, ..., :n]
            if real is not None and attention.shape[2] == real.shape[0]:
                attention = attention[:, :, real]
        phase, ends, _, info = forward
        return LayerView(
            keys=keys, values=values, positions=positions, layer_idx=layer_idx,
            seen=self.seen[b], n_new=self.new[b], phase=phase, prompt_end=ends,
            prompt_tokens=None if self.prompt is None else self.prompt[b], state=self.states[b], queries=queries,
            attention=attention, scaling=scaling, pass_info=info, valid=valid,
        )

    def decide(self, method, hook: str, padded: PaddedView, forward: tuple, layer_idx: int,
               scaling: float | None, queries=None, attention=None) -> PerSequence | None:
        """Call `method.<hook>` once per sequence; a sequence without a real token in this forward is skipped
        (alone, it would not have run it) unless the forward ends the prompt. None: every sequence keeps all."""
        ends = forward[1]
        keeps, views = [], []
        for b in range(padded.lengths.shape[0]):
            if hook != "on_prompt_end" and self.new[b] == 0 and not ends:
                keeps.append(None)
                views.append(None)
                continue
            view = self.view(b, padded, forward, layer_idx, scaling, queries, attention)
            keeps.append(getattr(method, hook)(view))
            views.append(view)
        return None if all(k is None for k in keeps) else PerSequence(keeps, views, padded)

    def keep_mask(self, method, decided: PerSequence) -> torch.Tensor:
        """One keep mask `(batch, kv_heads, width)` over the padded view from each sequence's keep (over its
        batch-1 view); each sequence's state is reduced with its own keep."""
        mask = decided.padded.valid.clone()
        for b, (keep, view) in enumerate(zip(decided.keeps, decided.views)):
            if keep is None:
                continue
            n = view.stored
            mask[b, :, :n] = keep_mask(keep, view.lengths, n)[0]
            mask[b, :, n:] = False
            self.states[b] = method.gather_state(self.states[b], as_keep(keep, n, view.lengths).indices)
        return mask

