"""vLLM's CPU KV block layout and the compaction on it (run from .venv-serve; skipped without vLLM).

The layout is checked against vLLM's own write kernel (`cpu_attn_reshape_and_cache`, as the attention layer
calls it, with the kernel ISA "vec" whatever vLLM picks on this machine: "amx" packs its blocks otherwise,
tests/test_vllm_layout_amx.py; "vec16" stores as "vec", checked below); the compaction against `TrimCache`'s
kept positions on the same keys, for every supported method, every layer and every KV head."""

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

from kvtrim import Phase, TrimCache  # noqa: E402
import kvtrim.vllm.compact as compact_module  # noqa: E402
from kvtrim.vllm.block_io import fill_holes  # noqa: E402
from kvtrim.vllm.compact import compact  # noqa: E402
from kvtrim.vllm.entries import RequestEntries  # noqa: E402
from kvtrim.vllm import layout as cpu_vec  # noqa: E402
from kvtrim.vllm.kernels import torch_key_probs  # noqa: E402
from kvtrim.vllm.planning import StoredCounts, forward_steps  # noqa: E402
from kvtrim.vllm.layout import move_entries, read_keys, read_request, slot_places, write_entries  # noqa: E402
from kvtrim.vllm.spec import method_for_vllm  # noqa: E402
from test_vllm_counts import block_forwards  # noqa: E402

BS, H, D, NB = 32, 3, 64, 12


def kernel_write(cache, keys, values, slots, isa="vec"):
    """What the attention layer does: `keys`, `values` `(n, h, d)` written at `slots` `(n,)` by vLLM's kernel
    `isa`."""
    nb, h, bs, _ = cache.shape
    k_cache, v_cache = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                        kv_cache_dtype="auto")


