"""vLLM's GPU KV block layout (FlashAttention / FlashInfer) and the compaction on it, on the CPU (run from
.venv-serve; skipped without vLLM).

The per-layer views are vLLM's own (`create_kv_cache_views` over one int8 buffer, every `KVCacheLayout`); the
tokens are written into that buffer by a reference writer that computes byte offsets from the layout's stride
permutation alone (the semantics of `reshape_and_cache_flash`), never through the views. Only a GPU can check
the real writer (docs/vllm-gpu-design.md §5, step 3)."""

import pytest
import torch

pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, compute_layout_strides,  # noqa: E402
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvtrim.methods.base import KvtrimError  # noqa: E402
from kvtrim.vllm import layout as cpu_vec  # noqa: E402
from kvtrim.vllm import layout_flash  # noqa: E402
from kvtrim.vllm.block_layout import BlockLayout, block_layout  # noqa: E402
from kvtrim.vllm.block_io import add_prompt_sums  # noqa: E402
from kvtrim.vllm.compact import compact  # noqa: E402
from kvtrim.vllm.entries import RequestEntries  # noqa: E402
from kvtrim.vllm.planning import StoredCounts, forward_steps  # noqa: E402
from kvtrim.vllm.layout_flash import (check_views, move_entries, read_keys, read_request, request_key_logits,  # noqa: E402
                                      slot_places, write_entries)
from kvtrim.vllm.spec import method_for_vllm, prompt_queries, prompt_sums  # noqa: E402
from test_vllm_counts import block_forwards  # noqa: E402
from test_vllm_layout import BS, D, H, NB, kernel_write, request_slots  # noqa: E402

LAYOUTS = list(KVCacheLayout)
LAYERS = 3


@pytest.fixture(params=[torch.float32, torch.bfloat16])
def dtype(request):
    return request.param


