"""kvtrim's C++ kernel for the decode steps' logits (`kvtrim.vllm.kernels`) against the layouts' torch functions,
on blocks vLLM's own write kernels filled ("vec" and "amx"), float32 and bfloat16. On a CPU without AMX tiles
(where vLLM's "amx" kernels refuse to run) the "amx" blocks are packed by kvtrim's `layout_amx.write_entries`
(checked against vLLM's own writes in tests/test_vllm_layout_amx.py where the tiles exist), so the kernel's
reading of that packing is tested on every machine."""

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

from kvtrim.vllm import kernels, layout as cpu_vec, layout_amx  # noqa: E402
from test_vllm_layout import kernel_write  # noqa: E402

NB, H, BS, D, Q_HEADS = 9, 3, 32, 64, 9


def filled(cache, keys, values, isa, blocks=None, slots=None):
    """`keys`, `values` `(n, h, d)` in a request's slots `slots` (default its first n) of its blocks `blocks` (default
    the whole cache, in order): vLLM's write kernel `isa`, or kvtrim's packing for "amx" on a CPU without AMX tiles."""
    n, h, d = keys.shape
    blocks = torch.arange(cache.shape[0]) if blocks is None else blocks
    slots = torch.arange(n) if slots is None else slots
    if isa != "amx" or torch.cpu._is_amx_tile_supported():
        return kernel_write(cache, keys, values, blocks[slots // BS] * BS + slots % BS, isa)
    layout_amx.write_entries(cache, blocks, torch.arange(h).repeat(n), slots.repeat_interleave(h),
                             keys.reshape(n * h, d), values.reshape(n * h, d))


@pytest.mark.parametrize("layout,isa", [(cpu_vec, "vec"), (layout_amx, "amx")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_what_the_layouts_torch_function_does(layout, isa, dtype):
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM's amx kernel stores bfloat16 only")
    module, how = kernels.load()
    assert module is not None, how
    fn, named = kernels.table_key_logits(layout)
    assert named == how
    torch.manual_seed(0)
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    n = NB * BS
    filled(cache, torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype), isa)
    # three requests' blocks, a shorter one padded with its first (the backend's table), one block twice
    table = torch.tensor([[4, 0, 7], [2, 2, 2], [8, 1, 5]])
    query = torch.randn(3, Q_HEADS, D).to(dtype)
    expected = layout.table_key_logits(cache, table, query)
    got = fn(cache, table, query)
    assert got.dtype == dtype and got.shape == expected.shape == (3, Q_HEADS, 3 * BS)
    # float32 sums in another order; bfloat16: the same float32 sums rounded (one unit in the last place at most)
    tolerance = 1e-4 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    # each request's own blocks: a wrong block or head would be far off
    other = fn(cache, table.flip(0), query)
    assert not torch.allclose(other.float(), expected.float(), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("layout,isa", [(cpu_vec, "vec"), (layout_amx, "amx")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False])
def test_the_probabilities_are_softmax_probabilities_of_each_requests_entries(layout, isa, dtype, kernel):
    """`table_key_probs` (the kernel's, and torch's where it does not build): each request's probabilities over its own first `length` entries (a length inside a block,
    one at a block's end, one of a single entry), as `softmax_probabilities` computes them from the layout's logits,
    0 past them; the kernel's exp and sums within float32's rounding, so in bfloat16 a probability may round one unit
    apart."""
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM's amx kernel stores bfloat16 only")
    from kvtrim.attention import softmax_probabilities

    fn, how = kernels.table_key_probs(layout)
    assert how.startswith("kvtrim's C++ kernel"), how
    fn = fn if kernel else kernels.torch_key_probs(layout)
    torch.manual_seed(1)
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    n = NB * BS
    filled(cache, (3 * torch.randn(n, H, D)).to(dtype), torch.randn(n, H, D).to(dtype), isa)
    table = torch.tensor([[4, 0, 7], [2, 2, 2], [8, 1, 5], [3, 6, 0]])
    lengths = torch.tensor([3 * BS - 5, 1, 2 * BS, BS + 1])
    query = torch.randn(4, Q_HEADS, D).to(dtype)
    got = fn(cache, table, query, lengths, D ** -0.5)
    assert got.dtype == dtype and got.shape == (4, Q_HEADS, 3 * BS)
    logits = layout.table_key_logits(cache, table, query)
    for r, length in enumerate(lengths.tolist()):
        expected = softmax_probabilities(logits[r, :, None, :length].clone(), None, D ** -0.5)[:, 0]
        assert torch.allclose(got[r, :, :length].float(), expected.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6,
                              atol=1e-6), (r, (got[r, :, :length].float() - expected.float()).abs().max())
        assert torch.allclose(got[r, :, :length].float().sum(-1), torch.ones(Q_HEADS), atol=1e-2)
        assert not got[r, :, length:].any()


def test_other_layouts_keep_their_torch_function():
    from kvtrim.vllm import layout_flash

    fn, named = kernels.table_key_logits(layout_flash)
    assert fn is layout_flash.table_key_logits and named.startswith("torch ops")


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on():
    """PyTorch's build `lock` a killed build leaves made every later server wait forever at start: a build now finds
    it under kvtrim's own OS lock (`build.lock`, which a dead process no longer holds) and removes it."""
    import os
    from torch.utils import cpp_extension

    name = kernels.kernel_name()
    module, _ = kernels.build(name)  # built (or loaded) once
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    lock = os.path.join(root, "kvtrim", name, "lock")
    open(lock, "w").close()  # what a build killed half-way leaves
    again, stale = kernels._within(lambda: kernels.build(name), 60.0)  # PyTorch alone would wait forever
    assert stale and not os.path.exists(lock)
    assert again.table_key_logits is not None
    assert kernels.build(name)[1] is False  # nothing left to remove


def vllm_decode_attention(cache, table, query, lengths, isa):
    """vLLM's own CPU decode attention (`cpu_attention_with_kv_cache`, as its backend calls it) of one query row per
    request `(R, q_heads, head_dim)` over its first `lengths[r]` entries in its blocks `table`."""
    requests, q_heads, d = query.shape
    nb, h, bs, _ = cache.shape
    seq_lens, starts = lengths.int(), torch.arange(requests + 1, dtype=torch.int32)
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=q_heads, num_kv_heads=h, head_dim=d, seq_lens=seq_lens, dtype=cache.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
        dynamic_causal=None, kv_cache_dtype="auto")
    keys, values = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    out = torch.empty(requests, q_heads, d, dtype=cache.dtype)
    vllm_ops.cpu_attention_with_kv_cache(
        query=query, key_cache=keys, value_cache=values, output=out, query_start_loc=starts, seq_lens=seq_lens,
        scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table.int(), softcap=0.0,
        scheduler_metadata=metadata, s_aux=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return out


@pytest.mark.parametrize("layout,isa", [(cpu_vec, "vec"), (layout_amx, "amx")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_attention_is_its_probabilities_times_the_values(layout, isa, dtype):
    """`table_attention`: the same probabilities as `table_key_probs`, and the attention output `probs @ values` of each
    request's own first `length` entries (values read by the layout's `read_request`); within rounding of vLLM's own
    decode attention where it runs; unchanged when the slots past each request's entries hold inf (vLLM's then NaN)."""
    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM's amx kernel stores bfloat16 only")
    fn = kernels.table_attention(layout)
    assert fn is not None
    torch.manual_seed(2)
    cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    n = NB * BS
    filled(cache, (3 * torch.randn(n, H, D)).to(dtype), (1e4 * torch.randn(n, H, D)).to(dtype), isa)
    table = torch.tensor([[4, 0, 7], [2, 2, 2], [8, 1, 5], [3, 6, 0]])
    lengths = torch.tensor([3 * BS - 5, 1, 2 * BS, BS + 1])
    query = torch.randn(4, Q_HEADS, D).to(dtype)
    clean_probs, clean = fn(cache, table, query, lengths, D ** -0.5)
    if isa == "vec" or torch.cpu._init_amx():
        reference = vllm_decode_attention(cache, table, query, lengths, isa)
        # vLLM's softmax is not rounded to bfloat16 before its product with the values: a few bf16 units apart
        scale = reference.float().abs().amax()
        assert ((clean.float() - reference.float()).abs().amax() / scale) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    # garbage in the slots past each request's length in its last block: inf, which 0 * inf would turn into NaN
    for r, length in enumerate(lengths.tolist()):
        past = torch.arange(length, -(-length // BS) * BS)
        if past.numel():
            garbage = torch.full((past.numel(), H, D), float("inf")).to(dtype)
            filled(cache, garbage, garbage, isa, blocks=table[r], slots=past)
    probs, out = fn(cache, table, query, lengths, D ** -0.5)
    assert torch.equal(probs, clean_probs) and torch.equal(out, clean)
    probs_fn, _ = kernels.table_key_probs(layout)
    assert torch.equal(probs, probs_fn(cache, table, query, lengths, D ** -0.5))
    assert out.dtype == dtype and out.shape == (4, Q_HEADS, D)
    group = Q_HEADS // H
    for r, length in enumerate(lengths.tolist()):
        _, values = layout.read_request(cache, table[r], length)  # (h, length, d)
        expected = (probs[r, :, None, :length].float() @ values.float().repeat_interleave(group, 0))[:, 0]
        assert torch.allclose(out[r].float(), expected, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=1e-2), \
            (r, (out[r].float() - expected).abs().max())