def request_slots(block_ids, n):
    i = torch.arange(n)
    return block_ids[i // BS] * BS + i % BS


@pytest.fixture(params=[torch.float32, torch.bfloat16])
def dtype(request):
    return request.param


def test_read_what_the_kernel_wrote(dtype):
    torch.manual_seed(0)
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    blocks = torch.tensor([7, 2, 9, 4])  # not contiguous, not in order
    n = 3 * BS + 5  # a partial last block
    keys, values = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
    kernel_write(cache, keys, values, request_slots(blocks, n))
    got_k, got_v = read_request(cache, blocks, n)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
    assert torch.equal(read_keys(cache, blocks, n), keys.transpose(0, 1))  # the keys alone


def test_write_lays_out_as_the_kernel(dtype):
    torch.manual_seed(1)
    blocks = torch.tensor([3, 0, 5])
    n = 2 * BS + 9
    keys, values = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
    ours, theirs = torch.zeros(NB, H, BS, 2 * D, dtype=dtype), torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    heads, slots = torch.arange(H).repeat_interleave(n), torch.arange(n).repeat(H)  # every entry of every head
    write_entries(ours, blocks, heads, slots, keys[slots, heads], values[slots, heads])
    kernel_write(theirs, keys, values, request_slots(blocks, n))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("head_dim", [80, 112])
@pytest.mark.parametrize("vec16_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_vec16_kernel_stores_as_vec(head_dim, vec16_dtype):
    """vLLM picks the kernel "vec16" for a head size that is a multiple of 16 but not of 32 (any dtype, AMX or not):
    it lays out a block exactly as "vec" (measured: every byte of the cache, from a random one), so `layout.py`
    reads and writes it."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert _get_attn_isa(vec16_dtype, BS, head_dim) == "vec16"
    torch.manual_seed(8)
    blocks = torch.tensor([3, 0, 5])
    n = 2 * BS + 9
    keys, values = torch.randn(n, H, head_dim).to(vec16_dtype), torch.randn(n, H, head_dim).to(vec16_dtype)
    theirs = torch.randn(NB, H, BS, 2 * head_dim).to(vec16_dtype)
    ours = theirs.clone()
    kernel_write(theirs, keys, values, request_slots(blocks, n), isa="vec16")
    heads, slots = torch.arange(H).repeat_interleave(n), torch.arange(n).repeat(H)
    write_entries(ours, blocks, heads, slots, keys[slots, heads], values[slots, heads])
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    got_k, got_v = read_request(theirs, blocks, n)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))


@pytest.mark.parametrize("name", ["vec", "amx", "flash"])
def test_table_key_logits_are_each_requests_own(name):
    """The attention backend's product for a batch of requests of one layer (`table_key_logits`: their blocks in
    one table, a short request's row padded) is, request by request, the compaction's product over its own blocks
    (`request_key_logits`), slot for slot, on every layout."""
    from kvtrim.vllm import layout, layout_amx, layout_flash

    module = {"vec": layout, "amx": layout_amx, "flash": layout_flash}[name]
    torch.manual_seed(3)
    cache = torch.randn(NB, H, BS, 2 * D).bfloat16()
    table = torch.tensor([[4, 9, 2], [7, 1, 7], [11, 0, 5]])  # the second: two blocks, padded with its first
    lengths = [3 * BS - 5, 2 * BS, 2 * BS + 1]
    query = torch.randn(3, 3 * H, D).bfloat16()
    logits = module.table_key_logits(cache, table, query)
    assert logits.shape == (3, 3 * H, 3 * BS)
    for r, n in enumerate(lengths):
        own = module.request_key_logits([cache], table[r, :-(-n // BS)], n, query[r][None, :, None])
        torch.testing.assert_close(logits[r, :, :n], own[0, :, 0], rtol=0, atol=0)


def test_write_entries_is_a_read_modify_write(dtype):
    torch.manual_seed(5)
    blocks = torch.tensor([4, 10, 2])
    n = 2 * BS + 3
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    kernel_write(cache, torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype), request_slots(blocks, n))
    heads, slots = torch.tensor([0, 2, 2, 1]), torch.tensor([3, 0, BS + 7, 2 * BS + 2])
    k, v = torch.randn(4, D).to(dtype), torch.randn(4, D).to(dtype)
    want_k, want_v = read_request(cache, blocks, n)
    want_k[heads, slots], want_v[heads, slots] = k, v
    write_entries(cache, blocks, heads, slots, k, v)
    got_k, got_v = read_request(cache, blocks, n)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_move_entries_copies_each_heads_entry_in_place(dtype):
    """`move_entries` (the positions-only path: where the moved entries lie is computed once for all layers) does
    what reading the request, moving the entries and writing them back does, and nothing else."""
    torch.manual_seed(6)
    blocks = torch.tensor([5, 1, 11])
    n = 2 * BS + 20
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    kernel_write(cache, torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype), request_slots(blocks, n))
    heads, src, dst = torch.tensor([0, 1, 2, 2]), torch.tensor([2 * BS + 19, 2 * BS + 3, BS + 1, 2 * BS]), \
        torch.tensor([4, 0, 7, BS + 30])
    want_k, want_v = read_request(cache, blocks, n)
    want_k[heads, dst], want_v[heads, dst] = want_k[heads, src], want_v[heads, src]
    untouched = cache.clone()
    move_entries(cache, heads, slot_places(blocks, src, BS), slot_places(blocks, dst, BS))
    got_k, got_v = read_request(cache, blocks, n)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    others = torch.ones(NB, dtype=torch.bool)
    others[blocks] = False
    assert torch.equal(cache[others], untouched[others])  # other requests' blocks are left alone


def test_fill_holes_moves_only_kept_entries_past_the_kept_count():
    """Slow reference: per head, the evicted slots below n_keep, filled in order by the kept slots past it."""
    torch.manual_seed(6)
    for _ in range(20):
        h, stored = 3, 40
        n_keep = int(torch.randint(1, stored, ()))
        kept = torch.zeros(h, stored, dtype=torch.bool)
        for i in range(h):
            kept[i, torch.randperm(stored)[:n_keep]] = True
        heads, from_slots, to_slots, order = fill_holes(kept, n_keep)
        moves = set(zip(heads.tolist(), from_slots.tolist(), to_slots.tolist()))
        want = set()
        for i in range(h):
            holes = [j for j in range(n_keep) if not kept[i, j]]
            sources = [j for j in range(n_keep, stored) if kept[i, j]]
            assert len(holes) == len(sources)
            want |= {(i, a, b) for a, b in zip(sources, holes)}
            assert sorted(order[i].tolist()) == kept[i].nonzero().flatten().tolist()
        assert moves == want


@pytest.mark.parametrize("one_allocation", [False, True])
def test_move_layers_into_puts_each_rows_entries_in_the_order_given(one_allocation):
    """Slow reference: per layer and KV head, slot `j` afterwards holds what slot `order[j]` held before (slots
    both source and target included: kept entries shifted down over evicted ones, and a reversal); the slots
    past the kept count and the other KV heads' entries are untouched."""
    from kvtrim.vllm.block_io import move_layers_into

    blocks, n, n_layers = torch.tensor([5, 2, 8]), 2 * BS + 9, 2
    caches, _ = request_caches(blocks, n, n_layers, torch.float32, seed=12, one_allocation=one_allocation)
    before = [read_request(kv, blocks, n) for kv in caches]
    torch.manual_seed(13)
    n_keep = n - 11
    order = torch.stack([torch.randperm(n)[:n_keep].sort().values for _ in range(n_layers * H)]).view(n_layers, H, n_keep)
    order[1, 2] = order[1, 2].flip(0)  # not ascending: entries change places
    order[0, 1] = torch.arange(n_keep)  # nothing moves
    move_layers_into(cpu_vec, caches, blocks, order)
    for layer, kv in enumerate(caches):
        got, (keys, values) = read_request(kv, blocks, n), before[layer]
        for head in range(H):
            want_k, want_v = keys[head].clone(), values[head].clone()
            for j in range(n_keep):
                want_k[j], want_v[j] = keys[head, order[layer, head, j]], values[head, order[layer, head, j]]
            assert torch.equal(got[0][head], want_k) and torch.equal(got[1][head], want_v), (layer, head)


def test_a_streaming_decode_step_leaves_a_hole_the_next_token_fills():
    """StreamingLLM over budget evicts one entry a step, the same slot in every layer and KV head: the compaction
    moves nothing and leaves that slot as a hole, where the next token is written (`fill_hole`)."""
    method = method_for_vllm("streaming:budget=40")
    blocks = torch.tensor([3, 8, 1])
    prompt = 2 * BS
    caches, _ = request_caches(blocks, prompt + 1, 3, torch.float32, seed=7)
    entries = RequestEntries()
    compact(caches, blocks, method, entries, forward_steps(0, prompt, prompt), prompt, prompt)
    assert entries.hole is None  # the prompt's end evicted many: moved
    before = [c.clone() for c in caches]
    gone = compact(caches, blocks, method, entries, forward_steps(prompt, prompt + 1, prompt), prompt + 1, prompt)
    assert gone == prompt + 1 - 40 and all(torch.equal(a, b) for a, b in zip(caches, before))  # nothing moved
    hole = entries.hole
    assert entries.m == 41 and hole == int(entries.positions[0][0].argsort()[method.sink_size])
    assert all(p is entries.positions[0] for p in entries.positions)  # one decision, one positions tensor
    assert (entries.slots(0)[:, hole] == -1).all()
    assert entries.fill_hole(prompt + 1) == hole and entries.hole is None and entries.seen == prompt + 2
    assert (entries.slots(0)[:, hole] == prompt + 1).all() and all(p is entries.positions[0] for p in entries.positions)


def test_streaming_decode_steps_run_in_place_on_one_live_layer():
    """Each StreamingLLM decode step over budget after the first runs in place on the request's live decision
    layer (its free slot the engine's hole: no resume, sort or search) and decides what a layer resumed from the
    positions decides (the general path, taken when the live layer is dropped)."""
    import copy

    method = method_for_vllm("streaming:budget=40:sink_size=2")
    blocks = torch.tensor([3, 8, 1])
    prompt = 2 * BS
    caches, _ = request_caches(blocks, prompt, 2, torch.float32, seed=7)
    entries = RequestEntries()
    compact(caches, blocks, method, entries, forward_steps(0, prompt, prompt), prompt, prompt)
    assert entries.live is None  # the prompt's end moved entries: no hole, no live layer
    live = None
    for end in range(prompt + 1, prompt + 30):
        entries.fill_hole(end - 1)
        general = copy.deepcopy(entries)
        general.live = None
        compact(caches, blocks, method, entries, forward_steps(end - 1, end, prompt), end, prompt)
        compact([c.clone() for c in caches], blocks, method, general, forward_steps(end - 1, end, prompt), end, prompt)
        assert entries.hole == general.hole is not None and torch.equal(entries.positions[0], general.positions[0])
        assert entries.live is not None and (live is None or entries.live is live)  # the same layer, step after step
        live = entries.live
    kept = entries.positions[0].index_fill(-1, torch.tensor([entries.hole]), -1).sort(dim=-1).values[:, 1:]
    assert kept.tolist() == [[0, 1] + list(range(end - 38, end))] * H  # the sinks and the last 38


def reference_kept(method, layers, prompt):
    """TrimCache on one layer at a time, as model.generate runs it: the prompt in one forward that ends it, the
    tokens after it (a recomputed request's) as an append. Kept positions (h, n_keep) per layer."""
    kept = []
    for idx, (k, v) in enumerate(layers):
        cache = TrimCache(method)
        with cache.phase(Phase.PREFILL, ends_prompt=True):
            cache.update(k[None, :, :prompt].clone(), v[None, :, :prompt].clone(), idx)
        if k.shape[1] > prompt:
            with cache.phase(Phase.APPEND if k.shape[1] - prompt > 1 else Phase.DECODE):
                cache.update(k[None, :, prompt:].clone(), v[None, :, prompt:].clone(), idx)
        kept.append(cache.layers[idx].kept_positions()[0])
    return kept


def layer_caches(n_layers, dtype, one_allocation=False):
    """Per layer an empty cache: each its own tensor, or (`one_allocation`) views of one, back to back, as vLLM
    allocates them (`layers_as_blocks` then moves every layer's entries at once)."""
    if one_allocation:
        return list(torch.zeros(n_layers, NB, H, BS, 2 * D, dtype=dtype).unbind(0))
    return [torch.zeros(NB, H, BS, 2 * D, dtype=dtype) for _ in range(n_layers)]


def request_caches(blocks, n, n_layers, dtype, seed, one_allocation=False):
    """Per layer a fresh cache holding a request's `n` random entries (written by vLLM's kernel), and the
    entries `(h, n, d)` themselves."""
    torch.manual_seed(seed)
    caches, originals = layer_caches(n_layers, dtype, one_allocation), []
    for cache in caches:
        keys = (torch.randn(n, H, D) * torch.linspace(0.5, 2, D)).to(dtype)
        values = torch.randn(n, H, D).to(dtype)
        kernel_write(cache, keys, values, request_slots(blocks, n))
        originals.append((keys.transpose(0, 1), values.transpose(0, 1)))
    return caches, originals


def assert_holds(caches, blocks, originals, expected, entries):
    """Every layer's cache holds, for every KV head, exactly its original entries at the `expected` positions
    (in the slot order `entries.positions` records, then the tokens after its last compaction in order)."""
    for i, (cache, (k, v), kept) in enumerate(zip(caches, originals, expected)):
        compacted = entries.slots(i)  # -1 at a hole
        filled = compacted.shape[-1] - (entries.hole is not None)
        tail = torch.arange(entries.seen, entries.seen + kept.shape[-1] - filled).expand(H, -1)
        slots = torch.cat([compacted, tail], dim=-1)
        real = slots[0] >= 0  # the same slots in every head
        assert torch.equal(slots[:, real].sort(dim=-1).values, kept)
        got_k, got_v = read_request(cache, blocks, slots.shape[-1])
        for h in range(H):
            assert torch.equal(got_k[h, real], k[h, slots[h, real]]) and torch.equal(got_v[h, real], v[h, slots[h, real]])


@pytest.mark.parametrize("spec", ["lagkv:compression_ratio=0.5:lag_size=32:sink_size=4", "keydiff:compression_ratio=0.5",
                                  "streaming:compression_ratio=0.75", "knorm:compression_ratio=0.5",
                                  "lagkv:compression_ratio=0.75:lag_size=16", "keydiff:budget=60:block_size=16",
                                  "lagkv:lag_size=16:sink_size=4"])
def test_compaction_keeps_trimcache_positions(spec, dtype):
    method = method_for_vllm(spec)
    prompt, tail, n_layers = 5 * BS + 7, 3, 3  # `tail`: a recomputed request's tokens after the prompt
    stored = prompt + tail
    blocks = torch.tensor([11, 1, 6, 3, 8, 0])
    caches, originals = request_caches(blocks, stored, n_layers, dtype, seed=2)
    expected = reference_kept(method, originals, prompt)
    # a request whose first forward computes its prompt and `tail` more tokens (a recomputed request)
    entries = RequestEntries()
    gone = compact(caches, blocks, method, entries, forward_steps(0, stored, prompt), stored, prompt)
    assert gone == stored - expected[0].shape[-1] > 0
    assert_holds(caches, blocks, originals, expected, entries)


@pytest.mark.parametrize("spec", ["lagkv:lag_size=16:sink_size=4", "lagkv:keep_ratio=0.25:lag_size=8:sink_size=2",
                                  "keydiff:budget=40:block_size=16", "keydiff:budget=50:block_size=8:sink_size=4",
                                  "streaming:budget=40", "streaming:budget=30:sink_size=2"])
@pytest.mark.parametrize("layer_group,one_allocation", [(10, False), (2, False), (10, True)])
def test_decoding_compactions_keep_trimcache_positions(spec, dtype, layer_group, one_allocation, monkeypatch):
    """The engine's path, token by token: each decode step's entry lands at the slot after what the request
    stores (or in the hole the last compaction left), the stand-in says which steps are due, and those compact
    the blocks (methods whose layers are alike decide them in batches of `layer_group` layers). The blocks end
    up holding exactly what `TrimCache` keeps when generate feeds it the same keys (prompt, then one token at a
    time), layer by layer."""
    monkeypatch.setattr(compact_module, "LAYER_GROUP", layer_group)
    method = method_for_vllm(spec)
    prompt, new, n_layers = 2 * BS + 5, 70, 3
    blocks = torch.tensor([9, 4, 11, 0, 7, 2])
    caches, originals = request_caches(blocks, prompt, n_layers, dtype, seed=3, one_allocation=one_allocation)
    torch.manual_seed(4)
    more = [((torch.randn(new, H, D) * torch.linspace(0.5, 2, D)).to(dtype), torch.randn(new, H, D).to(dtype))
            for _ in range(n_layers)]
    originals = [(torch.cat([k, mk.transpose(0, 1)], 1), torch.cat([v, mv.transpose(0, 1)], 1))
                 for (k, v), (mk, mv) in zip(originals, more)]
    counts, entries, gone, due_decodes = StoredCounts(method), RequestEntries(), 0, 0
    for end in [prompt] + list(range(prompt + 1, prompt + new + 1)):
        if end > prompt:  # the decode step writes its token into the hole, or where the stored entries end
            hole = entries.fill_hole(end - 1)
            slot = request_slots(blocks, end - gone)[-1:] if hole is None else request_slots(blocks, hole + 1)[-1:]
            for cache, (mk, mv) in zip(caches, more):
                kernel_write(cache, mk[end - prompt - 1:end - prompt], mv[end - prompt - 1:end - prompt], slot)
        steps = forward_steps(end - 1 if end > prompt else 0, end, prompt)
        if counts.advance(steps):
            gone = compact(caches, blocks, method, entries, steps, end, prompt)
            assert gone == counts.discarded
            due_decodes += end > prompt
    reference = []
    for idx, (k, v) in enumerate(originals):
        cache = TrimCache(method)
        with cache.phase(Phase.PREFILL, ends_prompt=True):
            cache.update(k[None, :, :prompt].clone(), v[None, :, :prompt].clone(), idx)
        for t in range(prompt, prompt + new):
            cache.update(k[None, :, t:t + 1].clone(), v[None, :, t:t + 1].clone(), idx)
        reference.append(cache.layers[idx].kept_positions()[0])
    assert due_decodes >= 2 and gone == prompt + new - reference[0].shape[-1]
    assert_holds(caches, blocks, originals, reference, entries)


@pytest.mark.parametrize("spec", ["keydiff:budget=40:block_size=16", "keydiff:budget=50:block_size=24:sink_size=4"])
@pytest.mark.parametrize("chunk", [64, 5])
def test_prompt_block_compactions_keep_trimcache_positions(spec, chunk, dtype):
    """A prompt read in blocks in the engine (vLLM's chunks of `chunk` tokens cut at the block ends, as the
    scheduler cuts them; each chunk's entries written after what the request stores, the completed blocks
    compacted), then decoded: the blocks hold exactly what `TrimCache` keeps when `kvtrim.prefill` feeds it the
    same keys in blocks, and generate then one token at a time."""
    method = method_for_vllm(spec)
    block = method.prefill_block_size()
    prompt, new, n_layers = 4 * BS + 9, 30, 2
    total = prompt + new
    blocks = torch.tensor([9, 4, 11, 0, 7, 2, 5, 1])
    torch.manual_seed(5)
    originals = [((torch.randn(H, total, D) * torch.linspace(0.5, 2, D)).to(dtype), torch.randn(H, total, D).to(dtype))
                 for _ in range(n_layers)]
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=dtype) for _ in range(n_layers)]
    forwards = block_forwards(prompt, total, block, chunk)  # vLLM's chunks cut at the block ends, then one token each
    counts, entries, gone, prompt_compactions = StoredCounts(method), RequestEntries(), 0, 0
    for start, end in forwards:  # each forward writes its tokens at the slots after the stored entries
        slots = request_slots(blocks, end - gone)[start - gone:]
        for cache, (k, v) in zip(caches, originals):
            kernel_write(cache, k[:, start:end].transpose(0, 1).contiguous(), v[:, start:end].transpose(0, 1).contiguous(),
                         slots)
        steps = forward_steps(start, end, prompt, block)
        if steps and counts.advance(steps):
            gone = compact(caches, blocks, method, entries, steps, end, prompt)
            assert gone == counts.discarded
            prompt_compactions += end < prompt
    reference = []
    for idx, (k, v) in enumerate(originals):
        cache = TrimCache(method)
        for s in range(0, prompt, block):
            q = min(block, prompt - s)
            with cache.phase(Phase.PREFILL, ends_prompt=s + q == prompt):
                cache.update(k[None, :, s:s + q].clone(), v[None, :, s:s + q].clone(), idx)
        for t in range(prompt, total):
            cache.update(k[None, :, t:t + 1].clone(), v[None, :, t:t + 1].clone(), idx)
        reference.append(cache.layers[idx].kept_positions()[0])
    assert prompt_compactions >= 2 and gone == total - reference[0].shape[-1]
    assert_holds(caches, blocks, originals, reference, entries)


