"""vLLM's CPU KV block layout of the AMX kernel ("amx": bfloat16 models on CPUs with AMX tiles) and the compaction
on it (run from .venv-serve; skipped without vLLM).

The layout was measured with vLLM's own write kernel (`cpu_attn_reshape_and_cache`, isa "amx"): `reference_write`
puts each element where the kernel does, at flat offsets computed from the measured packing alone (never through
`layout_amx`'s views). The tests that run the kernel need AMX (they check the reference writer and the layout
functions against the kernel, and vLLM's AMX attention on caches the functions wrote and compacted); the rest
check the layout functions against the reference writer and run everywhere."""

import math

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

from kvtrim.vllm import layout as cpu_vec  # noqa: E402
from kvtrim.vllm import layout_amx  # noqa: E402
from kvtrim.vllm.block_layout import BlockLayout, block_layout  # noqa: E402
from kvtrim.vllm.block_io import fill_holes  # noqa: E402
from kvtrim.vllm.layout_amx import (move_entries, read_keys, read_request, request_key_logits,  # noqa: E402
                                    slot_places, write_entries)
from test_vllm_layout import BS, D, H, NB, kernel_write, request_slots  # noqa: E402
from test_vllm_layout_flash import compacts_as_on_the_vec_cache, random_tokens  # noqa: E402

HAS_AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="vLLM's 'amx' kernel runs only on a CPU with AMX tiles "
                                                   "(torch.cpu._is_amx_tile_supported() is False here)")

#: (block_size, head_dim, kv_heads, blocks) the layout functions meet: vLLM's default block, and a long block
#: with a head size that is an odd number of 32s
GEOMETRIES = [(BS, D, H, NB), (128, 96, 2, 5)]


