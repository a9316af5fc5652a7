"""The storage protocol: what every layout of a cache layer implements, and the one form of `keep`.

A layer (`kvtrim.cache.TrimLayer`) holds one `LayerStorage` at a time and talks to it only through
this protocol; which layout holds a layer, and when that changes, is decided in `kvtrim.storage.switch`
alone. Shapes: `b` sequences, `h` KV heads, `d` head dim; a *row* is one `(sequence, kv_head)`.

Eviction decisions reach a layout in one form, `Keep` (sorted per-row indices, -1 past a row's kept
count), converted once from whatever a method returned (`as_keep`: indices, a bool mask, -1-padded
indices). The shared read-only picture of ragged storage (`PaddedView`) and the mask helpers live here
too, so every layout file imports only this module (and torch, and kvtrim's error helper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from kvtrim.methods.base import check


@dataclass(frozen=True)
class PaddedView:
    """A transient, read-only dense picture of ragged storage (built by `RaggedKV.padded()`).

    Attributes:
        keys, values: `(batch, kv_heads, width, head_dim)`; entries past a row's length hold finite filler.
        positions: `(batch, kv_heads, width)` int64, ascending within each row's valid part, -1 past it.
        valid: `(batch, kv_heads, width)` bool, True for the row's stored entries (`j < lengths[b, h]`).
        lengths: `(batch, kv_heads)` int64.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor

    @property
    def width(self) -> int:
        return self.keys.shape[2]


def row_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """`(batch, kv_heads, width)` bool: True at the first `lengths[b, h]` entries of each row."""
    return torch.arange(width, device=lengths.device) < lengths[..., None]