@pytest.mark.parametrize("spec", ["snapkv:compression_ratio=0.5:window=8", "snapkv:compression_ratio=0.75",
                                  "snapkv:compression_ratio=0.6:window=16:kernel=3:pooling=avg"])
@pytest.mark.parametrize("tail", [0, 3])
def test_snapkv_compaction_gets_the_prompts_queries(spec, tail, dtype):
    """SnapKV at the prompt's end: given each layer's last `W` queries (what the attention tap captures) and its
    scale, the compaction keeps, per layer and KV head, what `TrimCache` keeps when kvtrim's attention hands it
    the prompt forward's queries (all of them) after the same keys; a recomputed request's tokens after the
    prompt are an append, which reads no queries."""
    method = method_for_vllm(spec)
    prompt, n_layers, q_heads, scale = 5 * BS + 7, 3, 3 * H, 0.125
    stored = prompt + tail
    blocks = torch.tensor([11, 1, 6, 3, 8, 0])
    caches, originals = request_caches(blocks, stored, n_layers, dtype, seed=6)
    torch.manual_seed(7)
    queries = [torch.randn(q_heads, stored, D).to(dtype) for _ in range(n_layers)]
    expected = []
    for idx, ((k, v), q) in enumerate(zip(originals, queries)):
        cache = TrimCache(method)
        with cache.phase(Phase.PREFILL, ends_prompt=True):
            cache.update(k[None, :, :prompt].clone(), v[None, :, :prompt].clone(), idx)
        cache.layers[idx].after_attention(q[None, :, :prompt], None, scale)
        if tail:
            with cache.phase(Phase.APPEND):
                cache.update(k[None, :, prompt:].clone(), v[None, :, prompt:].clone(), idx)
            cache.layers[idx].after_attention(q[None, :, prompt:], None, scale)
        expected.append(cache.layers[idx].kept_positions()[0])
    window = method.prompt_queries()
    entries = RequestEntries()
    gone = compact(caches, blocks, method, entries, forward_steps(0, stored, prompt), stored, prompt,
                   [q[:, prompt - window:prompt] for q in queries], [scale] * n_layers)
    assert gone == stored - expected[0].shape[-1] > 0
    assert_holds(caches, blocks, originals, expected, entries)
    assert any(not torch.equal(e, expected[0]) for e in expected[1:])  # each layer's own queries decided it


