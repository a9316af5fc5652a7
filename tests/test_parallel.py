"""Tensor parallelism splits every layer's KV heads (and their query heads) across ranks, and each rank of
kvtrim's vLLM engine compacts its own heads alone: a method may run there only if a KV head's kept entries do not
depend on the other heads. Checked here for every method the engine runs, against `TrimCache` on all the heads
(the method as `model.generate` runs it): run on each half of the heads alone, the kept positions per KV head are
the same, exactly for the methods that do not declare `decides_across_heads` (TOVA does: its attention averaged
over all the layer's heads), which the engine refuses under tensor parallelism (`spec.parallel_refusal`)."""

import pytest
import torch

from kvtrim.attention import attend_with_probabilities
from kvtrim.cache import TrimCache
from kvtrim.methods.base import Phase
from kvtrim.specs import parse_method_spec

KV_HEADS, GROUP, D, PROMPT, NEW, SCALE = 4, 2, 16, 96, 40, 0.25

ENGINE_SPECS = ["lagkv:compression_ratio=0.5:lag_size=16:sink_size=4", "lagkv:keep_ratio=0.25:lag_size=8:sink_size=2",
                "keydiff:compression_ratio=0.5", "keydiff:budget=40:block_size=16", "streaming:budget=40",
                "knorm:compression_ratio=0.5", "snapkv:compression_ratio=0.5:window=8", "snapkv:budget=40:window=8",
                "h2o:budget=40", "lazyeviction:budget=40:window=8", "tova:budget=40", "tova:compression_ratio=0.5"]


def kept_positions(method, keys, values, queries):
    """`TrimCache` on one layer of `keys`, `values` `(h, n, D)` and `queries` `(h * GROUP, n, D)`: the prompt in one
    forward, then decode steps handed their attention. Kept positions `(h, kept)`, sorted."""
    cache = TrimCache(method)
    with cache.phase(Phase.PREFILL, ends_prompt=True):
        cache.update(keys[None, :, :PROMPT].clone(), values[None, :, :PROMPT].clone(), 0)
    layer = cache.layers[0]
    layer.after_attention(queries[None, :, :PROMPT], None, SCALE)
    for t in range(PROMPT, PROMPT + NEW):
        full_k, full_v = cache.update(keys[None, :, t:t + 1].clone(), values[None, :, t:t + 1].clone(), 0)
        q = queries[None, :, t:t + 1]
        layer.after_attention(q, attend_with_probabilities(q, full_k, full_v, None, SCALE)[1], SCALE)
    return layer.kept_positions()[0].sort(dim=-1).values


@pytest.mark.parametrize("spec", ENGINE_SPECS)
def test_each_ranks_heads_keep_what_all_heads_keep_unless_the_method_decides_across_heads(spec):
    method = parse_method_spec(spec).build()
    gen = torch.Generator().manual_seed(3)
    n = PROMPT + NEW
    keys = torch.randn(KV_HEADS, n, D, generator=gen) * torch.linspace(0.5, 2, D)
    values = torch.randn(KV_HEADS, n, D, generator=gen)
    queries = torch.randn(KV_HEADS * GROUP, n, D, generator=gen) * torch.linspace(0.5, 2, D)
    whole = kept_positions(method, keys, values, queries)
    half = KV_HEADS // 2
    ranks = [kept_positions(method, keys[r * half:(r + 1) * half], values[r * half:(r + 1) * half],
                            queries[r * half * GROUP:(r + 1) * half * GROUP]) for r in range(2)]
    same = all(p.shape == whole[r * half:(r + 1) * half].shape and torch.equal(p, whole[r * half:(r + 1) * half])
               for r, p in enumerate(ranks))
    assert whole.shape[-1] < n  # it evicted
    assert same is not method.decides_across_heads


def test_the_engine_refuses_a_method_deciding_across_heads_under_tensor_parallelism_only():
    from kvtrim.vllm.spec import method_for_vllm, parallel_refusal

    tova = method_for_vllm("tova:budget=64")
    assert parallel_refusal(tova, 1) is None and parallel_refusal(method_for_vllm("h2o:budget=64"), 2) is None
    assert "--tensor-parallel-size 1" in parallel_refusal(tova, 2) and parallel_refusal(None, 4) is None
