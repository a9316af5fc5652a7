"""Ragged KV storage (`kvtrim.storage`) against a list-of-entries reference per row, and its memory bound."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvtrim.methods.base import KvtrimError
from kvtrim.storage import DenseKV, LayerStorage, RaggedKV, SlotKV, as_keep, compact, keep_mask, row_mask, switch


class Reference:
    """Per (sequence, kv_head) row: a plain list of (position, key, value), in arrival order."""

    def __init__(self, b, h):
        self.rows = [[[] for _ in range(h)] for _ in range(b)]

    def append(self, k, v, pos, valid):
        b, h, q, _ = k.shape
        for bi in range(b):
            for hi in range(h):
                for j in range(q):
                    if valid[bi, j]:
                        self.rows[bi][hi].append((int(pos[bi, j]), k[bi, hi, j].clone(), v[bi, hi, j].clone()))

    def evict(self, keep):  # keep: bool (b, h, width) over the current rows
        for bi, row in enumerate(self.rows):
            for hi, entries in enumerate(row):
                row[hi] = [e for j, e in enumerate(entries) if keep[bi, hi, j]]

    def select(self, indices):
        self.rows = [[list(r) for r in self.rows[i]] for i in indices.tolist()]


def assert_matches(store: RaggedKV, ref: Reference, max_waste=0.02):
    view = store.padded()
    b, h = store.batch, store.kv_heads
    assert view.keys.shape[:3] == (b, h, store.width)
    for bi in range(b):
        for hi in range(h):
            entries = ref.rows[bi][hi]
            n = len(entries)
            assert int(store.lengths[bi, hi]) == n
            assert view.valid[bi, hi].tolist() == [True] * n + [False] * (store.width - n)
            assert view.positions[bi, hi, :n].tolist() == [p for p, _, _ in entries]
            assert (view.positions[bi, hi, n:] == -1).all()
            if n:
                assert torch.equal(view.keys[bi, hi, :n], torch.stack([k for _, k, _ in entries]))
                assert torch.equal(view.values[bi, hi, :n], torch.stack([v for _, _, v in entries]))
            assert torch.isfinite(view.keys[bi, hi]).all() and torch.isfinite(view.values[bi, hi]).all()
    ideal = sum(len(e) for row in ref.rows for e in row) * store.head_dim * 2 * store.keys_pool.element_size()
    assert store.ideal_bytes() == ideal
    # measured from the storage the pools hold, not from the lengths
    allocated = store.keys_pool.untyped_storage().nbytes() + store.values_pool.untyped_storage().nbytes()
    assert store.allocated_bytes() == allocated
    assert allocated <= (1 + max_waste) * ideal


def padded_prompt(b, n, lengths, side, seed):
    """Valid mask and per-sequence positions of a left- or right-padded batch of prompts."""
    valid = torch.zeros(b, n, dtype=torch.bool)
    for bi, length in enumerate(lengths):
        if side == "left":
            valid[bi, n - length:] = True
        else:
            valid[bi, :length] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return valid, positions


@pytest.mark.parametrize("side", ["left", "right"])
def test_from_dense_stores_only_valid_entries_packed(side):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 7, 4, generator=g), torch.randn(3, 2, 7, 4, generator=g)
    valid, pos = padded_prompt(3, 7, [7, 2, 0], side, 0)
    store = RaggedKV.from_dense(k, v, pos, valid)
    ref = Reference(3, 2)
    ref.append(k, v, pos, valid)
    assert store.lengths.tolist() == [[7, 7], [2, 2], [0, 0]]
    assert store.allocated_bytes() == store.ideal_bytes() == 18 * 4 * 2 * 4  # exact: no pad slot
    assert_matches(store, ref, max_waste=0.0)


@pytest.mark.parametrize(
    "b,h,prompt,growth",
    [(1, 1, (5, 30), 0.01), (2, 3, (3, 40), 0.01), (8, 3, (60, 300), 0.01), (8, 3, (200, 400), 0.0), (4, 2, (1, 9), 0.02)],
)
def test_random_appends_and_evictions_match_reference(b, h, prompt, growth):
    g = torch.Generator().manual_seed(b * 100 + h)
    d = 4
    n = int(torch.randint(*prompt, (1,), generator=g))
    lens = torch.randint(0, n + 1, (b,), generator=g).tolist()
    valid, pos = padded_prompt(b, n, lens, "left" if b % 2 == 0 else "right", 0)
    k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    store = RaggedKV.from_dense(k, v, pos, valid, growth=growth)
    ref = Reference(b, h)
    ref.append(k, v, pos, valid)
    next_pos = valid.sum(-1)
    assert_matches(store, ref)
    holes_seen = False  # free slots inside the pool: evictions that did not copy
    for step in range(40):
        q = 1 if step % 3 else int(torch.randint(1, 6, (1,), generator=g))
        nv = torch.rand(b, q, generator=g) < 0.8  # some sequences pad this step (left/right/mixed)
        npos = next_pos[:, None] + nv.long().cumsum(-1) - 1
        nk, nvv = torch.randn(b, h, q, d, generator=g), torch.randn(b, h, q, d, generator=g)
        store.append(nk, nvv, npos, nv)
        ref.append(nk, nvv, npos, nv)
        next_pos = next_pos + nv.sum(-1)
        assert_matches(store, ref)
        kind = step % 4
        if kind == 0:  # evict a random fraction, different per row
            frac = 0.3 * torch.rand(b, h, 1, generator=g)
            keep = (torch.rand(b, h, store.width, generator=g) >= frac) & store.valid
        elif kind == 1 and store.width:  # evict one entry per non-empty row
            drop = (torch.rand(b, h, generator=g) * store.lengths).long()
            keep = store.valid.clone()
            keep[torch.arange(b)[:, None], torch.arange(h)[None, :], drop] = False
            keep &= store.valid
        elif kind == 2 and store.width:  # evict half of every row, as kept indices with -1 for rows that keep fewer
            k_max = int((store.lengths + 1).div(2, rounding_mode="floor").max())
            idx = torch.full((b, h, k_max), -1, dtype=torch.long)
            for bi in range(b):
                for hi in range(h):
                    n_row = int(store.lengths[bi, hi])
                    chosen = torch.randperm(n_row, generator=g)[: (n_row + 1) // 2].sort().values
                    idx[bi, hi, : len(chosen)] = chosen
            keep = keep_mask(idx, store.lengths, store.width)
            store.evict(idx)
            ref.evict(keep)
            assert_matches(store, ref)
            continue
        else:
            continue  # no eviction this step (or nothing to evict)
        store.evict(keep)
        ref.evict(keep)
        assert_matches(store, ref)
        holes_seen |= store.capacity > store.stored
    if prompt[0] >= 200:  # long rows: evicting one entry per row stays under the waste bound
        assert holes_seen


def test_a_row_can_empty_and_refill():
    k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    store = RaggedKV.from_dense(k, v)
    ref = Reference(2, 2)
    ref.append(k, v, torch.arange(5).expand(2, 5), torch.ones(2, 5, dtype=torch.bool))
    keep = store.valid.clone()
    keep[0, 1] = False  # row (0, 1) becomes empty
    keep[1] = False  # sequence 1 empty in every head
    store.evict(keep)
    ref.evict(keep)
    assert store.lengths.tolist() == [[5, 0], [0, 0]]
    assert_matches(store, ref)
    nk, nv = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    store.append(nk, nv, torch.tensor([[5, 6], [5, 6]]))
    ref.append(nk, nv, torch.tensor([[5, 6], [5, 6]]), torch.ones(2, 2, dtype=torch.bool))
    assert store.lengths.tolist() == [[7, 2], [2, 2]]
    assert_matches(store, ref)
    everything_gone = torch.zeros(2, 2, store.width, dtype=torch.bool)
    store.evict(everything_gone)
    assert store.stored == 0 and store.allocated_bytes() == 0 and store.width == 0


@pytest.mark.parametrize("form", ["mask", "indices"])
def test_decode_at_budget_reuses_slots_without_copying(form):
    """Append one entry and evict one per row: after the first step the pools are never reallocated."""
    b, h, n, d = 2, 3, 200, 8
    k0, v0 = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    store = RaggedKV.from_dense(k0, v0)
    ref = Reference(b, h)
    ref.append(k0, v0, torch.arange(n).expand(b, n), torch.ones(b, n, dtype=torch.bool))
    ptrs = None
    for t in range(30):
        nk, nv, pos = torch.randn(b, h, 1, d), torch.randn(b, h, 1, d), torch.full((b, 1), n + t)
        store.append(nk, nv, pos)
        ref.append(nk, nv, pos, torch.ones(b, 1, dtype=torch.bool))
        drop = torch.randint(0, n, (b, h, 1))
        keep = torch.ones(b, h, store.width, dtype=torch.bool).scatter(2, drop, False)
        if form == "mask":
            store.evict(keep)
        else:
            store.evict(keep.nonzero()[:, 2].view(b, h, n))
        ref.evict(keep)
        assert_matches(store, ref)
        assert store.lengths.eq(n).all()
        assert store.allocated_bytes() <= 1.02 * store.ideal_bytes()
        now = (store.keys_pool.data_ptr(), store.values_pool.data_ptr())
        if ptrs is not None:
            assert now == ptrs, f"pool reallocated at step {t}"
        ptrs = now


def test_uniform_indices_small_and_large_evictions():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 3, 300, 4, generator=g), torch.randn(2, 3, 300, 4, generator=g)
    store, ref = RaggedKV.from_dense(k, v), Reference(2, 3)
    ref.append(k, v, torch.arange(300).expand(2, 300), torch.ones(2, 300, dtype=torch.bool))
    for kept, compacts in ((298, False), (150, True), (149, False)):
        idx = torch.rand(2, 3, store.width, generator=g).topk(kept, dim=-1).indices.sort(-1).values
        mask = torch.zeros(2, 3, store.width, dtype=torch.bool).scatter(2, idx, True)
        store.evict(idx)
        ref.evict(mask)
        assert_matches(store, ref)
        assert (store.capacity == store.stored) == compacts


def test_large_eviction_compacts_to_the_exact_size():
    store = RaggedKV.from_dense(torch.randn(2, 3, 100, 4), torch.randn(2, 3, 100, 4))
    keep = torch.zeros(2, 3, 100, dtype=torch.bool)
    keep[..., ::2] = True
    keep[0, 0, 1::2] = True  # one row keeps everything: rows differ
    store.evict(keep)
    assert store.capacity == store.stored == 100 + 5 * 50
    assert store.allocated_bytes() == store.ideal_bytes()


def test_packed_equal_rows_view_is_zero_copy_and_as_dense():
    k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    store = RaggedKV.from_dense(k, v)
    view = store.padded()
    assert view.keys.untyped_storage().data_ptr() == store.keys_pool.untyped_storage().data_ptr()
    dense = store.as_dense()
    assert dense is not None and torch.equal(dense[0], k) and torch.equal(dense[1], v)
    assert torch.equal(dense[2], torch.arange(6).expand(2, 3, 6))
    keep = store.valid.clone()
    keep[0, 0, 0] = False
    store.evict(keep)
    assert store.as_dense() is None  # rows differ


def test_select_batch_reorders_and_repeats():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 2, 6, 4, generator=g), torch.randn(3, 2, 6, 4, generator=g)
    valid, pos = padded_prompt(3, 6, [6, 3, 1], "left", 0)
    store = RaggedKV.from_dense(k, v, pos, valid)
    ref = Reference(3, 2)
    ref.append(k, v, pos, valid)
    keep = store.valid & (torch.rand(3, 2, store.width, generator=g) < 0.7)
    store.evict(keep)
    ref.evict(keep)
    for indices in (torch.tensor([2, 0, 1]), torch.tensor([1, 1, 0, 2]), torch.tensor([0])):
        s, r = store.clone(), Reference(3, 2)
        r.rows = [[list(e) for e in row] for row in ref.rows]
        s.select_batch(indices)
        r.select(indices)
        assert_matches(s, r, max_waste=0.0)
    s, r = store.clone(), Reference(3, 2)
    r.rows = [[list(e) for e in row] for row in ref.rows]
    s.batch_repeat_interleave(2)
    r.select(torch.arange(3).repeat_interleave(2))
    assert_matches(s, r, max_waste=0.0)


def test_compact_moves_kept_entries_to_the_front():
    x = torch.arange(2 * 1 * 5).view(2, 1, 5)
    keep = torch.tensor([[[True, False, True, False, True]], [[False, True, False, False, False]]])
    assert compact(x, keep, fill=-7).tolist() == [[[0, 2, 4]], [[6, -7, -7]]]


def test_bad_inputs_give_clear_errors():
    store = RaggedKV.from_dense(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    keep = store.valid.clone()
    keep[0, 0, 3] = False
    store.evict(keep)
    with pytest.raises(KvtrimError, match="padding entry"):
        store.evict(torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(KvtrimError, match="out of range"):
        store.evict(torch.tensor([[[0, 9], [0, 1]]]))
    with pytest.raises(KvtrimError, match="out of range"):
        store.evict(torch.tensor([[[0, -1], [0, 9]]]))
    with pytest.raises(KvtrimError, match="padding entry"):
        store.evict(torch.tensor([[[0, 3], [0, 1]]]))  # row (0, 0) holds 3 entries
    with pytest.raises(KvtrimError, match="sorted ascending"):
        store.evict(torch.tensor([[[1, 0], [0, 1]]]))
    with pytest.raises(KvtrimError, match="keep mask must be"):
        store.evict(torch.ones(1, 2, 7, dtype=torch.bool))
    with pytest.raises(KvtrimError, match="increase"):
        store.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[2]]))
    with pytest.raises(KvtrimError, match="increase"):
        store.append(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), torch.tensor([[9, 9]]))
    with pytest.raises(KvtrimError, match="new keys/values must be"):
        store.append(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), torch.tensor([[9]]))
    with pytest.raises(KvtrimError, match="must be torch.float32"):
        store.append(torch.randn(1, 2, 1, 4).double(), torch.randn(1, 2, 1, 4).double(), torch.tensor([[9]]))
    with pytest.raises(KvtrimError, match="growth"):
        RaggedKV.empty(1, 1, 4, growth=0.5)


# ---- the storage protocol and the dense / slot layouts (kvtrim/storage/) -------------------------------
STORAGE_DIR = Path(__file__).resolve().parents[1] / "src" / "kvtrim" / "storage"


def kvtrim_imports(path: Path) -> set[str]:
    """Every `kvtrim...` module a file imports (module level or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtrim"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("kvtrim"))
    return names


def test_layout_files_import_nothing_above_them():
    files = sorted(STORAGE_DIR.glob("*.py"))
    assert {f.stem for f in files} >= {"__init__", "base", "dense", "slots", "ragged", "switch"}
    for f in files:
        above = {m for m in kvtrim_imports(f) if not (m.startswith("kvtrim.storage") or m == "kvtrim.methods.base")}
        assert not above, (f.name, above)


def test_every_layout_implements_the_protocol():
    members = {n for n in vars(LayerStorage) if not n.startswith("_")} | set(LayerStorage.__annotations__)
    assert {"append", "evict", "view", "rect", "select_batch", "clone", "ideal_bytes", "ragged"} <= members
    keys, values, positions = dense_entries()
    for kv in (DenseKV(keys, values, positions), SlotKV(keys, values, positions),
               RaggedKV.from_dense(keys, values, positions)):
        assert all(hasattr(kv, m) for m in members), (type(kv).__name__, [m for m in members if not hasattr(kv, m)])
        assert kv.width == 5 and kv.lengths.tolist() == [[5, 5], [5, 5]] and kv.head_dim == 3 and kv.batch == 2
        assert torch.equal(kv.kept_positions(), positions) and kv.ideal_bytes() == keys.numel() * 4 * 2
        assert kv.dense_shape() == (2, 2, 5, 3) and kv.entry_bytes() == 2 * 2 * 3 * 4 * 2
        k, v, p, valid = kv.view()
        assert torch.equal(k, keys) and torch.equal(v, values) and torch.equal(p, positions)
        assert (valid is None) == (kv.rect() is not None) == (not kv.ragged)
    assert not DenseKV.ragged and not SlotKV.ragged and RaggedKV.ragged


def reference_keep(keep, lengths, width):
    """A keep argument as plain per-row sorted lists of kept view indices."""
    b, h = lengths.shape
    if keep.dtype == torch.bool:
        return [[[j for j in range(width) if keep[bi, hi, j]] for hi in range(h)] for bi in range(b)]
    return [[sorted(j for j in keep[bi, hi].tolist() if j >= 0) for hi in range(h)] for bi in range(b)]


@pytest.mark.parametrize("seed", range(6))
def test_as_keep_is_one_form_for_masks_and_padded_indices(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, w = 2, 3, 9
    lengths = torch.randint(3, w + 1, (b, h), generator=g)
    lengths[0, 0] = w
    mask = (torch.rand(b, h, w, generator=g) < 0.5) & row_mask(lengths, w)
    if seed % 2:  # equal counts: the dense contract's indices
        mask = row_mask(torch.full((b, h), 2), w)
    want = reference_keep(mask, lengths, w)
    for keep in (mask, as_keep(mask, w, lengths).indices):  # a mask, and -1-padded indices
        got = as_keep(keep, w, lengths)
        assert reference_keep(got.indices, lengths, w) == want
        assert got.equal == (len({len(r) for rows in want for r in rows}) == 1)
        assert got.equal or int(got.indices.min()) == -1
        assert torch.equal(got.mask(w), mask)
    plain = torch.tensor([[[0, 2]] * h] * b)
    assert as_keep(plain, w).indices is plain and as_keep(plain, w).equal  # taken as is, no check
    with pytest.raises(KvtrimError, match="padding entry"):
        as_keep(torch.ones(b, h, w, dtype=torch.bool), w, lengths.clamp(max=w - 1))


def dense_entries(b=2, h=2, n=5, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    return keys, values, torch.arange(n).expand(b, h, n).clone()


def test_dense_layout_appends_evicts_and_selects_rows():
    keys, values, positions = dense_entries()
    kv = DenseKV.empty(keys, values)
    kv.append(keys, values, positions)
    assert kv.width == 5 and kv.lengths.tolist() == [[5, 5], [5, 5]] and kv.view()[3] is None
    keep = torch.tensor([[[0, 3], [1, 4]], [[2, 3], [0, 1]]])
    kv.evict(as_keep(keep, kv.width))
    assert torch.equal(kv.keys, keys.gather(2, keep[..., None].expand(-1, -1, -1, 3)))
    assert torch.equal(kv.positions, keep) and kv.ideal_bytes() == 2 * 2 * 2 * 3 * 4 * 2
    copy = kv.clone()
    kv.select_batch(torch.tensor([1, 1, 0]))
    assert torch.equal(kv.positions, keep[[1, 1, 0]]) and torch.equal(copy.positions, keep)


def test_slot_layout_writes_the_freed_slot_and_settles_to_position_order():
    keys, values, positions = dense_entries()
    dense = DenseKV(keys.clone(), values.clone(), positions.clone())
    slots = switch.to_slots(dense, torch.tensor([[1, 3], [0, 4]]))  # these entries leave, in place
    assert isinstance(slots, SlotKV) and slots.width == 4 and slots.lengths.tolist() == [[4, 4], [4, 4]]
    assert slots.ideal_bytes() == dense_entries()[0].numel() * 4 * 2 * 4 // 5
    ptr = slots.keys.data_ptr()
    new_k, new_v = torch.ones(2, 2, 1, 3), torch.full((2, 2, 1, 3), 2.0)
    slots.append(new_k, new_v, torch.full((2, 2, 1), 5))  # into the free slot: no reallocation
    assert slots.keys.data_ptr() == ptr and slots.free_slots is None and slots.width == 5
    assert slots.positions[0, 0].tolist() == [0, 5, 2, 3, 4] and slots.positions[1, 1].tolist() == [0, 1, 2, 3, 5]
    assert slots.kept_positions()[0, 0].tolist() == [0, 2, 3, 4, 5]
    slots.free(torch.tensor([[0, 0], [0, 0]]))
    dense, order = switch.settle(slots)
    assert type(dense) is DenseKV and switch.settle(dense) is None
    assert dense.positions[0, 0].tolist() == [2, 3, 4, 5] and dense.positions[1, 1].tolist() == [1, 2, 3, 5]
    assert torch.equal(dense.keys[0, 0, -1], torch.ones(3))  # position 5 is the written entry
    assert torch.equal(order, slots.settle_order())


def test_the_switch_moves_unequal_keeps_to_ragged_storage_and_refuses_them_in_slot_order():
    keys, values, positions = dense_entries()
    mask = torch.zeros(2, 2, 5, dtype=torch.bool)
    mask[0, 0, :3] = mask[0, 1, 1:2] = mask[1, 0, 4] = mask[1, 1, :] = True
    asked = []
    ragged = switch.evict(DenseKV(keys, values, positions), as_keep(mask, 5), lambda: asked.append(1))
    assert isinstance(ragged, RaggedKV) and asked == [1] and ragged.lengths.tolist() == [[3, 1], [1, 5]]
    view = ragged.padded()
    assert torch.equal(view.keys[view.valid], keys[mask]) and torch.equal(view.positions[view.valid], positions[mask])
    equal = switch.evict(DenseKV(keys, values, positions), as_keep(row_mask(torch.full((2, 2), 2), 5), 5), None)
    assert type(equal) is DenseKV and equal.width == 2  # equal counts stay dense (never asks)
    slots = switch.to_slots(DenseKV(keys, values, positions), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(KvtrimError, match="slot order"):
        switch.evict(slots, as_keep(mask, 5), lambda: None)