def reference_write(cache, heads, vllm_slots, keys, values):
    """The measured "amx" packing: KV head `heads[i]`'s key and value `(m, d)` stored for vLLM slot `vllm_slots[i]`
    (block `slot // bs`, token `t = slot % bs`) into the contiguous `cache` `(nb, h, bs, 2d)`, by flat element
    offsets. Per (block, head) slab of `2 * bs * d` elements, keys first: key channel `c` at
    `((t // 16) * (d / 2) + c // 2) * 32 + (t % 16) * 2 + c % 2`; then values: value channel `c` at
    `bs * d + ((c // 16) * (bs / 2) + t // 2) * 32 + (c % 16) * 2 + t % 2`."""
    nb, h, bs, two_d = cache.shape
    d = two_d // 2
    flat = cache.view(-1)
    t, c = (vllm_slots % bs)[:, None], torch.arange(d)
    slab = (((vllm_slots // bs) * h + heads) * 2 * bs * d)[:, None]
    flat[slab + ((t // 16) * (d // 2) + c // 2) * 32 + (t % 16) * 2 + c % 2] = keys.to(cache.dtype)
    flat[slab + bs * d + ((c // 16) * (bs // 2) + t // 2) * 32 + (c % 16) * 2 + t % 2] = values.to(cache.dtype)


def reference_tokens(cache, keys, values, slots):
    """What the attention layer stores for a forward, by the reference writer: every KV head of tokens `(n, h, d)`
    at vLLM `slots` `(n,)`."""
    n, h, d = keys.shape
    reference_write(cache, torch.arange(h).repeat(n), slots.repeat_interleave(h), keys.reshape(n * h, d),
                    values.reshape(n * h, d))


def amx_write(cache, keys, values, slots):
    kernel_write(cache, keys, values, slots, isa="amx")


def random_cache(nb, h, bs, d, dtype, seed=0):
    """A cache of random bytes (NaNs and all), so that what no write touched stays recognisable."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (nb * h * bs * 2 * d * dtype.itemsize,), dtype=torch.int8, generator=g)
    return raw.view(dtype).view(nb, h, bs, 2 * d)


def same_bytes(a, b):
    return torch.equal(a.view(torch.int8), b.view(torch.int8))


def slots_of(blocks, n, bs):
    i = torch.arange(n)
    return blocks[i // bs] * bs + i % bs


@pytest.fixture(params=[torch.bfloat16, torch.float32])
def dtype(request):
    """bfloat16: the one dtype vLLM runs "amx" with; float32: the functions do not depend on the dtype."""
    return request.param


# ---- the measurement: vLLM's kernel against the reference writer (AMX only) ---------------------------------

def distinct_bf16(count, seed):
    """`count` bfloat16 numbers with distinct bit patterns (finite, subnormals and -0 included): an element found
    anywhere in the cache says which (token, head, channel, key or value) it is."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32)
    finite = bits[(bits & 0x7F80) != 0x7F80]
    pick = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(seed))[:count]]
    return pick.to(torch.int16).view(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("bs, d, h, n", [(32, 64, 3, 3 * 32 + 5), (64, 128, 2, 64 + 37), (128, 96, 1, 128 + 50),
                                         (32, 256, 1, 32 + 20), (256, 32, 1, 256 + 100)])
def test_the_kernel_packs_blocks_as_measured(bs, d, h, n):
    """Every (token, head, channel) of keys and values a distinct bfloat16: after vLLM's "amx" kernel writes a
    request (blocks out of order, a partial last one) into a cache of random bytes, every byte of it is what the
    reference writer leaves."""
    nb = -(-n // bs) + 2
    blocks = torch.randperm(nb, generator=torch.Generator().manual_seed(bs))[:-(-n // bs)]
    elements = distinct_bf16(2 * n * h * d, seed=d)
    keys, values = elements[:n * h * d].view(n, h, d), elements[n * h * d:].view(n, h, d)
    theirs = random_cache(nb, h, bs, d, torch.bfloat16, seed=1)
    ours = theirs.clone()
    amx_write(theirs, keys, values, slots_of(blocks, n, bs))
    reference_tokens(ours, keys, values, slots_of(blocks, n, bs))
    assert same_bytes(ours, theirs)


@needs_amx
def test_read_what_the_kernel_wrote():
    torch.manual_seed(0)
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    blocks = torch.tensor([7, 2, 9, 4])  # not contiguous, not in order
    n = 3 * BS + 5  # a partial last block
    keys, values = random_tokens(n, torch.bfloat16)
    amx_write(cache, keys, values, request_slots(blocks, n))
    got_k, got_v = read_request(cache, blocks, n)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
    assert torch.equal(read_keys(cache, blocks, n), keys.transpose(0, 1))


@needs_amx
def test_write_entries_lays_out_as_the_kernel():
    torch.manual_seed(1)
    blocks = torch.tensor([3, 0, 5])
    n = 2 * BS + 9
    keys, values = random_tokens(n, torch.bfloat16)
    theirs = random_cache(NB, H, BS, D, torch.bfloat16, seed=2)
    ours = theirs.clone()
    heads, slots = torch.arange(H).repeat_interleave(n), torch.arange(n).repeat(H)  # every entry of every head
    write_entries(ours, blocks, heads, slots, keys[slots, heads], values[slots, heads])
    amx_write(theirs, keys, values, request_slots(blocks, n))
    assert same_bytes(ours, theirs)


def amx_attention(cache, blocks, seq_len, query, scale):
    """vLLM's "amx" attention (as `CPUAttentionBackendImpl.forward` calls it) of one request's decode query
    `(q_heads, d)` over its first `seq_len` entries."""
    nb, h, bs, two_d = cache.shape
    k_cache, v_cache = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    q = query[None].contiguous()
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32)
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=q.shape[1], num_kv_heads=h, head_dim=two_d // 2, seq_lens=lens, dtype=q.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="amx", enable_kv_split=False)
    out = torch.empty_like(q)
    vllm_ops.cpu_attention_with_kv_cache(
        query=q, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=starts, seq_lens=lens,
        scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=blocks[None].to(torch.int32),
        softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return out[0]


def reference_attention(query, keys, values, scale):
    """float64 attention of `query` `(q_heads, d)` over each KV head's `keys`, `values` `(h, n, d)`."""
    group = query.shape[0] // keys.shape[0]
    k, v = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    probs = torch.softmax(torch.einsum("qd,qnd->qn", query.double(), k) * scale, dim=-1)
    return torch.einsum("qn,qnd->qd", probs, v)


@needs_amx
def test_amx_attention_reads_what_the_layout_functions_wrote_and_moved():
    """vLLM's AMX attention kernel on a cache the layout functions wrote gives the output it gives on the cache
    vLLM's writer wrote (bit for bit), and after `move_entries` compacts each KV head to its own kept entries
    (`fill_holes`), its output over the kept count is the attention over exactly those entries."""
    assert torch.cpu._init_amx(), "the kernel needs AMX tile data enabled for this process"
    torch.manual_seed(9)
    blocks, n, scale = torch.tensor([7, 2, 9, 4]), 3 * BS + 5, 1 / math.sqrt(D)
    keys, values = random_tokens(n, torch.bfloat16)
    query = torch.randn(2 * H, D).bfloat16()
    theirs = torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)
    amx_write(theirs, keys, values, request_slots(blocks, n))
    ours = torch.zeros_like(theirs)
    heads, slots = torch.arange(H).repeat_interleave(n), torch.arange(n).repeat(H)
    write_entries(ours, blocks, heads, slots, keys[slots, heads], values[slots, heads])
    out = amx_attention(ours, blocks, n, query, scale)
    assert torch.equal(out, amx_attention(theirs, blocks, n, query, scale))
    k, v = keys.transpose(0, 1), values.transpose(0, 1)
    torch.testing.assert_close(out.double(), reference_attention(query, k, v, scale), rtol=0.02, atol=0.02)
    n_keep = 60
    kept = torch.zeros(H, n, dtype=torch.bool)
    for head in range(H):  # each head its own entries
        kept[head, torch.randperm(n)[:n_keep]] = True
    moved_heads, from_slots, to_slots, order = fill_holes(kept, n_keep)
    assert moved_heads.numel() > 0
    move_entries(ours, moved_heads, slot_places(blocks, from_slots, BS), slot_places(blocks, to_slots, BS))
    index = order[..., None].expand(-1, -1, D)
    want = reference_attention(query, k.gather(1, index), v.gather(1, index), scale)
    torch.testing.assert_close(amx_attention(ours, blocks, n_keep, query, scale).double(), want, rtol=0.02, atol=0.02)


# ---- the layout functions against the reference writer (everywhere) ---------------------------------------------

@pytest.mark.parametrize("bs, d, h, nb", GEOMETRIES)
def test_read_what_the_reference_wrote(bs, d, h, nb, dtype):
    torch.manual_seed(0)
    cache = random_cache(nb, h, bs, d, dtype)
    blocks = torch.tensor([3, 1, 4])[:nb - 1]  # not contiguous, not in order
    n = (blocks.numel() - 1) * bs + 5  # a partial last block
    keys, values = torch.randn(n, h, d).to(dtype), torch.randn(n, h, d).to(dtype)
    reference_tokens(cache, keys, values, slots_of(blocks, n, bs))
    got_k, got_v = read_request(cache, blocks, n)
    assert got_k.shape == got_v.shape == (h, n, d)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
    assert torch.equal(read_keys(cache, blocks, n), keys.transpose(0, 1))


@pytest.mark.parametrize("bs, d, h, nb", GEOMETRIES)
def test_write_entries_writes_what_the_reference_writes_and_nothing_else(bs, d, h, nb, dtype):
    """Every byte of the cache after `write_entries` is what the reference writer leaves: the entries where it puts
    them, every other block, head, slot and channel as it was; and they read back."""
    torch.manual_seed(1)
    cache = random_cache(nb, h, bs, d, dtype, seed=3)
    blocks = torch.tensor([2, 0, 3])[:nb - 1]
    n = blocks.numel() * bs - 3
    picked = torch.randperm(h * n)[:40]  # distinct (head, slot) entries
    heads, slots = picked // n, picked % n
    keys, values = torch.randn(40, d).to(dtype), torch.randn(40, d).to(dtype)
    want = cache.clone()
    reference_write(want, heads, slots_of(blocks, n, bs)[slots], keys, values)
    write_entries(cache, blocks, heads, slots, keys, values)
    assert same_bytes(cache, want)
    got_k, got_v = read_request(cache, blocks, n)
    assert torch.equal(got_k[heads, slots], keys) and torch.equal(got_v[heads, slots], values)


@pytest.mark.parametrize("bs, d, h, nb", GEOMETRIES)
def test_move_entries_copies_each_heads_entry_in_place(bs, d, h, nb, dtype):
    torch.manual_seed(2)
    cache = random_cache(nb, h, bs, d, dtype, seed=4)
    blocks = torch.tensor([3, 1, 4])[:nb - 1]
    n = blocks.numel() * bs - 1
    keys, values = torch.randn(n, h, d).to(dtype), torch.randn(n, h, d).to(dtype)
    vllm_slots = slots_of(blocks, n, bs)
    reference_tokens(cache, keys, values, vllm_slots)
    heads = torch.tensor([0, 1, h - 1, h - 1])
    src, dst = torch.tensor([n - 1, n - 17, bs + 1, n - 2]), torch.tensor([4, 0, 7, bs + 30])
    want = cache.clone()
    reference_write(want, heads, vllm_slots[dst], keys[src, heads], values[src, heads])
    move_entries(cache, heads, slot_places(blocks, src, bs), slot_places(blocks, dst, bs))
    assert same_bytes(cache, want)


def test_request_key_logits_is_a_matmul(dtype):
    """One query per layer, query head `i` reading KV head `i // 2`, against the layer's first `n` keys."""
    torch.manual_seed(3)
    blocks, n, layers = torch.tensor([8, 3, 6]), 2 * BS + 7, 3
    caches, keys = [], []
    for _ in range(layers):
        k, v = random_tokens(n, dtype)
        cache = random_cache(NB, H, BS, D, dtype)
        reference_tokens(cache, k, v, request_slots(blocks, n))
        caches.append(cache)
        keys.append(k)
    query = torch.randn(layers, 2 * H, 1, D).to(dtype)
    got = request_key_logits(caches, blocks, n, query)
    assert got.shape == (layers, 2 * H, 1, n) and got.dtype == dtype
    for layer, k in enumerate(keys):
        want = query[layer].double().view(H, 2, D) @ k.double().permute(1, 2, 0)  # (H, 2, n)
        tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 0.05}
        torch.testing.assert_close(got[layer].double(), want.view(2 * H, 1, n), **tolerance)
    # the product the "vec" layout computes from the same keys: equal in bfloat16 (one rounding of a float32 sum; the
    # compaction test below needs it, TOVA's decisions come from it), float32 sums in another order
    vec = []
    for k in keys:
        cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
        cpu_vec.write_entries(cache, blocks, torch.arange(H).repeat_interleave(n), torch.arange(n).repeat(H),
                              k.transpose(0, 1).reshape(H * n, D), k.transpose(0, 1).reshape(H * n, D))
        vec.append(cache)
    exact = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, cpu_vec.request_key_logits(vec, blocks, n, query), **exact)


def test_shapes_the_packing_was_not_measured_on_are_refused_in_one_line():
    from kvtrim.methods.base import KvtrimError

    for bs, d in ((32, 80), (16, 64), (48, 64)):
        with pytest.raises(KvtrimError) as refused:
            read_keys(torch.zeros(4, 2, bs, 2 * d, dtype=torch.bfloat16), torch.tensor([1]), 3)
        assert "\n" not in str(refused.value)


def test_the_chooser_picks_the_cpu_kernels_layout():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert block_layout("CPU_ATTN", isa="amx") is layout_amx
    assert block_layout("CPU_ATTN", isa="vec") is cpu_vec and block_layout("CPU_ATTN", isa="vec16") is cpu_vec
    assert isinstance(layout_amx, BlockLayout)
    # what vLLM picks on this machine for the served models (bfloat16 and float32, head sizes 64 and 80) is known
    for dtype in (torch.bfloat16, torch.float32):
        for head_size in (64, 80):
            block_layout("CPU_ATTN", isa=_get_attn_isa(dtype, BS, head_size, "auto"))
    if HAS_AMX:
        assert _get_attn_isa(torch.bfloat16, BS, D, "auto") == "amx"


# ---- the compaction on an amx cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["streaming:budget=40", "keydiff:budget=40:block_size=16",
                                  "snapkv:compression_ratio=0.5:window=8", "tova:budget=40", "h2o:budget=40",
                                  "lagkv:lag_size=16:sink_size=4"])
@pytest.mark.parametrize("writer", ["reference", pytest.param("kernel", marks=needs_amx)])
def test_compaction_on_an_amx_cache_keeps_what_it_keeps_on_the_vec_cache(spec, writer):
    """The same request, the same keys, values and queries, on vLLM's CPU "vec" cache (written by vLLM's "vec"
    kernel) and on an "amx" cache (written by the reference writer, or by vLLM's "amx" kernel): every compaction
    discards as many entries, each layer and KV head keeps the same positions in the same slots, and the amx cache
    holds exactly those tokens' keys and values (StreamingLLM: moves and holes; KeyDiff: prompt blocks, batched;
    SnapKV: layer by layer; TOVA: decode steps from the key logits alone; H2O: prompt sums; LagKV: reads values,
    so its kept entries are written back by `write_entries`)."""
    amx = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(3)]
    write = amx_write if writer == "kernel" else reference_tokens
    compacts_as_on_the_vec_cache(spec, torch.bfloat16, layout_amx, amx, lambda i, k, v, s: write(amx[i], k, v, s))
