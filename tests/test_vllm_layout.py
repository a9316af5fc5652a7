"""vLLM's CPU KV block layout and the compaction on it (run from .venv-serve; skipped without vLLM).

The layout is checked against vLLM's own write kernel (`cpu_attn_reshape_and_cache`, as the attention layer
calls it); the compaction against `TrimCache`'s kept positions on the same keys, for every supported method,
every layer and every KV head."""

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvtrim import Phase, TrimCache  # noqa: E402
from kvtrim.vllm.compact import compact_request  # noqa: E402
from kvtrim.vllm.layout import check_isa, read_request, write_request  # noqa: E402
from kvtrim.vllm.spec import method_for_vllm  # noqa: E402

BS, H, D, NB = 32, 3, 64, 12


def kernel_write(cache, keys, values, slots):
    """What the attention layer does: `keys`, `values` `(n, h, d)` written at `slots` `(n,)` by vLLM's kernel."""
    nb, h, bs, _ = cache.shape
    k_cache, v_cache = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    isa = _get_attn_isa(cache.dtype, bs, cache.shape[-1] // 2)
    vllm_ops.cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                        kv_cache_dtype="auto")


def request_slots(block_ids, n):
    i = torch.arange(n)
    return block_ids[i // BS] * BS + i % BS


@pytest.fixture(params=[torch.float32, torch.bfloat16])
def dtype(request):
    check_isa(_get_attn_isa(request.param, BS, D))
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


def test_write_lays_out_as_the_kernel(dtype):
    torch.manual_seed(1)
    blocks = torch.tensor([3, 0, 5])
    n = 2 * BS + 9
    keys, values = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
    ours, theirs = torch.zeros(NB, H, BS, 2 * D, dtype=dtype), torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    write_request(ours, blocks, keys.transpose(0, 1), values.transpose(0, 1))
    kernel_write(theirs, keys, values, request_slots(blocks, n))
    assert torch.equal(ours, theirs)


def reference_kept(method, layers):
    """TrimCache on one layer at a time (as model.generate's one-shot prefill): kept positions (h, n_keep)."""
    kept = []
    for idx, (k, v) in enumerate(layers):
        cache = TrimCache(method)
        with cache.phase(Phase.PREFILL, ends_prompt=True):
            cache.update(k[None].clone(), v[None].clone(), idx)
        kept.append(cache.layers[idx].kept_positions()[0])
    return kept


@pytest.mark.parametrize("spec", ["lagkv:compression_ratio=0.5:lag_size=32:sink_size=4", "keydiff:compression_ratio=0.5",
                                  "streaming:compression_ratio=0.75", "knorm:compression_ratio=0.5",
                                  "lagkv:compression_ratio=0.75:lag_size=16"])
def test_compaction_keeps_trimcache_positions(spec, dtype):
    torch.manual_seed(2)
    method = method_for_vllm(spec)
    prompt, tail, n_layers = 5 * BS + 7, 3, 3  # `tail`: a recomputed request's tokens after the prompt
    stored = prompt + tail
    blocks = torch.tensor([11, 1, 6, 3, 8, 0])
    caches, originals = [], []
    for _ in range(n_layers):
        keys = (torch.randn(stored, H, D) * torch.linspace(0.5, 2, D)).to(dtype)
        values = torch.randn(stored, H, D).to(dtype)
        cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
        kernel_write(cache, keys, values, request_slots(blocks, stored))
        caches.append(cache)
        originals.append((keys.transpose(0, 1), values.transpose(0, 1)))
    expected = reference_kept(method, [(k[:, :prompt], v[:, :prompt]) for k, v in originals])
    gone = compact_request(caches, blocks, prompt, stored, method)
    n_keep = expected[0].shape[-1]
    assert gone == prompt - n_keep > 0
    for cache, (k, v), kept in zip(caches, originals, expected):
        idx = torch.cat([kept, torch.arange(prompt, stored).expand(H, -1)], dim=-1)
        got_k, got_v = read_request(cache, blocks, n_keep + tail)
        for h in range(H):  # every KV head: its own kept entries, then the tail in order
            assert torch.equal(got_k[h], k[h, idx[h]]) and torch.equal(got_v[h], v[h, idx[h]])
