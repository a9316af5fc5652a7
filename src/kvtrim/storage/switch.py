"""Where a layer's layout changes, and the only place (`kvtrim.cache.TrimLayer` calls these):

* dense -> slots (`to_slots`): an in-place decode step freed one slot per row (`EvictOne`);
* slots -> dense (`settle`): any forward that does not run in place first puts the live entries back in
  position order, one gather;
* dense -> ragged (`evict`): an eviction keeps unequal counts per row; exactly the kept entries are
  copied into a `RaggedKV` and the layer stays ragged;
* padded batch -> ragged from the start (`empty`): pads are never stored.

Every other change (append, evict, batch select) happens inside a layout through the protocol.
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import check
from kvtrim.storage.base import Keep, LayerStorage
from kvtrim.storage.dense import DenseKV
from kvtrim.storage.ragged import RaggedKV
from kvtrim.storage.slots import SlotKV


def empty(key_states: torch.Tensor, value_states: torch.Tensor, padded: bool) -> LayerStorage:
    """The storage of a layer whose first forward brings `key_states` `(b, h, q, d)`: dense, or ragged
    from the start for a padded batch."""
    if padded:
        b, h, _, d = key_states.shape
        return RaggedKV.empty(b, h, d, dtype=key_states.dtype, device=key_states.device)
    return DenseKV.empty(key_states, value_states)


def evict(storage: LayerStorage, keep: Keep, may_go_ragged) -> LayerStorage:
    """Evict `keep` from `storage`; return the storage now holding the layer (a new `RaggedKV` when a
    dense layer keeps unequal counts: `may_go_ragged()` is called first and raises if it may not)."""
    if keep.equal or storage.ragged:
        storage.evict(keep)
        return storage
    check(not isinstance(storage, SlotKV), "a layer in slot order (in-place decoding) takes kept indices or EvictOne")
    may_go_ragged()
    keys, values, positions = storage.rect()
    return RaggedKV.from_dense(keys, values, positions, valid=keep.mask(keys.shape[2]))


def to_slots(storage: LayerStorage, slots: torch.Tensor) -> SlotKV:
    """The entry at `slots` `(b, h)` of each row leaves in place; the layer is in slot order from now on."""
    if not isinstance(storage, SlotKV):
        storage = SlotKV(*storage.rect())
    storage.free(slots)
    return storage


def settle(storage: LayerStorage | None) -> tuple[DenseKV, torch.Tensor] | None:
    """Position order again, without the free slots: `(dense storage, order)` where `order` `(b, h, n)`
    are the slots kept, in order (the method's state follows with `gather_state(state, order)`); None
    when `storage` is not in slot order (nothing to do)."""
    if not isinstance(storage, SlotKV):
        return None
    order = storage.settle_order()
    dense = DenseKV(*storage.rect())
    dense.evict(Keep(order, True))
    return dense, order
