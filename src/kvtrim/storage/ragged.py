"""Ragged KV storage: every `(sequence, kv_head)` row holds its own number of entries.

Layout — a slot pool (a paged layout whose pages hold one entry):

* `keys_pool`, `values_pool` `(capacity, head_dim)`: one slot per entry, shared by all rows;
* a slot table `(batch, kv_heads, width)` (int32): the slot of the j-th entry of a row, entries in
  ascending position order, beside `positions` `(batch, kv_heads, width)` (int64, -1 past the end);
* `lengths` `(batch, kv_heads)`: entries stored per row; `width` is the longest row;
* a free list of slots. Eviction frees slots without moving any entry; appended entries take free
  slots first, so a decode step that appends one entry and evicts one entry per row copies nothing but
  the new entry (issue #15, item 2). The order of a row is carried by the slot table, sorted by position,
  never by where entries sit in the pool.

Memory bound: `capacity <= (1 + max_waste) * sum(lengths)` after every operation, so the bytes the pools
hold (measured from their storage) stay within `1 + max_waste` of the ideal `sum(lengths) * head_dim * 2 *
element_size`. When the pool must grow it grows by `growth * sum(lengths)` slots of headroom (a copy, like
`torch.cat`, but only every `growth` fraction of growth instead of every step); when eviction leaves more
than `max_waste` free, the survivors are compacted into a pool of exactly their size, rows contiguous in
position order (one `index_select`: the same copy today's dense eviction does, but only for large evictions).

Why slots and not pages of 16 or 256 entries (measured, `benchmarks/ragged/bench_ragged.py`, recorded in
`benchmarks/ragged/results.json`): a page of B entries wastes up to B - 1 slots per row; for 3 KV heads
× batch 1 or 8 with AdaKV-like lengths around a budget, 16-entry pages allocate 1.13-1.15× the ideal bytes
at budget 64, 1.06-1.08× at 128, 1.02-1.04× at 256, so pages would need compaction anyway to meet 1.02×.
Building the padded view from pages is no faster at 1k entries per row (0.91-1.02× the slot gather) and
0.62× at batch 8 × 4k, so pages would pay off for long rows only; and the paged kernels that would read
pages in place (flash-attn's `block_table`) need pages of 256 entries, which the bound rules out for
short rows. A packed layout (rows contiguous, offsets) meets the bound too but must
move every later row to append one entry to a row; the slot pool appends in O(new entries). The price of
slots is bookkeeping: 4 bytes of slot id + 8 bytes of position per entry (vs 256 bytes of K+V per entry for
head_dim 64 in bf16), reported by `bookkeeping_bytes()` and not counted in the KV bound.

Integration with `TrimLayer` / `TrimCache`. Done: one of the layouts behind `kvtrim.storage.LayerStorage`;
a layer stays dense (`kvtrim.storage.dense`) while every row holds the same number of entries, and
`kvtrim.storage.switch.evict` moves that layer alone to `RaggedKV.from_dense(keys, values, positions,
valid=kept)` when a method keeps unequal counts (AdaKV): layers may differ, because a ragged layer's `get_mask_sizes` keeps the dense
formula with its longest row, dense layers refit the shared mask (`kvtrim.attention.fit_mask`) and
ragged layers ignore it (kvtrim's attention calls `ragged_attention` on the step's padded view). A layer
only turns ragged on a cache kvtrim's attention has run on. Attend, then evict: the step's padded view is
taken before any eviction decided in `update`, and the flash path reads the storage only while it still
ends with the step's entries. Methods see the padded view (`LayerView.valid`). AdaKV (`kvtrim.methods.adakv`)
decides once, on a dense layer, with a keep mask.

Padded batches (done, `kvtrim.cache` and `kvtrim.padded_batch`): kvtrim's mask builders (registered through `AttentionMaskInterface`:
the stock builders after a record of the forward's 2D padding mask) tell `TrimCache.update`, which runs
after the mask is built and before attention, which of the step's tokens are pads (the mask's last q
columns); a layer whose first forward has pads is ragged from the start and stores only real tokens
(`append(..., valid=...)`). Positions are each sequence's own (`position_ids`, which `generate` derives
from the mask); `seen` stays the global column count (what `get_seq_length` and the mask sizes use) and
the layer counts each sequence's real tokens for budgets. Ragged layers ignore the model's mask (kvtrim's
attention masks by positions; pad queries see nothing), so `get_mask_sizes` keeps the dense formula.
Scoring: the reference path, not the vectorised one the plan sketched. The method runs once per sequence
on a batch-1 view of that sequence's entries (`PaddedBatch.view`, dense when its heads hold equal
counts), with its own state, token counts and queries of its real tokens; each keep is mapped into one
keep mask over the padded view. Every method gets it through the contract, with no code of its own.
Still a plan:

* Scoring ragged layers in one vectorised call: the scoring base would set invalid scores to -inf,
  compute kept counts per sequence and return a keep mask; per-entry state aligned with the view (H2O's
  scores, LazyEviction's TS/MRI) would follow with `compact(state, mask)`, the rule the slot table uses.
  Scorers must then respect `view.valid` (softmaxes and means over the padded view include filler
  entries today). It would replace the per-sequence loop of padded batches and let AdaKV evict again.
* `as_dense()` is a zero-copy view when rows are equal and packed (unused: a layer stays ragged).
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import check
from kvtrim.storage.base import Keep, PaddedView, compact, keep_mask, row_mask


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class RaggedKV:
    """Keys, values and positions of one layer, `(batch, kv_heads)` rows of their own lengths.

    Build with `RaggedKV.from_dense(...)` or `RaggedKV.empty(...)`; see the module docstring for the layout.
    Implements `kvtrim.storage.LayerStorage` (`view()` is the padded view, `rect()` None).

    Args (keyword, both constructors):
        max_waste: largest allowed fraction of free slots (`capacity <= (1 + max_waste) * stored`).
        growth: headroom added when the pool grows, as a fraction of the stored entries (`< max_waste`).
    """

    ragged = True

    def __init__(self, *, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 max_waste: float = 0.02, growth: float = 0.01):
        check(isinstance(max_waste, float | int) and max_waste >= 0, f"max_waste must be >= 0, got {max_waste}")
        check(isinstance(growth, float | int) and 0 <= growth <= max_waste,
              f"growth must be in [0, max_waste={max_waste}], got {growth}")
        self.max_waste, self.growth = float(max_waste), float(growth)
        self.head_dim = head_dim
        self.keys_pool = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.values_pool = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._slots = torch.zeros(batch, kv_heads, 0, dtype=torch.int32, device=device)
        self._positions = torch.full((batch, kv_heads, 0), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, kv_heads, dtype=torch.long, device=device)
        self._free = torch.empty(0, dtype=torch.long, device=device)
        self._stored = 0  # sum(lengths), kept on the host
        self._width = 0  # max(lengths)
        self._packed = True  # rows back to back from slot 0 in row-major, position order (headroom may follow)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, dtype=torch.float32, device="cpu",
              **kwargs) -> RaggedKV:
        return cls(batch=batch, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device, **kwargs)

    @classmethod
    def from_dense(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None,
                   valid: torch.Tensor | None = None, **kwargs) -> RaggedKV:
        """Storage holding the valid entries of dense `(batch, kv_heads, n, head_dim)` keys/values.

        `positions`: `(batch, n)` or `(batch, kv_heads, n)` (default `arange(n)`); `valid`: `(batch, n)` or
        `(batch, kv_heads, n)` bool (default all True; pads of a padded batch are False and never stored).
        Always copies: the storage never aliases the caller's tensors.
        """
        check(keys.ndim == 4, f"keys must be (batch, kv_heads, n, head_dim), got {tuple(keys.shape)}")
        b, h, _, d = keys.shape
        store = cls(batch=b, kv_heads=h, head_dim=d, dtype=keys.dtype, device=keys.device, **kwargs)
        store._append(keys, values, positions, valid, headroom=False)  # into an empty pool: packed, exact size
        return store

    def clone(self) -> RaggedKV:
        other = object.__new__(RaggedKV)
        other.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})
        return other

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.lengths.shape[1]

    @property
    def width(self) -> int:
        """The longest row (the width of the padded view)."""
        return self._width

    @property
    def stored(self) -> int:
        """Entries stored, all rows together."""
        return self._stored

    @property
    def capacity(self) -> int:
        return self.keys_pool.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys_pool.dtype

    @property
    def device(self) -> torch.device:
        return self.keys_pool.device

    @property
    def valid(self) -> torch.Tensor:
        """`(batch, kv_heads, width)` bool: the stored entries of the padded view."""
        return row_mask(self.lengths, self._width)

    @property
    def positions(self) -> torch.Tensor:
        """`(batch, kv_heads, width)` int64, ascending per row, -1 past a row's length. Read-only."""
        return self._positions[..., : self._width]

    def allocated_bytes(self) -> int:
        """Bytes held by the key and value pools, measured from their storage."""
        return _nbytes(self.keys_pool) + _nbytes(self.values_pool)

    def ideal_bytes(self) -> int:
        """`stored × head_dim × 2 × element size`: what a perfectly packed cache would hold."""
        return self._stored * self.head_dim * 2 * self.keys_pool.element_size()

    def entry_bytes(self) -> int:
        """Bytes of one token of every row: its key and value."""
        return self.batch * self.kv_heads * self.head_dim * 2 * self.dtype.itemsize

    def dense_shape(self) -> tuple[int, int, int, int]:
        """`(batch, kv_heads, n, head_dim)` of a dense layer holding as many entries (n: the mean row, rounded up)."""
        return self.batch, self.kv_heads, -(-self.stored // (self.batch * self.kv_heads)), self.head_dim

    def kv_tensors(self) -> list[torch.Tensor]:
        return [self.keys_pool, self.values_pool]

    def bookkeeping_bytes(self) -> int:
        """Bytes of the slot table, positions, lengths and free list (not counted in the KV bound)."""
        return sum(_nbytes(t) for t in (self._slots, self._positions, self.lengths, self._free))

    # ---- append ------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None,
               valid: torch.Tensor | None = None) -> None:
        """Store new entries `(batch, kv_heads, q, head_dim)`; rows grow by their count of valid entries.

        `positions`: `(batch, q)` or `(batch, kv_heads, q)`, default `arange(q)` after the row's last position
        (only meaningful without padding). Valid positions must increase within the step and exceed
        every position already stored in the row (the slot table stays sorted without a sort).
        `valid`: `(batch, q)` or `(batch, kv_heads, q)` bool, default all True.
        """
        self._append(keys, values, positions, valid, headroom=True)

    def _append(self, keys, values, positions, valid, headroom: bool) -> None:
        b, h, d = self.batch, self.kv_heads, self.head_dim
        check(keys.ndim == 4 and keys.shape[:2] == (b, h) and keys.shape[3] == d and values.shape == keys.shape,
              f"new keys/values must be ({b}, {h}, q, {d}), got {tuple(keys.shape)} / {tuple(values.shape)}")
        check(keys.dtype == self.dtype and values.dtype == self.dtype,
              f"new entries must be {self.dtype}, got {keys.dtype}")
        q = keys.shape[2]
        last = self._last_positions()
        if positions is None:
            positions = last[..., None] + 1 + torch.arange(q, device=self.device)
        positions = self._per_row(positions, q, "positions")
        check(not positions.is_floating_point() and positions.dtype != torch.bool,
              f"positions must be integers, got {positions.dtype}")
        positions = positions.long()
        valid_rows = None if valid is None else self._per_row(valid, q, "valid")
        check(valid_rows is None or valid_rows.dtype == torch.bool, "valid must be a bool tensor")
        if q == 0:
            return
        was_empty = self._stored == 0 and self.capacity == 0
        if valid_rows is None:  # every row takes all q entries: no masks, host-side sizes
            increasing = positions[..., 0] > last
            if q > 1:
                increasing = increasing & (positions.diff(dim=-1) > 0).all(-1)
            check(bool(increasing.all()), "new positions must increase within a step and exceed the row's stored positions")
            m, width = b * h * q, self._width + q
            slots = self._take_slots(m, headroom)
            self.keys_pool.index_copy_(0, slots, keys.reshape(-1, d))
            self.values_pool.index_copy_(0, slots, values.reshape(-1, d))
            self._reserve_columns(width, q)
            cols = self.lengths[..., None] + torch.arange(q, device=self.device)
            self._slots.scatter_(2, cols, slots.view(b, h, q).to(torch.int32))
            self._positions.scatter_(2, cols, positions)
            self.lengths = self.lengths + q
        else:
            # each valid position exceeds the previous valid one (or the row's last stored one)
            before = torch.cat([last[..., None], torch.where(valid_rows, positions, -1)[..., :-1]], dim=-1)
            ok = (positions > before.cummax(dim=-1).values) | ~valid_rows
            check(bool(ok.all()), "new positions must increase within a step and exceed the row's stored positions")
            counts = valid_rows.sum(-1)
            new_lengths = self.lengths + counts
            m = int(counts.sum())
            width = int(new_lengths.max())
            slots = self._take_slots(m, headroom)
            self.keys_pool.index_copy_(0, slots, keys[valid_rows])
            self.values_pool.index_copy_(0, slots, values[valid_rows])
            self._reserve_columns(width, q)
            cols = self._slots.shape[2]
            flat = torch.arange(b * h, device=self.device).view(b, h, 1) * cols + self.lengths[..., None]
            flat = (flat + valid_rows.cumsum(-1) - 1)[valid_rows]
            self._slots.view(-1).index_copy_(0, flat, slots.to(torch.int32))
            self._positions.view(-1).index_copy_(0, flat, positions[valid_rows])
            self.lengths = new_lengths
        self._stored += m
        self._width = width
        # rows back to back from slot 0 only if the pool was empty (slots = arange) or nothing came in
        self._packed = was_empty or (self._packed and m == 0)

    # ---- evict -------------------------------------------------------------------------------------
    def evict(self, keep: torch.Tensor | Keep) -> None:
        """Keep only `keep` of each row: a bool mask `(batch, kv_heads, width)` over the padded view, or
        view indices `(batch, kv_heads, k)` sorted ascending, with -1 for "no entry" in rows keeping fewer
        (or a `Keep`, which holds such indices).
        Freed slots join the free list; the survivors are compacted (one copy) only when free slots would
        exceed `max_waste` of the stored entries.
        """
        if isinstance(keep, Keep):
            keep = keep.indices
        w = self._width
        uniform = (keep.dtype != torch.bool and not keep.is_floating_point() and keep.ndim == 3
                   and tuple(keep.shape[:2]) == tuple(self.lengths.shape) and keep.numel() > 0 and int(keep.min()) >= 0)
        if uniform:  # every row keeps k entries (the dense contract's indices): gathers, no mask
            keep = keep.long()
            check(not bool((keep >= self.lengths[..., None]).any()),
                  "keep selects a padding entry (past a row's length) or an index out of range")
            check(not bool((keep[..., 1:] <= keep[..., :-1]).any()), "kept indices must be sorted ascending, without repeats")
            k = keep.shape[2]
            if k * self.batch * self.kv_heads == self._stored:
                return
            kept_slots = self._slots[..., :w].gather(2, keep)
            positions = self._positions[..., :w].gather(2, keep)
            lengths = torch.full_like(self.lengths, k)
            if self._too_wasteful(kept_slots.numel()):
                self._repack(kept_slots.reshape(-1), positions, lengths)
                return
            dropped = self.valid.scatter(2, keep, False)
        else:
            mask = keep_mask(keep, self.lengths, w)
            lengths = mask.sum(-1)
            kept = int(lengths.sum())
            if kept == self._stored:
                return
            positions = compact(self._positions[..., :w], mask, fill=-1)
            if self._too_wasteful(kept):
                self._repack(self._slots[..., :w][mask], positions, lengths)
                return
            kept_slots = compact(self._slots[..., :w], mask)
            dropped = self.valid & ~mask
        self._free = torch.cat([self._free, self._slots[..., :w][dropped].long()])
        self._slots, self._positions, self.lengths = kept_slots, positions, lengths
        self._stored = int(lengths.sum())
        self._width = kept_slots.shape[2]
        self._packed = False

    # ---- views -------------------------------------------------------------------------------------
    def rect(self) -> None:
        """No rectangle: rows differ (the padded view is `padded()`)."""
        return None

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded view's `(keys, values, positions, valid)` (one gather; see `padded`)."""
        v = self.padded()
        return v.keys, v.values, v.positions, v.valid

    def kept_positions(self) -> torch.Tensor:
        """`(batch, kv_heads, width)` positions, ascending per row, -1 past a row's length (a copy)."""
        return self.positions.clone()

    def padded(self) -> PaddedView:
        """The transient padded view `(batch, kv_heads, width, head_dim)` + positions + validity.

        Zero-copy when the pool is packed and all rows are equally long; one gather otherwise."""
        b, h, w, d = self.batch, self.kv_heads, self._width, self.head_dim
        if self._packed and self._stored == b * h * w:
            keys = self.keys_pool[: self._stored].view(b, h, w, d)
            values = self.values_pool[: self._stored].view(b, h, w, d)
        else:
            idx = self._slots[..., :w].reshape(-1)
            keys = self.keys_pool.index_select(0, idx).view(b, h, w, d)
            values = self.values_pool.index_select(0, idx).view(b, h, w, d)
        return PaddedView(keys, values, self.positions, self.valid, self.lengths)

    def packed_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values `(stored, head_dim)` of all rows back to back (row-major, position order), and the
        cumulative row lengths `(batch * kv_heads + 1,)` int32: the layout of varlen attention kernels."""
        if self._packed:
            keys, values = self.keys_pool[: self._stored], self.values_pool[: self._stored]
        else:
            idx = self._slots[..., : self._width][self.valid]
            keys, values = self.keys_pool.index_select(0, idx), self.values_pool.index_select(0, idx)
        cu = torch.zeros(self.batch * self.kv_heads + 1, dtype=torch.int32, device=self.device)
        cu[1:] = self.lengths.reshape(-1).cumsum(0)
        return keys, values, cu

    def as_dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(keys, values, positions)` dense `(batch, kv_heads, n, ...)` when every row holds the same number
        of entries (a view of the pool when packed), else None."""
        if not bool((self.lengths == self._width).all()):
            return None
        view = self.padded()
        return view.keys, view.values, view.positions

    # ---- batch rows (beam search, batch_select_indices) --------------------------------------------
    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep / reorder / repeat sequences: row `i` becomes old sequence `indices[i]` `(new_batch,)`.
        Rebuilds a packed pool (one copy of the selected entries)."""
        check(isinstance(indices, torch.Tensor) and indices.ndim == 1 and not indices.is_floating_point(),
              "batch indices must be a 1-D integer tensor")
        indices = indices.to(self.device).long()
        w = self._width
        self.lengths = self.lengths.index_select(0, indices)
        self._slots = self._slots[..., :w].index_select(0, indices)
        self._positions = self._positions[..., :w].index_select(0, indices)
        self._stored = int(self.lengths.sum())
        self._width = int(self.lengths.max()) if self.lengths.numel() else 0
        self._slots, self._positions = self._slots[..., : self._width], self._positions[..., : self._width]
        self._packed = False
        self._compact()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_batch(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    # ---- internals ---------------------------------------------------------------------------------
    def _per_row(self, x: torch.Tensor, q: int, name: str) -> torch.Tensor:
        b, h = self.batch, self.kv_heads
        check(isinstance(x, torch.Tensor), f"{name} must be a tensor")
        x = x.to(self.device)
        if x.ndim == 2 and tuple(x.shape) == (b, q):
            return x[:, None, :].expand(b, h, q)
        check(tuple(x.shape) == (b, h, q), f"{name} must be ({b}, {q}) or ({b}, {h}, {q}), got {tuple(x.shape)}")
        return x

    def _last_positions(self) -> torch.Tensor:
        """`(batch, kv_heads)`: each row's largest stored position, -1 for empty rows."""
        if self._width == 0:
            return torch.full_like(self.lengths, -1)
        # an empty row reads its column 0, which holds the pad value -1
        return self._positions.gather(2, (self.lengths - 1).clamp(min=0)[..., None])[..., 0]

    def _take_slots(self, m: int, headroom: bool = True) -> torch.Tensor:
        """`m` slot ids for new entries: free slots first, then a grown pool (with `growth` headroom)."""
        free = self._free.shape[0]
        if m <= free:
            slots, self._free = self._free[:m], self._free[m:]
            return slots
        cap = self.capacity
        need = m - free
        extra = int(self.growth * (self._stored + m)) if headroom else 0
        new_cap = cap + need + extra
        for name in ("keys_pool", "values_pool"):
            old = getattr(self, name)
            new = torch.empty(new_cap, self.head_dim, dtype=old.dtype, device=old.device)
            new[:cap] = old
            new[cap:].zero_()  # filler must be finite: padded views read it (times a zero probability)
            setattr(self, name, new)
        slots = torch.cat([self._free, torch.arange(cap, cap + need, device=self.device)])
        self._free = torch.arange(cap + need, new_cap, device=self.device)
        return slots

    def _reserve_columns(self, width: int, q: int) -> None:
        """Make the slot table at least `width` columns wide (bookkeeping headroom, not KV memory)."""
        cols = self._slots.shape[2]
        if width <= cols:
            return
        extra = width - cols + max(q, 64)
        b, h = self.batch, self.kv_heads
        self._slots = torch.cat([self._slots, self._slots.new_zeros(b, h, extra)], dim=-1)
        self._positions = torch.cat([self._positions, self._positions.new_full((b, h, extra), -1)], dim=-1)

    def _too_wasteful(self, kept: int) -> bool:
        """True when keeping `kept` entries in the current pool would leave more than `max_waste` free."""
        return self.capacity - kept > self.max_waste * kept

    def _repack(self, kept_slots: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> None:
        """New pools of exactly the kept entries (`kept_slots`, row-major, position order), rows back to back."""
        self.keys_pool = self.keys_pool.index_select(0, kept_slots)
        self.values_pool = self.values_pool.index_select(0, kept_slots)
        self._stored = kept_slots.shape[0]
        self._width = positions.shape[2]
        self.lengths = lengths
        slots = torch.zeros(*lengths.shape, self._width, dtype=torch.int32, device=self.device)
        slots[row_mask(lengths, self._width)] = torch.arange(self._stored, dtype=torch.int32, device=self.device)
        self._slots, self._positions = slots, positions
        self._free = torch.empty(0, dtype=torch.long, device=self.device)
        self._packed = True

    def _compact(self) -> None:
        """Copy the stored entries into pools of exactly their size, rows back to back in position order."""
        w = self._width
        if not self._packed:
            self._repack(self._slots[..., :w][self.valid], self._positions[..., :w].clone(), self.lengths)
        elif self.capacity != self._stored:  # drop the headroom (a copy: storage cannot shrink in place)
            self.keys_pool = self.keys_pool[: self._stored].clone()
            self.values_pool = self.values_pool[: self._stored].clone()