class Pool:
    """One group of `layers` layers in vLLM's GPU layout `layout`: the raw int8 buffer (random bytes, so that what
    no write touched stays recognisable) and vLLM's own per-layer views `(NB, H, BS, 2 * D)` of it, strided as
    vLLM's allocator strides one group (`compute_layout_strides`, `create_kv_cache_views`)."""

    def __init__(self, layout: KVCacheLayout, dtype: torch.dtype, layers: int = LAYERS,
                 kernel_block_size: int | None = None):
        self.layout, self.dtype, self.layers = layout, dtype, layers
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
        layer_stride, block_stride = compute_layout_strides(spec, NB, layers, layout)[:2]
        size = NB * layers * spec.page_size_bytes
        tensor = KVCacheTensor(size=size, layers=[f"layers.{i}" for i in range(layers)], layer_stride=layer_stride,
                               block_stride=block_stride)
        self.raw = torch.randint(-128, 128, (size,), dtype=torch.int8)
        self.views = create_kv_cache_views(self.raw, spec, NB, layout, tensor, kernel_block_size)

    def byte_strides(self) -> list[int]:
        """Byte strides of the logical axes `(L, B, H, N, C)`, computed here from the stride permutation alone: the
        axes lie in memory in the order `layout.value` names them, the last innermost, with no gaps."""
        sizes = (self.layers, NB, H, BS, 2 * D * self.dtype.itemsize)
        strides, step = [0] * 5, 1
        for axis in reversed(self.layout.value):
            strides[axis], step = step, step * sizes[axis]
        return strides

    def write(self, raw: torch.Tensor, layer: int, heads: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """The reference writer: KV head `heads[i]`'s key and value `(m, D)` stored for vLLM slot `slots[i]` (block
        `slots // BS`, offset `slots % BS`) into `raw` (this pool's buffer or a copy) as one row of C, key then
        value: what `reshape_and_cache_flash` stores, at byte offsets from `byte_strides`, not through a view."""
        s_l, s_b, s_h, s_n, _ = self.byte_strides()
        rows = torch.cat([keys, values], dim=-1).to(self.dtype).contiguous().view(torch.int8)  # (m, C bytes)
        start = layer * s_l + (slots // BS) * s_b + heads * s_h + (slots % BS) * s_n
        raw[start[:, None] + torch.arange(rows.shape[1])] = rows

    def write_tokens(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """What the attention layer stores for a forward: every KV head of tokens `(n, H, D)` at vLLM `slots`
        `(n,)`."""
        n = slots.shape[0]
        self.write(self.raw, layer, torch.arange(H).repeat(n), slots.repeat_interleave(H), keys.reshape(n * H, D),
                   values.reshape(n * H, D))


def random_tokens(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(n, H, D) * torch.linspace(0.5, 2, D)).to(dtype), torch.randn(n, H, D).to(dtype)


# ---- the views vLLM builds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_lie_in_the_memory_order_the_layout_names(layout, dtype):
    """Each layer's `(B, H, N, C)` view permuted by `layer_view_order` names the layout's per-block order (LBNHC:
    FlashAttention's NHD, LBHNC: HND) and has exactly the strides the reference writer assumes; one layer's view is
    one contiguous region in that order unless blocks interleave the layers."""
    pool = Pool(layout, dtype)
    order = layout.layer_view_order
    assert "".join("BHNC"[i] for i in order) == layout.name.replace("L", "")
    strides = pool.byte_strides()
    for layer, view in enumerate(pool.views):
        assert view.shape == (NB, H, BS, 2 * D) and view.dtype == dtype
        assert [s * view.element_size() for s in view.stride()] == strides[1:4] + [view.element_size()]
        assert view.data_ptr() - pool.raw.data_ptr() == layer * strides[0]
        assert view.permute(order).is_contiguous() == layout.is_layer_compact
    if layout is KVCacheLayout.LBNHC:
        assert pool.views[0].transpose(1, 2).is_contiguous()  # NHD: (blocks, tokens, heads, C)
    if layout is KVCacheLayout.LBHNC:
        assert pool.views[0].is_contiguous()  # HND: (blocks, heads, tokens, C)


# ---- the layout functions against the reference writer ------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_what_the_reference_wrote(layout, dtype):
    torch.manual_seed(0)
    pool = Pool(layout, dtype)
    blocks = torch.tensor([7, 2, 9, 4])  # not contiguous, not in order
    n = 3 * BS + 5  # a partial last block
    keys, values = random_tokens(n, dtype)
    pool.write_tokens(1, keys, values, request_slots(blocks, n))
    got_k, got_v = read_request(pool.views[1], blocks, n)
    assert got_k.shape == got_v.shape == (H, n, D)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
    assert torch.equal(read_keys(pool.views[1], blocks, n), keys.transpose(0, 1))  # the keys alone


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_entries_writes_what_the_reference_writes_and_nothing_else(layout, dtype):
    """Every byte of the buffer after `write_entries` is what the reference writer leaves: the entries where it
    puts them, every other layer, block, head and slot as it was; and they read back."""
    torch.manual_seed(1)
    pool = Pool(layout, dtype)
    blocks = torch.tensor([3, 0, 5, 10])
    n = 3 * BS + 9
    pool.write_tokens(1, *random_tokens(n, dtype), request_slots(blocks, n))
    picked = torch.randperm(H * n)[:40]  # distinct (head, slot) entries
    heads, slots = picked // n, picked % n
    keys, values = torch.randn(40, D).to(dtype), torch.randn(40, D).to(dtype)
    want = pool.raw.clone()
    pool.write(want, 1, heads, request_slots(blocks, n)[slots], keys, values)
    write_entries(pool.views[1], blocks, heads, slots, keys, values)
    assert torch.equal(pool.raw, want)
    got_k, got_v = read_request(pool.views[1], blocks, n)
    assert torch.equal(got_k[heads, slots], keys) and torch.equal(got_v[heads, slots], values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_move_entries_copies_each_heads_entry_in_place(layout, dtype):
    torch.manual_seed(2)
    pool = Pool(layout, dtype)
    blocks = torch.tensor([5, 1, 11])
    n = 2 * BS + 20
    keys, values = random_tokens(n, dtype)
    vllm_slots = request_slots(blocks, n)
    pool.write_tokens(2, keys, values, vllm_slots)
    heads, src, dst = torch.tensor([0, 1, 2, 2]), torch.tensor([2 * BS + 19, 2 * BS + 3, BS + 1, 2 * BS]), \
        torch.tensor([4, 0, 7, BS + 30])
    want = pool.raw.clone()
    pool.write(want, 2, heads, vllm_slots[dst], keys[src, heads], values[src, heads])
    move_entries(pool.views[2], heads, slot_places(blocks, src, BS), slot_places(blocks, dst, BS))
    assert torch.equal(pool.raw, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_request_key_logits_is_a_matmul(layout, dtype):
    """One query per layer, query head `i` reading KV head `i // 2`, against the layer's first `n` keys."""
    torch.manual_seed(3)
    pool = Pool(layout, dtype)
    blocks = torch.tensor([8, 3, 6])
    n = 2 * BS + 7
    layers = [random_tokens(n, dtype) for _ in range(LAYERS)]
    for layer, (keys, values) in enumerate(layers):
        pool.write_tokens(layer, keys, values, request_slots(blocks, n))
    query = torch.randn(LAYERS, 2 * H, 1, D).to(dtype)
    got = request_key_logits(pool.views, blocks, n, query)
    assert got.shape == (LAYERS, 2 * H, 1, n) and got.dtype == dtype
    for layer, (keys, _) in enumerate(layers):
        want = query[layer].double().view(H, 2, D) @ keys.double().permute(1, 2, 0)  # (H, 2, n)
        # float32 sums in another order; bfloat16 rounds the result
        tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 0.05}
        torch.testing.assert_close(got[layer].double(), want.view(2 * H, 1, n), **tolerance)


def test_check_views_refuses_kernel_blocks_in_one_line():
    """A backend whose kernel block is smaller than vLLM's block gets views of kernel blocks (first dimension
    `NB * ratio`): refused, as a quantised cache is; vLLM's own views pass."""
    split = Pool(KVCacheLayout.LBNHC, torch.bfloat16, kernel_block_size=BS // 2)
    assert split.views[0].shape == (2 * NB, H, BS // 2, 2 * D)
    with pytest.raises(KvtrimError) as refused:
        check_views(split.views, NB, BS)
    assert "\n" not in str(refused.value) and "kernel blocks" in str(refused.value)
    with pytest.raises(KvtrimError, match="uint8"):
        check_views([torch.zeros(NB, H, BS, 2 * D, dtype=torch.uint8)], NB, BS)
    check_views(Pool(KVCacheLayout.LBHNC, torch.bfloat16).views, NB, BS)


# ---- the chooser -------------------------------------------------------------------------------------------

def test_the_chooser_picks_the_layout_module():
    assert block_layout("CPU_ATTN", isa="vec") is cpu_vec
    for member in KVCacheLayout:  # a layout a later vLLM adds is refused until tested here
        assert block_layout("FLASH_ATTN", kv_cache_layout=member) is layout_flash
        assert block_layout("FLASHINFER", kv_cache_layout=member.name) is layout_flash
    assert isinstance(cpu_vec, BlockLayout) and isinstance(layout_flash, BlockLayout)


@pytest.mark.parametrize("backend, options", [("TRITON_ATTN", {}), ("FLEX_ATTENTION", {"kv_cache_layout": "LBNHC"}),
                                              ("CPU_ATTN", {"isa": "neon"}), ("CPU_ATTN", {}),
                                              ("FLASH_ATTN", {}), ("FLASHINFER", {"kv_cache_layout": "NHD"})])
def test_the_chooser_refuses_anything_else_in_one_line(backend, options):
    with pytest.raises(KvtrimError) as refused:
        block_layout(backend, **options)
    assert "\n" not in str(refused.value)


# ---- the compaction on a flash cache -----------------------------------------------------------------------

def drive(method, layout, caches, write, blocks, originals, queries, prompt, block):
    """One request as the worker drives it (tests/test_vllm_layout.py): its prompt in one forward (or in vLLM
    chunks cut at the method's prompt block ends), then one token a forward; each forward's tokens written by
    `write(layer, keys, values, slots)` after what the request stores, or into the hole; the due forwards
    compacted with each layer's queries (prompt block tails, then the steps after the prompt). Returns the
    request's entries and its discarded count."""
    total, scales = originals[0][0].shape[1], [0.125] * len(caches)
    forwards = block_forwards(prompt, total, block or prompt, 64)
    counts, entries, gone = StoredCounts(method), RequestEntries(), 0
    for start, end in forwards:
        hole = entries.fill_hole(start)
        slots = request_slots(blocks, end - gone)[start - gone:] if hole is None else request_slots(blocks, hole + 1)[-1:]
        for layer, (k, v) in enumerate(originals):
            write(layer, k[:, start:end].transpose(0, 1).contiguous(), v[:, start:end].transpose(0, 1).contiguous(), slots)
        steps = forward_steps(start, end, prompt, block)
        if not (steps and counts.advance(steps)):
            continue
        tail, sums = None, None
        if start < prompt and prompt_sums(method):
            sums = [torch.zeros(H, prompt) for _ in caches]
            for c in range(0, prompt, 16):  # H2O: its prompt's attention sums, prefill chunk by chunk
                add_prompt_sums(sums, caches, blocks, [q[:, c:min(c + 16, prompt)] for q in queries], c, scales,
                                method.prefill_block, layout=layout)
        elif start < prompt and prompt_queries(method):
            w = min(prompt_queries(method), steps[0].tokens)
            tail = [q[:, end - w:end] for q in queries]
        last = [q[:, max(start, prompt):end] for q in queries] if end > prompt else None
        gone = compact(caches, blocks, method, entries, steps, end, prompt, tail, scales, last, sums, layout=layout)
        assert gone == counts.discarded
    return entries, gone


def stored_slots(entries, layer, total):
    """The positions `(H, slots)` a layer's stored slots hold (-1: the hole)."""
    tail = torch.arange(entries.seen, total).expand(H, -1)
    return torch.cat([entries.slots(layer), tail], dim=-1)


@pytest.mark.parametrize("spec", ["streaming:budget=40", "keydiff:budget=40:block_size=16",
                                  "snapkv:compression_ratio=0.5:window=8", "tova:budget=40", "h2o:budget=40"])
@pytest.mark.parametrize("layout, dtype", [(KVCacheLayout.LBNHC, torch.float32), (KVCacheLayout.LBNHC, torch.bfloat16),
                                           (KVCacheLayout.LBHNC, torch.bfloat16), (KVCacheLayout.BHLNC, torch.float32)])
def test_compaction_on_a_flash_cache_keeps_what_it_keeps_on_the_cpu_layout(spec, layout, dtype):
    """The same request, the same keys, values and queries, on vLLM's CPU "vec" cache (written by vLLM's kernel)
    and on a flash cache (the reference writer): every compaction discards as many entries, each layer and KV
    head keeps the same positions in the same slots, and the flash cache holds exactly those tokens' keys and
    values (StreamingLLM: moves and holes; KeyDiff: prompt blocks, batched; SnapKV: layer by layer; TOVA: decode
    steps from the key logits alone; H2O: prompt sums). The layout functions meet every layout and dtype above:
    here NHD, HND and a block-outermost layout, to keep the run short."""
    pool = Pool(layout, dtype)
    compacts_as_on_the_vec_cache(spec, dtype, layout_flash, pool.views, pool.write_tokens)


def compacts_as_on_the_vec_cache(spec: str, dtype: torch.dtype, layout, caches: list[torch.Tensor], write) -> None:
    """Drive one request (the same keys, values and queries: seed 4) under `spec` through `layout` on `caches` (one per
    layer, each written by `write(layer, keys, values, slots)`) and on vLLM's CPU "vec" cache written by vLLM's kernel;
    check that every compaction discards as many entries, each layer and KV head keeps the same positions in the same
    slots, `caches` hold exactly those tokens' keys and values, and entries moved."""
    method = method_for_vllm(spec)
    prompt, new = 2 * BS + 5, 16
    total = prompt + new
    blocks = torch.tensor([9, 4, 11, 0, 7, 2])
    torch.manual_seed(4)
    layers = len(caches)
    originals = [tuple(t.transpose(0, 1) for t in random_tokens(total, dtype)) for _ in range(layers)]
    queries = [(torch.randn(2 * H, total, D) * torch.linspace(0.5, 2, D)).to(dtype) for _ in range(layers)]
    vec = [torch.zeros(NB, H, BS, 2 * D, dtype=dtype) for _ in range(layers)]
    block = method.prefill_block_size()
    want, want_gone = drive(method, cpu_vec, vec, lambda i, k, v, s: kernel_write(vec[i], k, v, s), blocks, originals,
                            queries, prompt, block)
    got, got_gone = drive(method, layout, caches, write, blocks, originals, queries, prompt, block)
    assert got_gone == want_gone > 0 and got.hole == want.hole
    moved = False
    for layer, (k, v) in enumerate(originals):
        slots = stored_slots(got, layer, total)
        assert torch.equal(slots, stored_slots(want, layer, total))
        moved |= not torch.equal(slots, slots.sort(dim=-1).values)
        real = slots[0] >= 0  # the same in every head
        got_k, got_v = layout.read_request(caches[layer], blocks, slots.shape[-1])
        want_k, want_v = cpu_vec.read_request(vec[layer], blocks, slots.shape[-1])
        assert torch.equal(got_k[:, real], want_k[:, real]) and torch.equal(got_v[:, real], want_v[:, real])
        index = slots[:, real, None].expand(-1, -1, D)
        assert torch.equal(got_k[:, real], k.gather(1, index)) and torch.equal(got_v[:, real], v.gather(1, index))
    assert moved  # the compactions moved entries (not a run that kept everything in place)
