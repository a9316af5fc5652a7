"""Cache-layer storage: one protocol (`LayerStorage`, `base.py`), one file per layout.

* `dense.py` — `DenseKV`: the `(batch, kv_heads, n, head_dim)` rectangle of `DynamicCache` (the fast path);
* `slots.py` — `SlotKV`: the same rectangle in slot order, one free slot per row (in-place decoding);
* `ragged.py` — `RaggedKV`: a slot pool, every `(sequence, kv_head)` row its own length (AdaKV,
  padded batches);
* `switch.py` — the only place a layer moves from one layout to another.

Layouts import only `base.py`, torch and kvtrim's error helper (`kvtrim.methods.base.check`): nothing of
the cache, the methods or attention. How to add a layout: `docs/storage.md`.
"""

from kvtrim.storage.base import Keep, LayerStorage, PaddedView, as_keep, compact, keep_mask, row_mask
from kvtrim.storage.dense import DenseKV, flat_rows, select_rows
from kvtrim.storage.ragged import RaggedKV
from kvtrim.storage.slots import SlotKV

__all__ = ["DenseKV", "Keep", "LayerStorage", "PaddedView", "RaggedKV", "SlotKV", "as_keep", "compact",
           "flat_rows", "keep_mask", "row_mask", "select_rows"]
