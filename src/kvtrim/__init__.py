"""kvtrim: KV-cache eviction for long-context inference with Hugging Face transformers."""

from kvtrim.cache import CacheStats, TrimCache, TrimLayer
from kvtrim.methods import (
    METHODS,
    EvictionMethod,
    FullCache,
    KvtrimError,
    LagKV,
    StreamingLLM,
    lagkv_keep_ratio_for,
    lagkv_stored_length,
    make_method,
)

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "CacheStats",
    "EvictionMethod",
    "FullCache",
    "KvtrimError",
    "LagKV",
    "StreamingLLM",
    "TrimCache",
    "TrimLayer",
    "lagkv_keep_ratio_for",
    "lagkv_stored_length",
    "make_method",
]
