"""`EvictionMethod.peak_stored`: the most entries a layer holds at once, against `TrimCache` driven the way
the engine drives a request (the prompt in one forward that ends it, then one token per decode step), on
random keys (a method fed attention gets random queries and decode probabilities, as kvtrim's attention hands
them over). The reference is the count itself: what the prompt's end keeps, then before each decode step's
eviction what the layer stored after the previous one plus the new token."""

import pytest
import torch

from kvtrim.cache import TrimCache
from kvtrim.methods.base import Phase
from kvtrim.specs import parse_method_spec


def simulated_peak(spec: str, prompt: int, total: int) -> int:
    cache = TrimCache(parse_method_spec(spec).build(), in_place_decode=False)
    gen = torch.Generator().manual_seed(0)

    def forward(phase, q):
        k, v = torch.randn(2, 1, 2, q, 8, generator=gen)
        with cache.phase(phase, ends_prompt=phase is Phase.PREFILL):
            full, _ = cache.update(k, v, 0)
        layer = cache.layers[0]
        if layer.awaiting_attention:
            probs = torch.randn(1, 2, 1, full.shape[-2], generator=gen).softmax(-1) if q == 1 else None
            layer.after_attention(torch.randn(1, 2, q, 8, generator=gen), probs, None)
        return layer.stored

    peak = stored = forward(Phase.PREFILL, prompt)  # from the prompt's end on
    for _ in range(total - prompt):
        peak, stored = max(peak, stored + 1), forward(Phase.DECODE, 1)
    return peak


SPECS = ["keydiff:budget=48:block_size=16", "keydiff:budget=40:block_size=1", "keydiff:compression_ratio=0.5",
         "streaming:budget=40", "streaming:compression_ratio=0.75", "knorm:budget=30", "knorm:compression_ratio=0.6",
         "lagkv:lag_size=16:sink_size=4", "lagkv:lag_size=8:keep_ratio=0.25:sink_size=2",
         "lagkv:lag_size=8:keep_ratio=1", "lagkv:compression_ratio=0.5:lag_size=8:sink_size=2",
         "snapkv:budget=40", "snapkv:budget=40:window=8:block_size=16", "snapkv:compression_ratio=0.5", "tova:budget=40", "tova:compression_ratio=0.5", "h2o:budget=40",
         "h2o:heavy_budget=10:recent_budget=20", "h2o:compression_ratio=0.6", "lazyeviction:budget=40:window=8",
         "lazyeviction:budget=40:window=7", "lazyeviction:budget=100:window=30", "lazyeviction:budget=65:window=64"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("prompt,total", [(10, 10), (20, 200), (64, 140), (100, 101), (130, 300)])
def test_peak_is_the_simulated_one(spec, prompt, total):
    method = parse_method_spec(spec).build()
    peak = method.peak_stored(prompt, total)
    assert peak == simulated_peak(spec, prompt, total)


def test_budget_methods_are_bounded_while_decoding():
    """The point of the hook: a decode-time budget reserves budget + slack whatever the generation length."""
    assert parse_method_spec("keydiff:budget=512:block_size=128").build().peak_stored(100, 100_000) == 640
    assert parse_method_spec("streaming:budget=512").build().peak_stored(3000, 100_000) == 513
    assert parse_method_spec("keydiff:compression_ratio=0.5").build().peak_stored(1000, 3000) == 2500
    assert parse_method_spec("keydiff:compression_ratio=0.5").build().peak_stored(1000, 1000) == 500


def test_a_method_deciding_itself_says_nothing():
    from kvtrim.methods.streaming import StreamingLLM

    class Custom(StreamingLLM):
        def target(self, view):
            return None

    assert Custom(budget=8).peak_stored(10, 20) is None
