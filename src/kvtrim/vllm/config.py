"""The server-wide settings the worker and the scheduler both read (no vLLM import)."""

from __future__ import annotations

from kvtrim.methods.base import KvtrimError
from kvtrim.vllm import CONFIG_KEY


def server_method(vllm_config) -> str:
    """The server's default spec: `--additional-config '{"kvtrim_method": SPEC}'` (default `full`)."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    return str(extra.get(CONFIG_KEY, "full"))


def refuse_features(vllm_config) -> None:
    """One-line refusals of what would share or replay compacted blocks."""
    if vllm_config.cache_config.enable_prefix_caching:
        raise KvtrimError("kvtrim's vLLM worker refuses prefix caching (compacted blocks must not be shared): "
                          "pass --no-enable-prefix-caching")
    if vllm_config.speculative_config is not None:
        raise KvtrimError("kvtrim's vLLM worker refuses speculative decoding (drafts would replay evicted entries)")
    if vllm_config.parallel_config.world_size > 1:
        raise KvtrimError("kvtrim's vLLM worker runs on one worker only (tensor/pipeline parallel size 1)")
