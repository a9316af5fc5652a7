"""KVzip's scores, computed once per context and reused at every compression ratio of a sweep.

KVzip scores each context entry by the attention its reconstruction passes give it (`kvtrim.methods.kvzip`);
the passes and the scores depend on the context and on how the reconstruction prompt is built (`variant`,
`chunk_size`, `prompt_format`), not on how much is kept (`compression_ratio`, `budget`) nor on how the
kept count is spread (`level`, `layerwise`): those only enter the selection at the end of the prompt.
A sweep that runs KVzip at several ratios therefore scores each context once (`score_once`):

1. the context's full cache (the sweep's shared prefill, or one prefill of its own) is replayed into a
   KVzip cache with the prompt left open, and KVzip's scoring passes run on it once;
2. per ratio, the full cache is replayed again into a KVzip cache of that ratio, the scores (and the
   protected count) are copied into its layers' states, and the prompt is ended: KVzip selects.

Exact: with a one-shot prefill the keys and values are the same whatever cache they are stored in, so
the passes see the same cache and compute the same scores (the test compares the rows bit for bit with
recomputing).
"""

from __future__ import annotations

import time

import torch

from kvtrim.compress import CompressedContext, compress, replay, run_scoring_passes
from kvtrim.methods.full import FullCache
from kvtrim.methods.kvzip import KVzip


def scoring_key(method) -> tuple | None:
    """What KVzip's scores depend on (None for any other method: no reuse)."""
    if type(method) is not KVzip:
        return None
    return (method.variant, method.chunk_size, method.prompt_format)


@torch.no_grad()
def score_once(model, tokenizer, context_ids: torch.Tensor, methods: list[KVzip],
               full: CompressedContext | None = None) -> tuple[list[CompressedContext], float]:
    """`context_ids` `(1, n)` compressed by each of `methods` (KVzip, one `scoring_key`), the scoring passes
    run once; and the seconds of the shared work (the prefill if `full` is None, and the passes).

    `full`: the context's one-shot full-cache prefill (`compress(model, ids, FullCache())`), if the caller
    has one."""
    keys = {scoring_key(m) for m in methods}
    assert len(keys) == 1 and None not in keys, "score_once takes KVzip methods that score alike"
    start = time.perf_counter()
    if full is None:
        full = compress(model, context_ids, FullCache(), None)
    scorer = replay(model, full.cache, methods[0], ends_prompt=False)
    run_scoring_passes(model, scorer, methods[0].scoring_inputs(context_ids, tokenizer))
    scores = [(layer.state.scores, layer.state.protected) for layer in scorer.trim_layers()]
    shared_seconds = time.perf_counter() - start
    out = []
    for method in methods:
        cache = replay(model, full.cache, method, ends_prompt=False)
        for layer, (s, protected) in zip(cache.trim_layers(), scores):
            layer.state.scores, layer.state.protected = s.clone(), protected
        cache.end_prompt()  # KVzip's selection, at this method's ratio or budget
        out.append(CompressedContext(model, cache, context_ids, full.logits))
    return out, shared_seconds
