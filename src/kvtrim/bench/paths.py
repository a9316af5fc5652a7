"""Peak tensor memory of one method on each way a user runs a prompt, measured alike on CPU and CUDA.

Paths (each from a fresh cache, the prompt then one decode step, greedy):
* `prefill`: `kvtrim.prefill` (the forwards declared; the method's own blocks, KeyDiff `budget=`; a method
  with scoring passes, KVzip, runs them before the prompt ends, as `kvtrim.compress` does), then one decode
  step: what `kvtrim.compress`, `kvtrim eval` and the benchmark's timed cells do;
* `generate`: stock `model.generate(ids, cache=TrimCache(method, config=..., prompt_length=n))`, the README's
  first example: the forward that completes the prompt ends it, each layer evicting after its attention;
* `generate_deferred`: the same without `prompt_length=`: the prompt ends at the first decode step, every
  layer holding its whole prompt (and what the method keeps for its end) until then.

The reading is `TensorPeak`: tensors only (the cache, the method's scratch and the forward's activations),
above what was allocated before the path started (the model's weights). Every path allocates its cache
inside the measured block, so its frees are seen. Methods with scoring passes (KVzip) cannot run through
stock `generate`: their `generate` paths are not measured (None).

A method sized by `budget=` evicts in every prompt forward over its budget whatever the path, so its three
peaks are about equal; the paths differ for methods sized by `compression_ratio=`, which act when the prompt
ends.
"""

from __future__ import annotations

import torch

from kvtrim.bench.memory import TensorPeak
from kvtrim.cache import TrimCache
from kvtrim.compress import run_scoring_passes
from kvtrim.decoding import pad_token_id
from kvtrim.methods.base import EvictionMethod
from kvtrim.prefill import prefill

PATHS = ("prefill", "generate", "generate_deferred")


def _one_decode_step(model, cache: TrimCache, logits: torch.Tensor) -> None:
    token = logits.argmax(-1, keepdim=True)
    positions = torch.full_like(token, cache.get_seq_length())
    model(input_ids=token, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)


def run_path(model, method: EvictionMethod, ids: torch.Tensor, path: str, chunk_sizes: list[int] | None = None,
             passes: list | None = None) -> TrimCache:
    """Run `ids` `(batch, n)` and one decode step through `path` (see the module docstring); returns the cache.
    `chunk_sizes`: the `kvtrim.prefill` path's forwards (default: the method's own blocks); `passes`: the
    method's scoring passes on `ids` (`scoring_inputs`), run before the prompt ends."""
    n = ids.shape[-1]
    if path == "prefill":
        cache = TrimCache(method, config=model.config)
        logits = prefill(model, ids, cache, chunk_sizes=chunk_sizes, end_prompt=not passes)
        if passes:
            run_scoring_passes(model, cache, passes)
            cache.end_prompt()
        _one_decode_step(model, cache, logits)
        return cache
    cache = TrimCache(method, config=model.config, prompt_length=n if path == "generate" else None)
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, min_new_tokens=2,
                   do_sample=False, pad_token_id=pad_token_id(model) or 0)
    return cache


@torch.no_grad()
def path_peaks(model, method: EvictionMethod, ids: torch.Tensor, chunk_sizes: list[int] | None = None,
               passes: list | None = None) -> dict[str, int | None]:
    """`{"prefill": bytes, "generate": bytes, "generate_deferred": bytes}`: each path's tensor peak above its
    start (None where the path does not apply)."""
    device = ids.device
    out: dict[str, int | None] = {}
    for path in PATHS:
        if path != "prefill" and method.scoring_passes:
            out[path] = None
            continue
        with TensorPeak(device) as mem:
            cache = run_path(model, method, ids, path, chunk_sizes, passes)
            del cache
        out[path] = mem.reading.peak_bytes
    return out
