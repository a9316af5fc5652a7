"""`TrimCache`: a `transformers` cache whose full-attention layers evict entries through a method.

Logical vs physical length (the contract every model forward relies on):

* `get_seq_length()` is the number of tokens *seen*, so `generate` and the models derive the true
  position ids for new tokens (RoPE is never re-applied to stored keys);
* `get_mask_sizes(q)` returns `(stored + q, seen - stored)`: the mask covers exactly what is stored
  plus the new tokens, and the offset keeps the causal structure of the new tokens right;
* `update` appends, returns the full tensors for this step's attention, then stores only the kept
  subset ("attend, then evict"): the step that triggers an eviction still sees everything.

Every layer keeps `positions` `(batch, kv_heads, n)`, the original position of each stored entry,
sorted ascending per head. Kept entries are gathered into new, smaller tensors: memory is really freed.

Storage: each layer holds a `kvtrim.storage.LayerStorage` (`layer.kv`) in one of three layouts, one
file each under `kvtrim/storage/`; `kvtrim/storage/switch.py` is the only place a layer changes layout:

* dense (`DenseKV`, the fast path): `keys`, `values` `(batch, kv_heads, n, head_dim)`, every `(sequence,
  kv_head)` row holding the same `n` entries: what `DynamicCache` holds, bit-identical attention;
* slots (`SlotKV`, in-place decoding: methods with `in_place_decode`, H2O, TOVA, StreamingLLM; on unless
  `TrimCache(in_place_decode=False)`): a decode step that evicts exactly one entry per row does not copy
  the layer. The method returns the slot leaving each row (`EvictOne`); the slot stays, marked free
  (`TrimLayer.free_slots`), and the next decode step writes its new entry into it (`index_copy_`).
  `layer.positions` / `layer.keys` are then in slot order (`kept_positions()` gives the sorted positions;
  `stored`, `lengths` and `stats()` count live entries only). Any other forward first puts the layer
  back in position order (`settle()`, one gather). Attention is order-free up to float rounding (kept
  sets and tokens matched the copying path in `tests/test_in_place_decode.py`);
* ragged (`RaggedKV`, `layer.storage`): a slot pool, every row its own length (`layer.lengths`),
  allocated bytes within 2 % of the entries held. A layer switches for good the first time a method keeps
  unequal numbers of entries per row (a keep mask, or indices padded with -1: e.g. `kvtrim.AdaKV`).
  Attention over it needs kvtrim's attention function, which calls `kvtrim.ragged_attention` on the
  step's transient padded view (a missing hand-off is an error at the next layer's update, as for methods
  that need queries). Methods then see that padded view (`view.valid` marks the stored entries).

Padded batches: kvtrim's mask builders record the forward's 2D padding mask (`record_padding_mask`);
`TrimCache.update` reads which of the step's tokens are pads from its last q columns and takes each
sequence's positions from the model's `position_ids`. A cache whose first forward has pads (or built with
`padded=True`) keeps every layer ragged from the start and never stores a pad; `seen` counts columns (what
`generate` and the mask sizes use) and `TrimLayer.seq` (`kvtrim.padded_batch.PaddedBatch`) each
sequence's real tokens and method state. The method then runs once per sequence on a batch-1 view of
that sequence's entries (`sequence_view`): the kept entries are those of the sequence alone.
"""

from __future__ import annotations

import copy
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, is_dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from kvtrim.methods.base import EvictionMethod, EvictOne, KvtrimError, LayerView, Phase, check
from kvtrim.methods.full import FullCache
from kvtrim.padded_batch import PaddedBatch, PerSequence
from kvtrim.storage import DenseKV, SlotKV, as_keep, flat_rows, select_rows, switch  # flat_rows, select_rows: importable from here
from kvtrim.stored_layer import StoredLayer

__all__ = ["CacheStats", "TrimCache", "TrimLayer", "flat_rows", "record_padding_mask", "select_rows",
           "take_pending_layer"]

# ---- the hand-off to kvtrim's attention function ---------------------------------------------------
# The protocol (all of it): `TrimLayer.update` of a layer whose method waits for its attention registers
# the layer here; kvtrim's attention function (`kvtrim.attention`) takes it with
# `take_pending_layer(module.layer_idx)` and, once the layer's output is computed, calls
# `layer.after_attention(queries, probs, scaling)`. A weak reference: a cache deleted before its
# attention ran is not kept alive by it.
_PENDING_LAYER: ContextVar[weakref.ref | None] = ContextVar("kvtrim_pending_layer", default=None)


# ---- the step's padding mask, recorded by kvtrim's mask builders ---------------------------------------
# kvtrim's attention registers mask builders (`kvtrim.attention.register`) that record the forward's 2D
# padding mask `(batch, seen + q)` here before building the stock mask; the first `TrimCache.update` of the
# forward takes it (its last q columns: which of this step's tokens are real). Nothing recorded: the model
# does not run kvtrim's attention (or got a prepared 4D mask), and the cache knows of no padding.
_NOT_RECORDED = object()
_PADDING_MASK: ContextVar[Any] = ContextVar("kvtrim_padding_mask", default=_NOT_RECORDED)