@pytest.mark.parametrize("spec", ["snapkv:budget=30:window=8:block_size=24",
                                  "snapkv:budget=40:window=16:block_size=10:kernel=3:pooling=avg"])
@pytest.mark.parametrize("chunk", [64, 5])
def test_snapkv_prompt_blocks_get_each_blocks_queries(spec, chunk, dtype):
    """Block-wise SnapKV in the engine (vLLM's chunks cut at the block ends): each completed block's compaction
    gets each layer's last `min(window, block)` queries of that block (what the attention tap captures); the
    blocks hold what `TrimCache` keeps when `kvtrim.prefill` feeds the same keys in blocks and kvtrim's attention
    hands it each block's queries (all of them), then one token at a time."""
    method = method_for_vllm(spec)
    block, window, scale = method.prefill_block_size(), method.prompt_queries(), 0.125
    prompt, new, n_layers = 4 * BS + 9, 12, 2
    total = prompt + new
    blocks = torch.tensor([9, 4, 11, 0, 7, 2, 5, 1])
    torch.manual_seed(8)
    originals = [(torch.randn(H, total, D).to(dtype), torch.randn(H, total, D).to(dtype)) for _ in range(n_layers)]
    queries = [torch.randn(3 * H, total, D).to(dtype) for _ in range(n_layers)]
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=dtype) for _ in range(n_layers)]
    forwards = block_forwards(prompt, total, block, chunk)  # vLLM's chunks cut at the block ends, then one token each
    counts, entries, gone, compactions = StoredCounts(method), RequestEntries(), 0, 0
    for start, end in forwards:
        slots = request_slots(blocks, end - gone)[start - gone:]
        for cache, (k, v) in zip(caches, originals):
            kernel_write(cache, k[:, start:end].transpose(0, 1).contiguous(), v[:, start:end].transpose(0, 1).contiguous(),
                         slots)
        steps = forward_steps(start, end, prompt, block)
        if steps and counts.advance(steps):
            w = min(window, steps[0].tokens)
            gone = compact(caches, blocks, method, entries, steps, end, prompt, [q[:, end - w:end] for q in queries],
                           [scale] * n_layers)
            assert gone == counts.discarded
            compactions += 1
    reference = []
    for idx, ((k, v), q) in enumerate(zip(originals, queries)):
        cache = TrimCache(method)
        for s in range(0, prompt, block):
            n = min(block, prompt - s)
            with cache.phase(Phase.PREFILL, ends_prompt=s + n == prompt):
                cache.update(k[None, :, s:s + n].clone(), v[None, :, s:s + n].clone(), idx)
            cache.layers[idx].after_attention(q[None, :, s:s + n], None, scale)
        for t in range(prompt, total):
            cache.update(k[None, :, t:t + 1].clone(), v[None, :, t:t + 1].clone(), idx)
            if cache.layers[idx].awaiting_attention:
                cache.layers[idx].after_attention(q[None, :, t:t + 1], None, scale)
        reference.append(cache.layers[idx].kept_positions()[0])
    assert compactions >= 3 and gone == total - reference[0].shape[-1]
    assert_holds(caches, blocks, originals, reference, entries)
    assert any(not torch.equal(e, reference[0]) for e in reference[1:])  # each layer's own queries decided it


