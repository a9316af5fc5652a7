"""The slot layout of in-place decoding: a dense rectangle whose storage order is slot order.

Methods with `in_place_decode` (H2O, TOVA, StreamingLLM) evict exactly one entry per row at a decode
step; instead of copying the layer, the slot leaving each row stays, marked free (`free_slots`
`(batch, kv_heads)`), and the next decode step writes its new key, value and position into it
(`index_copy_`: no `torch.cat`, no gather, the key tensor is not reallocated). Storage order is then no
longer position order, and one slot per row may be free: `keys` / `positions` are in slot order,
`kept_positions()` gives the sorted positions, `width` / `lengths` / the byte counts count live entries
only. `settle_order()` gives the gather that puts the live entries back in position order
(`kvtrim.storage.switch.settle` makes the layer dense again with it).
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import check
from kvtrim.storage.base import Keep
from kvtrim.storage.dense import DenseKV, flat_rows


class SlotKV(DenseKV):
    """A `DenseKV` in slot order, with at most one free slot per row (`free_slots`, None: none)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 free_slots: torch.Tensor | None = None):
        super().__init__(keys, values, positions)
        #: `(batch, kv_heads)` the free slot of each row (None: no free slot)
        self.free_slots = free_slots

    @property
    def width(self) -> int:
        """Live entries per row (a free slot is not one)."""
        return self.keys.shape[-2] - (self.free_slots is not None)

    def ideal_bytes(self) -> int:
        return super().ideal_bytes() - (self.entry_bytes() if self.free_slots is not None else 0)

    def dense_shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.keys.shape
        return b, h, self.width, d

    # ---- order -----------------------------------------------------------------------------------
    def settle_order(self) -> torch.Tensor:
        """`(batch, kv_heads, width)`: the slots of the live entries in position order (free slots left out)."""
        pos = self.positions
        if self.free_slots is not None:
            pos = pos.scatter(-1, self.free_slots[..., None], torch.iinfo(pos.dtype).max)  # free slots sort last
        return pos.argsort(dim=-1)[..., : self.width]

    def kept_positions(self) -> torch.Tensor:
        return self.positions.gather(-1, self.settle_order())

    # ---- changes ---------------------------------------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        """The entry at `slots` `(batch, kv_heads)` leaves each row; its slot waits for the next step's entry."""
        self.free_slots = slots

    def append(self, keys, values, positions, valid=None) -> None:
        """A single-token step `(b, h, 1, d)` goes into each row's free slot; without one it is appended."""
        if self.free_slots is None:
            super().append(keys, values, positions)
            return
        self._writable()
        rows = flat_rows(self.free_slots[..., None], self.keys.shape[2])
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, rows, keys.reshape(-1, keys.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(0, rows, values.reshape(-1, values.shape[-1]))
        self.positions.view(-1).index_copy_(0, rows, positions.reshape(-1))
        self.free_slots = None

    def fill_free_from_last(self) -> torch.Tensor:
        """Each row's free slot takes the entry in the last slot, which is free afterwards (in every row: a row
        whose free slot is the last moves nothing). Returns the slot order `(batch, kv_heads, slots)` applied:
        slot `j` now holds the entry that was at slot `order[..., j]` (the last slot's, stale, included)."""
        check(self.free_slots is not None, "fill_free_from_last needs a free slot in every row")
        last = self.keys.shape[-2] - 1
        b, h = self.free_slots.shape
        order = torch.arange(last + 1, device=self.free_slots.device).expand(b, h, -1).clone()
        into = self.free_slots[..., None]
        order.scatter_(-1, into, last)
        self._writable()
        # one entry per row moves, written in place: each row reads only its own last slot (a row whose free slot
        # is the last writes it onto itself)
        self.positions.scatter_(-1, into, self.positions[..., last:])
        for t in (self.keys, self.values):
            t.scatter_(2, into[..., None].expand(b, h, 1, t.shape[-1]), t[:, :, last:])
        self.free_slots = torch.full_like(self.free_slots, last)
        return order

    def _writable(self) -> None:
        """Keys, values and positions contiguous, to be written in place (copied once, after a batch op left
        views)."""
        if not (self.keys.is_contiguous() and self.values.is_contiguous() and self.positions.is_contiguous()):
            self.keys, self.values, self.positions = (t.contiguous() for t in (self.keys, self.values, self.positions))

    def evict(self, keep: Keep) -> None:
        """Keep the slots `keep.indices` `(b, h, k)` (in the order given); no slot is free afterwards."""
        super().evict(keep)
        self.free_slots = None

    def select_batch(self, rows: torch.Tensor) -> None:
        super().select_batch(rows)
        if self.free_slots is not None:  # `(batch, kv_heads)`: follows its sequence
            self.free_slots = self.free_slots.index_select(0, rows.to(self.free_slots.device))