def keep_mask(keep: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Normalise a keep argument to a bool mask `(batch, kv_heads, width)` over the padded view.

    `keep`: a bool mask `(batch, kv_heads, width)`, or view indices `(batch, kv_heads, k)` (int), where
    negative entries mean "no entry" (rows that keep fewer than k). Raises `KvtrimError` when an index is
    out of range or a padding entry (`j >= lengths[b, h]`) is kept.
    """
    b, h = lengths.shape
    if keep.dtype == torch.bool:
        check(tuple(keep.shape) == (b, h, width), f"keep mask must be {(b, h, width)}, got {tuple(keep.shape)}")
        mask = keep
    else:
        check(not keep.is_floating_point() and keep.ndim == 3 and tuple(keep.shape[:2]) == (b, h),
              f"kept indices must be an integer tensor ({b}, {h}, k), got {keep.dtype} {tuple(keep.shape)}")
        check(keep.numel() == 0 or int(keep.max()) < width,
              f"kept index out of range for a view of width {width}")
        mask = _scatter_mask(keep, width)
    check(not bool((mask & ~row_mask(lengths, width)).any()), "keep selects a padding entry (past a row's length)")
    return mask


def _scatter_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """`(b, h, width)` bool, True at `indices` `(b, h, k)` (negative entries: none)."""
    b, h = indices.shape[:2]
    idx = torch.where(indices < 0, width, indices).long()
    mask = torch.zeros(b, h, width + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(2, idx, True)
    return mask[..., :width]


def compact(x: torch.Tensor, keep: torch.Tensor, fill=0) -> torch.Tensor:
    """Move the kept entries of each row to its front, in order: `(b, h, W, ...)` -> `(b, h, W', ...)`.

    `keep`: bool `(b, h, W)`; `W' = max kept per row`; positions past a row's kept count get `fill`.
    The rule the slot table follows on eviction; methods use it for per-entry state aligned with the view.
    """
    counts = keep.sum(-1)
    width = int(counts.max()) if counts.numel() else 0
    out = torch.full((*x.shape[:2], width, *x.shape[3:]), fill, dtype=x.dtype, device=x.device)
    out[row_mask(counts, width)] = x[keep]
    return out


# ---- the one form of `keep` ------------------------------------------------------------------------
@dataclass(frozen=True)
class Keep:
    """Which entries of each row survive an eviction, in the one form layouts receive.

    indices: `(batch, kv_heads, k)` int, view indices ascending per row; a row keeping fewer than `k`
        entries ends with -1s. equal: every row keeps exactly `k` (no -1: the dense fast path).
    """

    indices: torch.Tensor
    equal: bool

    def mask(self, width: int) -> torch.Tensor:
        """`(batch, kv_heads, width)` bool: the kept entries."""
        return _scatter_mask(self.indices, width)


def as_keep(keep: torch.Tensor | Keep, width: int, lengths: torch.Tensor | None = None) -> Keep:
    """Convert what a method returned into a `Keep`, once, at the layer's boundary.

    `keep`: view indices `(batch, kv_heads, k)` sorted ascending (every row keeps `k`: taken as is, no
    check, the dense fast path), a bool mask `(batch, kv_heads, width)`, or indices padded with -1 (rows
    keeping fewer). `lengths`: `(batch, kv_heads)` stored per row of the view (None: every row holds
    `width`); masks and padded indices are checked against them (`keep_mask`). A mask or padded indices
    whose rows all keep the same count become plain indices."""
    if isinstance(keep, Keep):
        return keep
    if keep.dtype != torch.bool and (keep.numel() == 0 or int(keep.min()) >= 0):
        return Keep(keep, True)
    b, h = keep.shape[:2]
    if lengths is None:
        lengths = torch.full((b, h), width, dtype=torch.long, device=keep.device)
    mask = keep_mask(keep, lengths, width)
    counts = mask.sum(-1)
    k = int(counts.max()) if counts.numel() else 0
    if bool((counts == k).all()):
        return Keep(mask.nonzero()[:, -1].view(b, h, k), True)
    order = torch.where(mask, torch.arange(width, device=mask.device), width).sort(dim=-1).values[..., :k]
    return Keep(order.masked_fill(order == width, -1), False)


# ---- the protocol ----------------------------------------------------------------------------------
class LayerStorage(Protocol):
    """The keys, values and original positions of one layer, in one layout.

    Views (read-only; a layer never hands out a tensor it will later write, except a slot layout's own
    tensors, which the layer writes only between steps):

    * `rect()`: `(keys, values, positions)`, `(b, h, n, d)` / `(b, h, n)` int64, the tensors themselves
      when every row holds `n` entries (dense and slot layouts), else None (ragged);
    * `view()`: `(keys, values, positions, valid)`, what a method's `LayerView` shows: the tensors above,
      `valid` None; a ragged layout's padded view `(b, h, width, ...)`, `valid` marking stored entries;
    * `kept_positions()` `(b, h, n)`: positions ascending per row (a copy; ragged: -1 past a row's end);
    * `width`: entries per row of `view()` (dense: `n`; ragged: the longest row); `lengths` `(b, h)`.

    Changes: `append` a step's entries `(b, h, q, d)`, positions `(b, h, q)`, `valid` `(b, q)` bool or None
    (pads of a padded batch are not stored); `evict(Keep)`; `select_batch(rows)` with 1-D sequence indices
    (reorder, select, repeat: one operation); `clone()` an independent copy.
    Sizes: `kv_tensors()` the tensors holding K/V; `entry_bytes()` one token of every row;
    `ideal_bytes()` exactly the stored entries; `bookkeeping_bytes()` positions and tables;
    `dense_shape()` `(b, h, n, d)` of a dense layer holding as many entries.
    `ragged`: True when rows may hold different counts (attention then needs kvtrim's ragged attention).
    """

    ragged: ClassVar[bool]

    @property
    def width(self) -> int: ...
    @property
    def lengths(self) -> torch.Tensor: ...
    @property
    def batch(self) -> int: ...
    @property
    def head_dim(self) -> int: ...

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor | None = None) -> None: ...
    def evict(self, keep: Keep) -> None: ...
    def rect(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...
    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]: ...
    def kept_positions(self) -> torch.Tensor: ...
    def select_batch(self, rows: torch.Tensor) -> None: ...
    def clone(self) -> LayerStorage: ...
    def kv_tensors(self) -> list[torch.Tensor]: ...
    def entry_bytes(self) -> int: ...
    def ideal_bytes(self) -> int: ...
    def bookkeeping_bytes(self) -> int: ...
    def dense_shape(self) -> tuple[int, int, int, int]: ...