def record_padding_mask(mask: torch.Tensor | None) -> None:
    """Record this forward's 2D padding mask `(batch, kv)` (None: no padding). Called by kvtrim's mask builders."""
    _PADDING_MASK.set(mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None)


def _take_padding_mask() -> tuple[bool, torch.Tensor | None]:
    """`(recorded, mask)`: the mask recorded for this forward, cleared once taken."""
    mask = _PADDING_MASK.get()
    if mask is _NOT_RECORDED:
        return False, None
    _PADDING_MASK.set(_NOT_RECORDED)
    return True, mask


def _pending() -> TrimLayer | None:
    ref = _PENDING_LAYER.get()
    return None if ref is None else ref()


def take_pending_layer(layer_idx: int) -> TrimLayer | None:
    """Return (and clear) the layer waiting for its attention, if it is layer `layer_idx`."""
    layer = _pending()
    if layer is None or layer.layer_idx != layer_idx:
        return None
    _PENDING_LAYER.set(None)
    owner = layer.owner
    if owner is not None:
        owner.kvtrim_attention = True
    return layer


def _tensors(obj: Any):
    """Yield every tensor held directly by `obj` (a tensor, dict, list or dataclass)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from _tensors(v)


class TrimLayer(StoredLayer):
    """A full-attention cache layer that evicts: the phase machine and the method calls.

    What the layer holds is read through its storage (`StoredLayer`: `keys`, `values`, `positions`,
    `storage`, `lengths`, `kept_positions()`; the layouts: `kvtrim.storage`); a padded batch's per-sequence
    bookkeeping is `seq` (`kvtrim.padded_batch`). `peak`: the most entries ever held (transients
    included); `prompt_tokens`: the prompt's length once it ended; `state`: the method's per-layer state.

    Phases (see `kvtrim.methods.base`): a forward's phase is the one its cache declared
    (`TrimCache.phase(...)`, used by `kvtrim.prefill` / `kvtrim.compress`), else inferred: while the
    prompt is open every multi-token forward (and the very first forward) is a prompt block; the first
    single-token forward after it is a decode step and ends the prompt first; after the prompt,
    multi-token forwards are appends and single tokens decode steps.
    """

    def __init__(self, method: EvictionMethod, layer_idx: int, owner: TrimCache | None = None,
                 in_place_decode: bool = True):
        super().__init__(owner)
        self.method, self.layer_idx = method, layer_idx
        #: decode steps of methods with `in_place_decode` reuse the slot they freed (module docstring)
        self.in_place_decode = in_place_decode
        self._step_in_place = False  # this forward runs in place (the method's views say so)
        #: every position this layer stored is its token's index (0, 1, 2, ... as fed: no custom position
        #: ids), so the last `m` tokens appended sit at positions `seen - m` .. `seen - 1`
        self.counted_positions = True
        self.peak = self.evictions = 0
        self.prompt_tokens: int | None = None
        self.state = method.new_state(layer_idx)
        self.attn_scaling: float | None = None  # the softmax scale handed over by kvtrim's attention
        # (phase, ends the prompt, entries appended, pass info) of this forward
        self._forward: tuple[Phase, bool, int, Any] = (Phase.PREFILL, False, 0, None)
        self._scoring: tuple[torch.Tensor, ...] | None = None  # a scoring pass's transient (keys, values, positions)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, padded: bool = False) -> None:
        """The first forward: dense storage, or (a padded batch, `padded`) ragged storage from the start
        and per-sequence bookkeeping (pads are never stored)."""
        self.device, self.is_initialized = key_states.device, True
        self.kv = switch.empty(key_states, value_states, padded)
        if padded:
            self.seq, self.state = PaddedBatch.start(self.method, self.layer_idx, key_states.shape[0]), None

    def resume(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, seen: int,
               prompt_tokens: int | None, state: Any, free_slot: int | None = None) -> None:
        """Start this new layer from entries kept elsewhere, as if it had seen `seen` tokens and kept these:
        `keys`, `values` `(batch, kv_heads, n, head_dim)` at `positions` `(batch, kv_heads, n)` (ascending per
        head), the prompt's length once it ended, and the method's per-layer `state` (kvtrim's vLLM worker
        resumes a request this way from its blocks at each of its compactions). Dense storage.

        In slot order instead (positions in any order) when the layer's next forward is a single-token decode
        step that runs in place (`in_place_decode`: in-place layers hold their entries in slot order), with
        `free_slot`: the slot (the same in every row) whose entry is gone, where that step's entry is written
        (kvtrim's vLLM worker resumes a StreamingLLM request this way at the hole its last step left)."""
        check(not self.is_initialized, "only a new cache layer can resume from kept entries")
        check(keys.shape == values.shape[:-1] + keys.shape[-1:] and positions.shape == keys.shape[:-1],
              f"resume: keys {tuple(keys.shape)}, values {tuple(values.shape)} and positions "
              f"{tuple(positions.shape)} do not describe the same entries")
        self.device, self.is_initialized = keys.device, True
        if free_slot is None:
            self.kv = DenseKV(keys, values, positions)
        else:
            self.kv = SlotKV(keys, values, positions, torch.full(keys.shape[:2], free_slot, device=keys.device))
        self.seen, self.prompt_tokens, self.state = seen, prompt_tokens, state
        self.peak = keys.shape[-2]

    # ---- phases ------------------------------------------------------------------------------
    def _phase_of(self, q: int) -> tuple[Phase, bool, Any]:
        owner = self.owner
        declared = None if owner is None else owner._declared
        if declared is not None:
            phase, ends, info = declared
            check(phase not in (Phase.PREFILL, Phase.SCORE) or self.prompt_tokens is None,
                  "the prompt of this cache already ended: later forwards are appends or decode steps")
            return phase, ends, info
        length = None if owner is None else owner.prompt_length
        if self.prompt_tokens is None and length is not None:
            check(self.seen + q <= length or self.seen >= length,
                  f"this forward brings the cache to {self.seen + q} tokens, past the prompt_length={length} it was "
                  "given: the prompt must end at the end of a forward")
            if self.seen < length:  # evict inside the forward that ends the prompt, each layer after its attention
                return Phase.PREFILL, self.seen + q == length and not self.method.cross_layer, None
        if self.prompt_tokens is None and (q > 1 or self.seen == 0):
            return Phase.PREFILL, False, None
        return (Phase.APPEND if q > 1 else Phase.DECODE), False, None

    def view(self, queries: torch.Tensor | None = None, attention: torch.Tensor | None = None,
             attention_sums: torch.Tensor | None = None) -> LayerView:
        """The read-only view a method gets, for the current forward (in a scoring pass: the stored
        entries followed by the pass's own, which are not stored; in a ragged layer: the padded view,
        `valid` marking the stored entries)."""
        phase, ends, n_new, info = self._forward
        if self._scoring is not None:
            (keys, values, positions), valid = self._scoring, None
        elif self._ragged_step is not None:  # this step's padded view, built once
            p = self.padded_view()
            keys, values, positions, valid = p.keys, p.values, p.positions, p.valid
        else:
            keys, values, positions, valid = self.kv.view()
        return LayerView(
            keys=keys, values=values, positions=positions, layer_idx=self.layer_idx,
            seen=self.seen, n_new=n_new, phase=phase, prompt_end=ends, prompt_tokens=self.prompt_tokens,
            state=self.state, queries=queries, attention=attention, scaling=self.attn_scaling, pass_info=info,
            valid=valid, in_place=self._step_in_place, counted_positions=self.counted_positions,
            attention_sums=attention_sums,
        )

    def _decide(self, hook: str, queries=None, attention: torch.Tensor | None = None,
                attention_sums: torch.Tensor | None = None):
        """Call the method's `hook` (`on_update`, `on_attention`, `on_prompt_end`) and return its keep (a
        padded batch: once per sequence, `PaddedBatch.decide`)."""
        if self.seq is None:
            return getattr(self.method, hook)(self.view(queries=queries, attention=attention,
                                                        attention_sums=attention_sums))
        check(attention_sums is None, "attention sums are handed to unpadded layers only")
        return self.seq.decide(self.method, hook, self.padded_view(), self._forward, self.layer_idx,
                               self.attn_scaling, queries, attention)

    def _start_prompt_end(self) -> None:
        """Mark the prompt ended (global and per-sequence counts)."""
        self.prompt_tokens = self.seen
        if self.seq is not None:
            self.seq.end_prompt()

    def end_prompt(self) -> None:
        """End the prompt now (deferred end): one-shot methods compress what is stored. Idempotent."""
        if self.prompt_tokens is not None:
            return
        self._start_prompt_end()
        if not self.is_initialized:
            return
        self._forward = (Phase.PREFILL, True, 0, None)
        if self.seq is not None:
            self.seq.deferred_prompt_end()
        queries, self._prompt_queries = self._prompt_queries, None
        self.evict(self._decide("on_prompt_end", queries=queries))

    # ---- the forward ---------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None, counted: bool = False,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `(batch, kv_heads, q, head_dim)` states; return the full states, keep the method's subset.
        `positions`: `(batch, q)` of the new tokens (default `seen + arange(q)`; `counted`: they are that).
        `valid`: `(batch, q)` bool, False for pads: a layer whose first forward has pads is a padded batch's
        for good (ragged, never stores a pad, the method run per sequence: `kvtrim.padded_batch`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states, padded=valid is not None)
        elif valid is not None and self.seq is None:
            raise KvtrimError("padding appeared after the first forward of this cache: pad the batch from its "
                              "first forward (left padding, as transformers' generate does)")
        self._check_handed_over()
        b, h, q = key_states.shape[:3]
        self._step_in_place = False
        phase, ends, info = self._phase_of(q)
        if phase not in (Phase.PREFILL, Phase.SCORE) and self.prompt_tokens is None:
            owner = self.owner  # a cross-layer method ends the prompt of every layer at once
            owner.end_prompt() if owner is not None and self.method.cross_layer else self.end_prompt()
        if positions is None:
            positions, counted = torch.arange(self.seen, self.seen + q, device=self.device).expand(b, q), True
        if not counted and phase is not Phase.SCORE:  # a scoring pass stores nothing
            self.counted_positions = False
        positions = positions[:, None, :].expand(b, h, q)
        if self.seq is not None:
            check(phase is not Phase.SCORE, "scoring passes are not supported on a padded batch")
            self.seq.start_forward(valid, b, q)
        in_place = self._runs_in_place(phase, q)
        if not in_place:
            self.settle()
        if phase is Phase.SCORE:
            return self._scoring_pass(key_states, value_states, positions, info)
        self.kv.append(key_states, value_states, positions, valid=valid)
        self._step_in_place = in_place
        self.seen += q
        self.peak = max(self.peak, self.stored)
        if ends:
            self._start_prompt_end()
        self._forward = (phase, ends, q, info)
        full = self.kv.rect()  # attend, then evict: this step attends to everything just appended
        if full is None:  # ragged: kvtrim's attention attends to the step's padded view, and must run
            self._ragged_step = [None, positions[:, 0, :], True, valid]
        keep = self._decide("on_update")
        if keep is not None and full is None:
            self.padded_view()  # the view taken before the eviction
            self._ragged_step[2] = False
        self.evict(keep)
        self._awaiting_attention = full is None or self.method.waits_for_attention
        _PENDING_LAYER.set(weakref.ref(self))  # also lets kvtrim's attention check the layer kind
        if full is None:
            full = (view := self.padded_view()).keys, view.values
        return full[0], full[1]

    def _check_handed_over(self) -> None:
        """The previous layer of this cache waiting for its attention must have had it."""
        previous = _pending()
        unanswered = self._awaiting_attention or (
            previous is not None and previous is not self and previous._awaiting_attention
            and previous.owner is not None and previous.owner is self.owner)
        if unanswered:  # the previous layer's attention never handed over its queries
            raise KvtrimError(f"{type(self.method).__name__} needs kvtrim's attention function: call "
                              "kvtrim.enable(model) or load the model with kvtrim.load_model()")

    def _scoring_pass(self, key_states, value_states, positions, info) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend to everything, store nothing, do not advance: the method's `on_attention` sees it."""
        check(not self.kv.ragged, "scoring passes over a ragged cache layer are not supported")
        check(self.method.waits_for_attention, f"{type(self.method).__name__} has no scoring passes")
        keys, values, stored = self.kv.rect()
        self._scoring = (torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2),
                         torch.cat([stored, positions], dim=-1))
        self._forward = (Phase.SCORE, False, key_states.shape[2], info)
        self.peak = max(self.peak, self._scoring[0].shape[-2])
        self._awaiting_attention = True
        _PENDING_LAYER.set(weakref.ref(self))
        return self._scoring[0], self._scoring[1]

    def _runs_in_place(self, phase: Phase, q: int) -> bool:
        """This forward may run in place: a single-token decode step of a dense, unpadded layer whose
        method opted in (`in_place_decode`), whose tensors may be written."""
        return (q == 1 and phase is Phase.DECODE and self.in_place_decode and self.method.in_place_decode
                and self.seq is None and (rect := self.kv.rect()) is not None
                # tensors made under torch.inference_mode cannot be written outside it: copy instead
                and not (rect[0].is_inference() and not torch.is_inference_mode_enabled()))

    def settle(self) -> None:
        """Put a layer that in-place decoding left in slot order back in position order, without its free
        slots: one gather of the live entries, as an eviction (the method's state follows through
        `gather_state`). Called before any forward that does not run in place; a no-op otherwise."""
        settled = switch.settle(self.kv)
        if settled is not None:
            self.kv, order = settled
            self.state = self.method.gather_state(self.state, order)

    @property
    def awaiting_attention(self) -> bool:
        """True between `update` and `after_attention` for methods that need queries or probabilities."""
        return self._awaiting_attention

    def after_attention(
        self, queries: torch.Tensor | None, attention: torch.Tensor | None, scaling: float | None = None,
        attention_sums: torch.Tensor | None = None,
    ) -> None:
        """Called by kvtrim's attention function once this layer's attention output is computed.

        `queries`: `(batch, q_heads, q, head_dim)` post-RoPE; `attention`: `(batch, q_heads, 1, n)`
        probabilities of a single-token step (methods with `needs_attention`), else None; `scaling`: the
        softmax scale the layer used; `attention_sums`: a prompt forward's reduced attention instead of its
        queries (`LayerView.attention_sums`; the vLLM engine's hand-over to H2O)."""
        self._awaiting_attention = False
        if _pending() is self:
            _PENDING_LAYER.set(None)
        self.attn_scaling = scaling
        step, self._ragged_step = self._ragged_step, None
        if not self.method.waits_for_attention:  # a ragged layer's hand-off: the method decided in update
            return
        if step is not None and step[2]:  # nothing evicted since the append: the step's view is current
            self._ragged_step = step
        try:
            self._after_attention(queries, attention, attention_sums)
        finally:
            self._ragged_step = None

    def _after_attention(self, queries: torch.Tensor | None, attention: torch.Tensor | None,
                         attention_sums: torch.Tensor | None = None) -> None:
        phase, ends, _, _ = self._forward
        if phase is Phase.SCORE:  # the pass only informs the method's state; its entries go
            keep = self.method.on_attention(self.view(queries=queries, attention=attention))
            check(keep is None, "a scoring pass cannot evict")
            self._scoring = None
            return
        tail = self.method.prompt_queries()
        if phase is Phase.PREFILL and not ends and tail and queries is not None:  # for a deferred prompt end
            # a copy: a slice would keep the forward's whole (batch, q_heads, q, head_dim) queries alive in
            # every layer until the prompt ends (at 32k tokens, 8 GiB more than the cache on Llama-3.1-8B)
            self._prompt_queries = (queries[:, :, -tail:].clone() if self.seq is None
                                    else self.seq.tail_queries(queries, tail, self._prompt_queries))
        self.evict(self._decide("on_attention", queries=queries, attention=attention, attention_sums=attention_sums))

    def cancel_attention(self) -> None:
        """Stop waiting for an attention hand-off that will not come (e.g. a model without kvtrim attention)."""
        self._awaiting_attention = False
        self._scoring = self._ragged_step = None
        if _pending() is self:
            _PENDING_LAYER.set(None)

    def evict(self, keep) -> None:
        """Reduce the layer to the kept entries (None: keep all), then the method's state. `keep`: indices
        `(batch, kv_heads, n_keep)` sorted ascending, a bool mask `(batch, kv_heads, n)` or indices padded
        with -1 (converted once, `kvtrim.storage.as_keep`; unequal counts make the layer ragged:
        `storage.switch`); `EvictOne` (in-place steps: the slot stays, free for the next step's entry); a
        padded batch's per-sequence decisions (`PerSequence`, one keep mask)."""
        if keep is None:
            return
        self.evictions += 1
        if isinstance(keep, EvictOne):
            check(self._step_in_place and self.free_slots is None,
                  "EvictOne is only for in-place decode steps (view.in_place)")
            self.kv = switch.to_slots(self.kv, keep.slots)
            self.state = self.method.free_state(self.state, keep.slots)
            return
        if isinstance(keep, PerSequence):  # each sequence's state was reduced with its own keep
            self.kv.evict(as_keep(self.seq.keep_mask(self.method, keep), self.kv.width, self.kv.lengths))
            return
        keep = as_keep(keep, self.kv.width, self.kv.lengths)
        self.kv = switch.evict(self.kv, keep, self._check_may_go_ragged)
        self.state = self.method.gather_state(self.state, keep.indices)

    def fill_free_slots_from_last(self) -> torch.Tensor:
        """After an in-place decode step that freed one slot per row (`EvictOne`): the entry in the last slot
        fills each row's free slot, the method's state following (`gather_state`); the last slot is free
        afterwards, for the next step's entry (kvtrim's vLLM worker moves the entries in its blocks the same
        way, so the layer stays in the blocks' slot order). Returns the slot order applied
        (`SlotKV.fill_free_from_last`)."""
        check(getattr(self.kv, "free_slots", None) is not None, "fill_free_slots_from_last needs a freed slot per row")
        order = self.kv.fill_free_from_last()
        self.state = self.method.free_state(self.method.gather_state(self.state, order), self.kv.free_slots)
        return order

    def _check_may_go_ragged(self) -> None:
        owner = self.owner
        check(owner is None or owner.kvtrim_attention,
              f"{type(self.method).__name__} keeps different numbers of entries per head, which needs "
              "kvtrim's attention function: call kvtrim.enable(model) or load the model with "
              "kvtrim.load_model() (no kvtrim attention has run on this cache yet)")

    # ---- operations that do not survive eviction ---------------------------------------------
    def reset(self) -> None:
        self.cancel_attention()
        self.__init__(self.method, self.layer_idx, self.owner, self.in_place_decode)