@pytest.mark.parametrize("spec", ["tova:budget=40", "tova:budget=100", "tova:compression_ratio=0.5", "h2o:budget=40",
                                  "h2o:budget=100", "h2o:compression_ratio=0.5", "h2o:heavy_budget=10:recent_budget=20",
                                  "lazyeviction:budget=40:window=8:alpha=0.02", "lazyeviction:budget=100:window=16",
                                  "lazyeviction:budget=30:window=5:alpha=0.03:gqa=per_query_head"])
@pytest.mark.parametrize("tail,one_allocation", [(0, False), (3, False), (0, True)])
def test_decoding_compactions_get_their_steps_attention(spec, tail, one_allocation, dtype):
    """TOVA, H2O and LazyEviction in the engine, token by token: the prompt's compaction gets each layer's last
    prompt queries (TOVA: the last one; H2O: its prompt's attention column sums instead, added up in prefill chunks
    of 16 rows by `add_prompt_sums`), every due forward after it the queries of its tokens after the
    prompt (what the attention tap captures), from which the compaction computes a decode step's probabilities
    over the layer's stored entries (H2O: accumulated in its state, LazyEviction: its recurrence state, carried
    from one compaction to the next). The blocks end up holding, per layer and KV
    head, what `TrimCache` keeps when kvtrim's attention hands it the same queries and the probabilities that
    made each decode step's output (in-place decoding, as generate runs it); `tail`: a recomputed request's
    tokens after its prompt in the prompt's forward (an append). The decode steps run on one decision layer
    kept between them (`LiveDecode`), not on one resumed at each step."""
    prompt = 2 * BS + 5
    first, total = prompt + tail, prompt + tail + 60
    live_layers = decode_as_the_engine(spec, prompt, [(0, first)] + [(t, t + 1) for t in range(first, total)],
                                       one_allocation, dtype)
    assert len(live_layers) == 1


