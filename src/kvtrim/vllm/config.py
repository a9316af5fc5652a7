"""The server-wide settings the worker and the scheduler both read (no vLLM import)."""

from __future__ import annotations

from kvtrim.methods.base import KvtrimError
from kvtrim.vllm import ADMISSION_KEY, ADMISSIONS, CONFIG_KEY


def server_method(vllm_config) -> str:
    """The server's default spec: `--additional-config '{"kvtrim_method": SPEC}'` (default `full`)."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    return str(extra.get(CONFIG_KEY, "full"))


def server_admission(vllm_config) -> str:
    """How the scheduler admits requests: `--additional-config '{"kvtrim_admission": ...}'` (default "peak"),
    or a one-line `KvtrimError`."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    value = extra.get(ADMISSION_KEY, "peak")
    if value not in ADMISSIONS:
        raise KvtrimError(f"{ADMISSION_KEY} must be one of {', '.join(ADMISSIONS)}, got {value!r}")
    return value


def refuse_features(vllm_config) -> None:
    """One-line refusals, at start, of what compaction would break: replayed or transferred blocks, a step
    scheduled before the last one's blocks are freed, attention that depends on where an entry is stored, entries
    not stored in the model's dtype, layers whose caches are not plain full attention."""
    if vllm_config.speculative_config is not None:
        raise KvtrimError("kvtrim's vLLM worker refuses speculative decoding (drafts would replay evicted entries)")
    if vllm_config.kv_transfer_config is not None:
        raise KvtrimError("kvtrim's vLLM worker refuses a KV connector (--kv-transfer-config, --kv-offloading-size): "
                          "it would save or load compacted blocks as if they held the request's tokens in order")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise KvtrimError("kvtrim's vLLM worker refuses pipeline parallelism (--pipeline-parallel-size): each stage "
                          "would compact its own layers with counts only the last one samples by")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise KvtrimError("kvtrim's vLLM worker refuses async scheduling (the next step would be scheduled before "
                          "this step's compaction frees its blocks): pass --no-async-scheduling")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        raise KvtrimError(f"kvtrim's vLLM worker refuses a quantised KV cache (--kv-cache-dtype {cache_dtype}): "
                          "methods score and move entries in the model's dtype")
    model = vllm_config.model_config
    if model is None:
        return
    if model.uses_alibi:
        raise KvtrimError("kvtrim's vLLM worker refuses ALiBi models (their attention bias follows where an entry "
                          "is stored, which compaction changes)")
    layer_types = getattr(model.hf_text_config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ("attention", "full_attention")})
    if model.get_sliding_window() is not None or other or model.is_hybrid:
        window = model.get_sliding_window()
        what = ", ".join(other) if other else (f"sliding window {window}" if window is not None else "hybrid")
        raise KvtrimError(f"kvtrim's vLLM worker refuses models with sliding-window or hybrid layers ({what}): every "
                          "layer must be plain full attention sharing one block table")