@dataclass
class CacheStats:
    """What a cache holds. Entries are counted per KV head (one entry = one token of one head).

    `stored_per_layer`: entries per row of each layer (a ragged layer: its longest row);
    `lengths_per_layer`: per layer, the `[batch][kv_head]` stored lengths; `bytes_stored` = `bytes_ideal`:
    `sum(lengths) × head_dim × 2 × element size` over all layers; `bytes_allocated`: the storage sizes of
    the key and value tensors the cache holds (measured from the tensors, each storage counted once)."""

    tokens_seen: int
    stored_per_layer: list[int]
    peak_per_layer: list[int]
    bytes_stored: int  # keys + values of the stored entries (= bytes_ideal)
    bytes_full: int  # keys + values a DynamicCache would hold for the same tokens
    bytes_bookkeeping: int  # positions, slot tables and method state
    evicting_layers: list[int] = field(default_factory=list)
    lengths_per_layer: list[list[list[int]]] = field(default_factory=list)
    bytes_allocated: int = 0
    ragged_layers: list[int] = field(default_factory=list)

    @property
    def bytes_ideal(self) -> int:
        return self.bytes_stored

    @property
    def mean_stored_per_layer(self) -> list[float]:
        """Entries per (sequence, kv_head) row of each layer, on average (= `stored_per_layer` when dense)."""
        return [sum(map(sum, rows)) / max(1, sum(map(len, rows))) for rows in self.lengths_per_layer]

    @property
    def compression_ratio(self) -> float:
        """Achieved fraction of KV bytes removed (0 = full cache)."""
        return 0.0 if self.bytes_full == 0 else 1.0 - self.bytes_stored / self.bytes_full

    def as_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        d["compression_ratio"] = self.compression_ratio
        d["bytes_ideal"] = self.bytes_ideal
        return d

    def summary(self) -> str:
        ragged = bool(self.ragged_layers)  # rows differ: the mean row of each layer
        stored = [round(x) for x in self.mean_stored_per_layer] if ragged else self.stored_per_layer
        lo, hi = (min(stored), max(stored)) if stored else (0, 0)
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return (
            f"tokens seen {self.tokens_seen}, stored {span} per {'head (mean) and ' if ragged else ''}layer, "
            f"KV bytes {self.bytes_stored / 2**20:.2f} MiB of {self.bytes_full / 2**20:.2f} MiB full "
            f"(compression ratio {self.compression_ratio:.3f}, allocated {self.bytes_allocated / 2**20:.2f} MiB, "
            f"{len(self.ragged_layers)} ragged layers, bookkeeping {self.bytes_bookkeeping / 2**10:.1f} KiB)"
        )

    def __str__(self) -> str:  # `print(cache.stats())`: the one-line summary, not the dataclass repr
        return f"CacheStats({self.summary()})"


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _allocated(tensors, seen_storages: set) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views share theirs)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen_storages:
            continue
        seen_storages.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class TrimCache(Cache):
    """A cache that evicts with `method` in every full-attention layer.

    Args:
        method: an `EvictionMethod` (default: `FullCache()`, which keeps everything).
        config: the model config. Needed for models with sliding-window layers (e.g. Gemma-3): those
            layers are left alone (they already bound themselves); only full-attention layers evict.
            Without it, every layer is created lazily as an evicting layer.
        padded: treat the batch as a padded batch from its first forward even if that forward has no pads
            (so that later forwards may bring some, e.g. questions of different lengths); default False:
            a batch is padded when its first forward's attention mask has pads.
        in_place_decode: decode steps of methods that evict one entry per step (H2O, TOVA, StreamingLLM
            with a budget) reuse the freed slot instead of copying the layer (default True; storage order
            is then slot order, see the module docstring); False: every step copies, as before.
        prompt_length: the prompt's length in tokens (columns of a padded batch), when known: the forward
            that completes it ends the prompt and every layer evicts right after its attention in that
            forward (the lowest peak: one layer's whole prompt at a time, as `kvtrim.prefill`). Without it
            every layer holds its whole prompt until the prompt ends at the first decode step (the same
            kept entries and tokens, a higher peak). A forward running past it is an error. Cross-layer
            methods (KVzip) still end the prompt after the forward, at the first decode step.

    Use: `model.generate(ids, cache=TrimCache(LagKV(), config=model.config, prompt_length=ids.shape[-1]))`.

    Padded batches (`model.generate(ids, attention_mask=mask, cache=TrimCache(method))` with left padding,
    or right padding in a prefill forward) need kvtrim's attention (`kvtrim.enable(model)` /
    `kvtrim.load_model`), whose mask builder tells the cache which tokens are pads: pads are never stored
    (every layer is ragged from the first forward), each sequence keeps its own positions, and the method
    runs once per sequence on a batch-1 view of that sequence (`TrimLayer.sequence_view`): the kept
    entries are those of the sequence run alone (budgets and `compression_ratio` per sequence).

    The prompt: everything before the first generated token, unless told otherwise. `kvtrim.prefill`
    and `kvtrim.compress` declare their forwards (`phase(...)`) and end the prompt themselves; with
    `prompt_length=` the forward reaching that length ends it; otherwise, after a plain
    `model(ids, cache=cache)` call, the prompt ends at the first single-token forward, or when
    `end_prompt()` is called. Later multi-token forwards are appends (a question, a new turn).
    """

    def __init__(self, method: EvictionMethod | None = None, config=None, padded: bool = False,
                 in_place_decode: bool = True, prompt_length: int | None = None):
        check(isinstance(padded, bool), f"padded must be true or false, got {padded!r}")
        check(prompt_length is None or (isinstance(prompt_length, int) and not isinstance(prompt_length, bool)
                                        and prompt_length >= 1),
              f"prompt_length must be a positive number of tokens, got {prompt_length!r}")
        #: the prompt's length when known before its forwards (`model.generate`'s input length): the forward
        #: that reaches it ends the prompt, and each layer evicts right after its own attention in that
        #: forward, so no layer holds its whole prompt past its turn (None: the prompt ends at the first
        #: single-token forward or at `end_prompt()`, every layer holding its whole prompt until then)
        self.prompt_length = prompt_length
        check(isinstance(in_place_decode, bool), f"in_place_decode must be true or false, got {in_place_decode!r}")
        #: decode steps that evict one entry per row reuse its slot instead of copying the layer (methods
        #: with `in_place_decode`; see the module docstring); False: the copying path
        self.in_place_decode = in_place_decode
        #: True: a padded batch from the first forward even without pads in it (later forwards may bring
        #: some: questions of different lengths after a compressed context); set by `kvtrim.compress`
        self.padded = padded
        self.method = method if method is not None else FullCache()
        if not isinstance(self.method, EvictionMethod):
            raise KvtrimError(f"TrimCache expects an eviction method, got {type(self.method).__name__}")
        layers: list = []
        if config is not None:
            self.method.check_config(config)
            types, per_layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            for idx, (kind, kwargs) in enumerate(zip(types, per_layer_kwargs)):
                if kind == "full_attention":
                    layers.append(TrimLayer(self.method, idx, owner=self, in_place_decode=in_place_decode))
                elif kind in ("sliding_attention", "chunked_attention"):
                    layers.append(DynamicSlidingWindowLayer(**kwargs))
                else:
                    raise KvtrimError(f"layer type '{kind}' (layer {idx}) is not supported by kvtrim yet")
        if layers:
            super().__init__(layers=layers)
        else:
            super().__init__(layer_class_to_replicate=DynamicLayer)  # only used for its bookkeeping
        self._step_key: tuple[int, int] | None = None
        self._step_positions: torch.Tensor | None = None
        self._step_valid: torch.Tensor | None = None
        self._step_counted = False
        #: True once kvtrim's attention function ran on this cache (or the caller knows the model runs it:
        #: `kvtrim.prefill` / `kvtrim.compress`); a layer only turns ragged then (stock attention cannot mask it)
        self.kvtrim_attention = False
        self._declared: tuple[Phase, bool] | None = None

    # ---- phases ------------------------------------------------------------------------------
    @contextmanager
    def phase(self, phase: Phase, ends_prompt: bool = False, info: Any = None):
        """Declare the phase of the forwards run inside the block (`ends_prompt`: this forward is the
        prompt's last; `info`: what a scoring pass tells the method, `view.pass_info`).
        `with cache.phase(Phase.PREFILL, ends_prompt=True): model(ids, cache=cache)`."""
        check(isinstance(phase, Phase), f"phase must be a kvtrim Phase, got {phase!r}")
        check(not ends_prompt or phase is Phase.PREFILL, "only a prompt forward (Phase.PREFILL) can end the prompt")
        check(not (ends_prompt and self.method.cross_layer),
              f"{type(self.method).__name__} decides across layers: end its prompt with cache.end_prompt()")
        previous, self._declared = self._declared, (phase, ends_prompt, info)
        try:
            yield self
        finally:
            self._declared = previous

    @property
    def prompt_ended(self) -> bool:
        """True once the prompt ended (appends and decode steps follow)."""
        layers = self.trim_layers()
        return bool(layers) and all(layer.prompt_tokens is not None for layer in layers)

    def end_prompt(self) -> None:
        """End the prompt now: one-shot methods compress what every layer stores (idempotent). A
        cross-layer method first decides every layer's kept entries at once (`select_layers`)."""
        layers = [layer for layer in self.trim_layers() if layer.prompt_tokens is None]
        check(not (self.method.cross_layer and any(layer.per_sequence for layer in layers)),
              f"{type(self.method).__name__} decides across layers, which is not supported on a padded batch yet: "
              "run its sequences one at a time")
        if self.method.cross_layer and layers and all(layer.is_initialized for layer in layers):
            for layer in layers:
                layer._forward = (Phase.PREFILL, True, 0, None)
                layer.prompt_tokens = layer.seen
            keeps = self.method.select_layers([layer.view() for layer in layers])
            check(len(keeps) == len(layers), "select_layers must return one entry per evicting layer")
            for layer, keep in zip(layers, keeps):
                layer.evict(keep)
                layer.prompt_tokens = None
        for layer in layers:
            layer.end_prompt()

    def trim_layers(self) -> list[TrimLayer]:
        """The evicting layers (sliding-window layers of hybrid models excluded)."""
        return [layer for layer in self.layers if isinstance(layer, TrimLayer)]

    def copy(self) -> TrimCache:
        """An independent copy: asking it a question leaves this cache unchanged."""
        new = copy.copy(self)
        new.layers = [layer.copy(owner=new) if isinstance(layer, TrimLayer) else copy.deepcopy(layer)
                      for layer in self.layers]
        new._declared = None
        return new

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(TrimLayer(self.method, len(self.layers), owner=self,
                                         in_place_decode=self.in_place_decode))
        layer = self.layers[layer_idx]
        if not isinstance(layer, TrimLayer):
            return layer.update(key_states, value_states, *args, **kwargs)
        positions, valid, counted = self._step(layer, key_states, kwargs.get("kwargs") or {})
        return layer.update(key_states, value_states, positions=positions, valid=valid, counted=counted)

    def _step(self, layer: TrimLayer, key_states: torch.Tensor,
              model_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """True positions `(batch, q)` of the new tokens, which are real `(batch, q)` bool (None: all), and
        whether the positions are the layer's default count (`seen + arange(q)`), worked out once per forward.

        The models hand their `position_ids` to `update`; `generate` derives them from the attention mask
        (each sequence of a left-padded batch counts from 0 at its first real token). Which tokens are
        pads comes from the forward's 2D attention mask, recorded by kvtrim's mask builders (its last q
        columns). Without that record (stock attention), rows whose positions differ or do not count up
        by one are refused: a padded batch needs kvtrim's attention.
        """
        b, q = key_states.shape[0], key_states.shape[2]
        key = (layer.seen, q)
        if key == self._step_key and self._step_positions is not None:
            return self._step_positions, self._step_valid, self._step_counted
        recorded, mask = _take_padding_mask()
        valid = None
        if mask is not None:
            check(mask.shape[0] == b and mask.shape[-1] >= q,
                  f"the attention mask {tuple(mask.shape)} does not cover this forward's {b} x {q} tokens")
            valid = mask[:, -q:].to(device=key_states.device, dtype=torch.bool)
            if bool(valid.all()):
                valid = None
        if valid is None and self.padded and not layer.is_initialized:
            valid = torch.ones(b, q, dtype=torch.bool, device=key_states.device)  # per sequence from the start
        padded = valid is not None or layer.per_sequence
        expected = torch.arange(layer.seen, layer.seen + q, device=key_states.device)
        positions = expanded = expected.expand(b, q)
        given = model_kwargs.get("position_ids")
        if isinstance(given, torch.Tensor) and given.ndim == 2 and given.shape[-1] == q:
            given = given.to(key_states.device).expand(b, q)
            if padded:
                positions = given
            elif not torch.equal(given, positions):
                rows_equal = bool((given == given[:1]).all())
                counts_up = q == 1 or bool((given.diff(dim=-1) == 1).all())
                if not (rows_equal and counts_up):
                    raise KvtrimError(
                        "a padded batch (sequences with their own positions) needs kvtrim's attention function "
                        "and the batch's attention_mask: call kvtrim.enable(model) or load the model with "
                        "kvtrim.load_model()" + ("" if recorded else " (no kvtrim attention mask was built)")
                    )
                positions = given
        counted = positions is expanded and not padded
        self._step_key, self._step_positions, self._step_valid, self._step_counted = key, positions, valid, counted
        return positions, valid, counted

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        stored, peak, evicting, lengths, ragged = [], [], [], [], []
        bytes_stored = bytes_full = bookkeeping = allocated = 0
        seen = 0
        storages: set = set()
        for idx, layer in enumerate(self.layers):
            if not getattr(layer, "is_initialized", False):
                continue
            if isinstance(layer, TrimLayer):
                kv = layer.ideal_bytes()
                allocated += _allocated(layer.kv_tensors(), storages)
                rows = layer.lengths
                lengths.append(rows.tolist())
                stored.append(layer.stored)
                evicting.append(idx)
                peak.append(layer.peak)
                seen = max(seen, layer.seen)
                b, h = rows.shape
                head_dim = layer.kv.head_dim
                element = layer.kv_tensors()[0].element_size()
                # a padded batch: the real tokens of each sequence (a full cache never stores the pads)
                tokens = sum(layer.seq.seen) if layer.per_sequence else b * layer.seen
                bytes_full += tokens * h * head_dim * 2 * element
                if layer.is_ragged:
                    ragged.append(idx)
                bookkeeping += layer.kv.bookkeeping_bytes()
                bookkeeping += sum(_nbytes(t) for t in _tensors(layer.state))
                if layer.per_sequence:
                    bookkeeping += sum(_nbytes(t) for t in _tensors(layer.seq.states))
            else:
                kv = _nbytes(layer.keys) + _nbytes(layer.values)
                allocated += _allocated((layer.keys, layer.values), storages)
                b, h, n = layer.keys.shape[:3]
                lengths.append([[n] * h for _ in range(b)])
                stored.append(n)
                peak.append(n)
                seen = max(seen, layer.get_seq_length())
                bytes_full += kv
            bytes_stored += kv
        return CacheStats(seen, stored, peak, bytes_stored, bytes_full, bookkeeping, evicting, lengths, allocated,
                          ragged)

