"""Calibration for LazyEviction: the official scripts' presets and the paper's window rule.

Kept out of `kvtrim.methods` (methods are data plus pure functions; these run the model).
"""

from __future__ import annotations

import math
import sys
from typing import Iterable

import torch

from kvtrim.attention import is_enabled
from kvtrim.generate import encode_prompt, generate
from kvtrim.methods.base import KvtrimError, check
from kvtrim.methods.lazy_eviction import LazyEviction, _LazyState

#: official scripts' `(decoding_recent_size = window, alpha)` per (model, dataset)
PRESETS: dict[tuple[str, str], dict[str, float]] = {
    ("deepseek-r1-distill-qwen-7b", "gsm8k"): {"window": 101, "alpha": 1e-4},
    ("deepseek-r1-distill-qwen-7b", "math500"): {"window": 175, "alpha": 1e-4},
    ("deepseek-r1-distill-qwen-7b", "aime"): {"window": 363, "alpha": 1e-4},
    ("deepseek-r1-distill-llama-8b", "gsm8k"): {"window": 27, "alpha": 5e-4},
    ("deepseek-r1-distill-llama-8b", "math500"): {"window": 52, "alpha": 5e-4},
    ("deepseek-r1-distill-llama-8b", "aime"): {"window": 95, "alpha": 5e-4},
}
#: official scripts' `max_kv_capacity` per model
PRESET_BUDGETS: dict[str, int] = {"deepseek-r1-distill-qwen-7b": 1492, "deepseek-r1-distill-llama-8b": 1334}


def lazy_eviction_preset(model: str, dataset: str, budget: int | None = None, **params) -> LazyEviction:
    """The official scripts' `window` and `alpha` for `(model, dataset)` (and their budget unless given).

    Models: deepseek-r1-distill-qwen-7b, deepseek-r1-distill-llama-8b; datasets: gsm8k, math500, aime.
    """
    key = (model.lower(), dataset.lower())
    if key not in PRESETS:
        known = ", ".join(f"{m}/{d}" for m, d in PRESETS)
        raise KvtrimError(f"no LazyEviction preset for {model}/{dataset}; known: {known}")
    values = {**PRESETS[key], **params}
    return LazyEviction(budget=budget if budget is not None else PRESET_BUDGETS[key[0]], **values)


@torch.no_grad()
def estimate_window(
    model,
    tokenizer,
    prompts: Iterable[str],
    max_new_tokens: int = 256,
    percentile: float = 80.0,
    alpha: float = 1e-4,
    gqa: str = "max",
    chat: bool = True,
) -> int:
    """The paper's rule for W: the `percentile`-th percentile of the tokens' MRI after full-cache generations.

    Generates each prompt greedily with a full cache while tracking TS/MRI exactly as `LazyEviction` does
    (no eviction), then pools the final MRI of every entry with `MRI > 0` (entries that were active at
    least once after tracking began) over all layers and heads. The model must use kvtrim attention.
    """
    check(is_enabled(model), "estimate_window needs kvtrim attention: call kvtrim.enable(model)")
    check(0 < percentile <= 100, f"percentile must be in (0, 100], got {percentile}")
    tracker = LazyEviction(budget=sys.maxsize, window=1, alpha=alpha, gqa=gqa)
    values = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, chat=chat)
        _, cache = generate(model, ids, tracker, max_new_tokens=max_new_tokens)
        for layer in cache.layers:
            state = getattr(layer, "state", None)
            if isinstance(state, _LazyState) and state.mri is not None:
                values.append(state.mri[state.mri > 0].flatten())
    check(bool(values) and sum(v.numel() for v in values) > 0, "estimate_window saw no decode step: give prompts and max_new_tokens >= 2")
    mri = torch.cat(values)
    rank = max(1, math.ceil(percentile / 100 * mri.numel()))  # nearest-rank percentile (no size limit)
    return max(1, int(mri.kthvalue(rank).values))