@pytest.mark.parametrize("spec", ["tova:budget=40", "h2o:budget=40", "h2o:heavy_budget=10:recent_budget=20",
                                  "lazyeviction:budget=40:window=8:alpha=0.02"])
def test_a_multi_token_forward_between_decode_steps_leaves_the_live_layer(spec):
    """An append between decode steps (tokens after the prompt in one forward) compacts the request from its
    positions and the method's state as the live layer left them (in position order again, without its free
    slot: `LiveInPlace.settled_state`); the decode steps after it run on a new live layer. The blocks still hold
    what `TrimCache` keeps."""
    prompt = 2 * BS + 5
    forwards = ([(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + 25)] + [(prompt + 25, prompt + 28)]
                + [(t, t + 1) for t in range(prompt + 28, prompt + 50)])
    assert len(decode_as_the_engine(spec, prompt, forwards, True, torch.float32)) == 2


def decode_as_the_engine(spec, prompt, forwards, one_allocation, dtype):
    """Run the engine's compactions of a request under `spec` over `forwards` `(start, end)` (the prompt's first),
    writing each forward's random entries where the engine writes them, and check that the blocks end up holding
    what `TrimCache` keeps when kvtrim's attention hands it the same queries and probabilities (the module's
    test above). Returns the live layers that took its decode steps."""
    from kvtrim.attention import attend_with_probabilities
    from kvtrim.vllm.block_io import add_prompt_sums
    from kvtrim.vllm.spec import prompt_queries, prompt_sums

    method = method_for_vllm(spec)
    n_layers, q_heads, scale = 3, 3 * H, 0.125
    total = forwards[-1][1]
    blocks = torch.tensor([9, 4, 11, 0, 7, 2, 5, 1])
    torch.manual_seed(8)
    originals = [((torch.randn(H, total, D) * torch.linspace(0.5, 2, D)).to(dtype), torch.randn(H, total, D).to(dtype))
                 for _ in range(n_layers)]
    queries = [(torch.randn(q_heads, total, D) * torch.linspace(0.5, 2, D)).to(dtype) for _ in range(n_layers)]
    caches = layer_caches(n_layers, dtype, one_allocation)
    counts, entries, gone, due_decodes, live_layers = StoredCounts(method), RequestEntries(), 0, 0, []
    for start, end in forwards:
        hole = entries.fill_hole(start) if start > prompt else None
        slots = request_slots(blocks, end - gone)[start - gone:] if hole is None else request_slots(blocks, hole + 1)[-1:]
        for cache, (k, v) in zip(caches, originals):
            kernel_write(cache, k[:, start:end].transpose(0, 1).contiguous(), v[:, start:end].transpose(0, 1).contiguous(),
                         slots)
        steps = forward_steps(start, end, prompt)
        if counts.advance(steps):
            window, sums = prompt_queries(method), None
            if prompt_sums(method) and start == 0:
                sums = [torch.zeros(H, prompt) for _ in range(n_layers)]
                for c in range(0, prompt, 16):
                    add_prompt_sums(sums, caches, blocks, [q[:, c:min(c + 16, prompt)] for q in queries], c,
                                    [scale] * n_layers, method.prefill_block)
            last, step_probs = [q[:, max(start, prompt):end] for q in queries] if end > prompt else None, None
            if one_allocation and end == start + 1 > prompt:  # the step's probabilities as kvtrim's attention backend
                stored = end - gone                              # computes them
                step_probs = torch.stack([torch_key_probs(cpu_vec)(kv, blocks[None, :-(-stored // BS)], q[None, :, 0],
                                                                   torch.tensor([stored]), scale)
                                           for kv, q in zip(caches, last)])[:, 0, :, None, :stored]
                last = torch.stack(last)
            gone = compact(caches, blocks, method, entries, steps, end, prompt,
                           None if sums else [q[:, prompt - window:prompt] for q in queries], [scale] * n_layers,
                           last, sums, step_probs=step_probs)
            assert gone == counts.discarded
            due_decodes += end == start + 1 > prompt
            if entries.live is not None and not any(c is entries.live.cache for c in live_layers):
                live_layers.append(entries.live.cache)  # a decision layer, resumed at a decode step, takes later ones
    reference = []
    for idx, ((k, v), q) in enumerate(zip(originals, queries)):
        cache = TrimCache(method)
        for start, end in forwards:
            if start == 0:  # the prompt (then any tokens after it in its forward: a recomputed request's, an append)
                with cache.phase(Phase.PREFILL, ends_prompt=True):
                    cache.update(k[None, :, :prompt].clone(), v[None, :, :prompt].clone(), idx)
                cache.layers[idx].after_attention(q[None, :, :prompt], None, scale)
                start = prompt
            q_s = q[None, :, start:end]
            if start == end:
                continue
            if end > start + 1:  # an append
                with cache.phase(Phase.APPEND):
                    cache.update(k[None, :, start:end].clone(), v[None, :, start:end].clone(), idx)
                cache.layers[idx].after_attention(q_s, None, scale)
            else:
                full_k, full_v = cache.update(k[None, :, start:end].clone(), v[None, :, start:end].clone(), idx)
                cache.layers[idx].after_attention(q_s, attend_with_probabilities(q_s, full_k, full_v, None, scale)[1],
                                                  scale)
        reference.append(cache.layers[idx].kept_positions()[0].sort(dim=-1).values)
    assert due_decodes >= 2 and gone == total - reference[0].shape[-1]
    assert_holds(caches, blocks, originals, reference, entries)
    assert any(not torch.equal(e, reference[0]) for e in reference[1:])  # each layer's own attention decided it
    return live_layers


def test_layers_as_blocks_views_every_layer_only_when_they_lie_back_to_back():
    """One view of every layer's cache when vLLM's one allocation holds them back to back (layer `l`'s block `b`
    is the view's block `l * NB + b`), and a block copy through it is each layer's own; None for layers apart."""
    from kvtrim.vllm.block_io import copy_blocks, layers_as_blocks

    caches = layer_caches(3, torch.float32, one_allocation=True)
    for idx, cache in enumerate(caches):
        cache.copy_(torch.randn_like(cache) + 10 * idx)
    stacked = layers_as_blocks(caches)
    assert stacked is not None and stacked.shape == (3 * NB, H, BS, 2 * D)
    assert all(torch.equal(stacked[idx * NB + 5], cache[5]) for idx, cache in enumerate(caches))
    expected = [c.clone() for c in caches]
    for e in expected:
        e[[7, 2]] = e[[1, 4]]
    copy_blocks(caches, torch.tensor([1, 4]), torch.tensor([7, 2]))
    assert all(torch.equal(c, e) for c, e in zip(caches, expected))
    assert layers_as_blocks(layer_caches(3, torch.float32)) is None  # each its own tensor
    assert layers_as_blocks(caches[::2]) is None  # a layer between them
    assert layers_as_blocks(caches[1:]) is not None
