"""`StoredLayer`: the storage-facing half of a cache layer (`kvtrim.cache.TrimLayer` is the other half,
the phase machine and the method calls).

What the layer holds, read through its `kv` (a `kvtrim.storage.LayerStorage`): `keys` / `values` /
`positions` (a dense layout's own tensors), `storage` (a ragged layout), `lengths`, `stored`, byte counts;
the logical vs physical lengths `transformers` asks for (`get_seq_length`, `get_mask_sizes`); and the batch
row operations (beam reorder, select, repeat), under which storage, method state and a padded batch's
per-sequence bookkeeping follow their sequence. Nothing here calls a method's hooks.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import is_dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvtrim.methods.base import KvtrimError, LayerView, check
from kvtrim.padded_batch import PaddedBatch
from kvtrim.storage import LayerStorage, PaddedView, RaggedKV


def _map_tensors(obj: Any, fn) -> Any:
    """Apply `fn` to every tensor held directly by `obj` (a tensor, dict, list or dataclass)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        for name, value in vars(obj).items():
            setattr(obj, name, _map_tensors(value, fn))
    return obj


class StoredLayer(DynamicLayer):
    """A cache layer's entries and counts (see the module docstring).

    Attributes:
        kv: the layer's storage (None before the first update). seen: tokens seen by this layer.
        owner: the `TrimCache` the layer belongs to (a weak reference; None for a layer alone).
        state: the method's per-layer state (None in a padded batch: `seq.states`, one per sequence).
        seq: a padded batch's per-sequence bookkeeping (`kvtrim.padded_batch.PaddedBatch`), else None.
    """

    is_croppable = False

    def __init__(self, owner=None):
        self.kv: LayerStorage | None = None
        super().__init__()
        self._owner = None if owner is None else weakref.ref(owner)
        self._awaiting_attention = False  # between `update` and the attention hand-off (see TrimLayer)
        self.seen = 0
        self.state: Any = None
        self.seq: PaddedBatch | None = None
        self._prompt_queries = None  # kept for a deferred prompt end (a padded batch: one per sequence)
        # a ragged layer's step, for kvtrim's attention: [padded view or None, query positions (b, q),
        # whether the storage still ends with this step's entries (nothing evicted since the append), valid]
        self._ragged_step: list | None = None

    @property
    def owner(self) -> Any:
        return None if self._owner is None else self._owner()

    def copy(self, owner: Any = None) -> StoredLayer:
        """An independent copy (tensors cloned, state deep-copied) belonging to `owner`."""
        check(not self._awaiting_attention, "cannot copy a cache layer in the middle of a forward")
        new = copy.copy(self)
        new._owner = None if owner is None else weakref.ref(owner)
        new.kv = None if self.kv is None else self.kv.clone()
        queries = self._prompt_queries
        new._prompt_queries = None if queries is None else list(queries) if isinstance(queries, list) else queries.clone()
        new._ragged_step = None
        new.state = copy.deepcopy(self.state)
        new.seq = copy.deepcopy(self.seq)
        return new

    # ---- what the layer holds ----------------------------------------------------------------------
    def _rect_part(self, i: int) -> torch.Tensor | None:
        rect = None if self.kv is None else self.kv.rect()
        return None if rect is None else rect[i]

    def _set_rect_part(self, name: str, value: torch.Tensor | None) -> None:
        """`layer.keys = ...` (transformers' offloading and `reset`): a dense layout's own tensor."""
        if self.kv is None or self.kv.rect() is None:
            check(value is None, f"{name} of a ragged or empty layer cannot be set")
            return
        setattr(self.kv, name, value)

    #: `(batch, kv_heads, n_stored, head_dim)` (None once the layer is ragged)
    keys = property(lambda self: self._rect_part(0), lambda self, v: self._set_rect_part("keys", v))
    values = property(lambda self: self._rect_part(1), lambda self, v: self._set_rect_part("values", v))
    #: `(batch, kv_heads, n_stored)` original position of each entry (None once ragged: `storage.positions`)
    positions = property(lambda self: self._rect_part(2), lambda self, v: self._set_rect_part("positions", v))

    @property
    def storage(self) -> RaggedKV | None:
        """The `RaggedKV` of a ragged layer, else None."""
        return self.kv if self.kv is not None and self.kv.ragged else None

    @storage.setter
    def storage(self, value: RaggedKV | None) -> None:
        if value is not None:
            self.kv = value

    @property
    def is_ragged(self) -> bool:
        """True once rows hold different numbers of entries (stored in `storage`)."""
        return self.kv is not None and self.kv.ragged

    @property
    def per_sequence(self) -> bool:
        """True for the layers of a padded batch: the method decides once per sequence (`kvtrim.padded_batch`)."""
        return self.seq is not None

    @property
    def free_slots(self) -> torch.Tensor | None:
        """`(batch, kv_heads)` the free slot of each row after an in-place eviction (None: no free slot)."""
        return getattr(self.kv, "free_slots", None)

    def padded_view(self) -> PaddedView:
        """A ragged layer's padded view `(batch, kv_heads, width, ...)`; built once per step (transient)."""
        check(self.is_ragged, "padded_view is for ragged layers")
        step = self._ragged_step
        if step is not None and step[0] is not None:
            return step[0]
        view = self.kv.padded()
        if step is not None:
            step[0] = view
        return view

    def take_ragged_step(
        self,
    ) -> tuple[PaddedView | None, RaggedKV | None, torch.Tensor, torch.Tensor | None] | None:
        """For kvtrim's attention: `(padded view or None, storage or None, query positions (b, q), real
        queries (b, q) bool or None)` of this ragged step (the storage when it still ends with the step's
        entries: a varlen kernel may read it), or None for a dense layer. The step is cleared by
        `after_attention` (the method's view reuses it). Pad queries (False) see nothing."""
        step = self._ragged_step
        if step is None:
            return None
        view, query_positions, intact, query_valid = step
        return view, (self.storage if intact else None), query_positions, query_valid

    def sequence_view(self, b: int, padded: PaddedView | None = None, queries=None,
                      attention: torch.Tensor | None = None) -> LayerView:
        """What sequence `b` of a padded batch would show the method alone (`PaddedBatch.view`), for the
        current forward."""
        check(self.seq is not None, "sequence_view is for the layers of a padded batch")
        padded = padded if padded is not None else self.padded_view()
        return self.seq.view(b, padded, self._forward, self.layer_idx, self.attn_scaling, queries, attention)

    def kept_positions(self) -> torch.Tensor | None:
        """`(batch, kv_heads, n)`: the positions of the stored entries, ascending per row whatever the storage
        order (in-place decoding keeps them in slot order; free slots left out). A ragged layer: its
        storage's positions (-1 past each row's length). None before the first update."""
        return None if self.kv is None else self.kv.kept_positions()

    @property
    def stored(self) -> int:
        """Entries per row of a dense layer; the longest row of a ragged one (the padded view's width)."""
        return 0 if self.kv is None else self.kv.width

    @property
    def lengths(self) -> torch.Tensor | None:
        """`(batch, kv_heads)` int64: entries stored per (sequence, kv_head) row (None before the first update)."""
        return None if self.kv is None else self.kv.lengths.clone()

    def kv_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this layer's keys and values (the pools of a ragged layer)."""
        return [] if self.kv is None else self.kv.kv_tensors()

    def entry_bytes(self) -> int:
        """Bytes of one token of every (sequence, kv_head) row: its key and value (0 before the first update)."""
        return 0 if self.kv is None else self.kv.entry_bytes()

    def dense_shape(self) -> tuple[int, int, int, int] | None:
        """`(batch, kv_heads, n, head_dim)` of a dense layer holding as many entries (a ragged layer: its
        mean row length, rounded up); None before the first update."""
        return None if self.kv is None else self.kv.dense_shape()

    def ideal_bytes(self) -> int:
        """`sum(lengths) × head_dim × 2 × element size`: the bytes of exactly the stored entries."""
        return 0 if self.kv is None else self.kv.ideal_bytes()

    # ---- what transformers asks ----------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, self.seen - self.stored

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise KvtrimError("a TrimCache cannot be cropped (evicted entries cannot be restored)")

    # ---- batch rows ----------------------------------------------------------------------------------
    def _select_batch(self, rows) -> None:
        """Row `i` becomes old sequence `rows(batch)[i]` (`rows`: a function of the batch size giving the
        1-D indices): the storage, the method's state (per sequence in a padded batch), deferred queries."""
        if not self.is_initialized:
            return
        rows = rows(self.kv.batch).to(self.device)
        self.kv.select_batch(rows)
        if self.seq is not None:  # a padded batch: per-sequence state follows its sequence
            picked = rows.tolist()
            self.seq = self.seq.select(picked)
            if self._prompt_queries is not None:
                self._prompt_queries = [self._prompt_queries[i] for i in picked]
            return
        self.state = _map_tensors(self.state, lambda t: t.index_select(0, rows.to(t.device)))
        if self._prompt_queries is not None:
            self._prompt_queries = self._prompt_queries.index_select(0, rows.to(self._prompt_queries.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(lambda b: beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch(lambda b: torch.arange(b).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(lambda b: torch.arange(b, device=indices.device)[indices])
