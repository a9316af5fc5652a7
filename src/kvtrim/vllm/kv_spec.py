"""The KV-cache spec kvtrim's worker reports: vLLM's full attention, whose most memory per request is the
server method's peak (`kvtrim.vllm.planning.longest_peak`), as vLLM's own sliding-window spec reports its
window. vLLM's start-up check (one request of `--max-model-len` tokens must fit in the pool) then asks for
`budget + block_size` entries under `keydiff:budget=...`, not `--max-model-len`: a server whose pool is
smaller than one full-length request starts. Any request that its own method would not fit in the pool is
refused by the front end (HTTP 400, `kvtrim.vllm.platform`) and, should one reach the scheduler, ended with an
error there (`TrimAttentionManager._unfit`), never admitted to be preempted forever.

The subclass adds no field (vLLM merges the layers' specs by their fields). It is registered in vLLM's
`KVCacheSpecRegistry` with its own manager, `kvtrim.vllm.manager.TrimAttentionManager` (grouped as full attention),
when this module is imported: in the worker (which reports the spec), the scheduler, and any process that
unpickles the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvtrim.vllm.planning import longest_peak
from kvtrim.vllm.config import server_method
from kvtrim.vllm.spec import method_for_vllm
from kvtrim.vllm.worker_check import check_vllm_version

check_vllm_version()

from vllm.config import get_current_vllm_config_or_none  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec  # noqa: E402
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

from kvtrim.vllm.manager import TrimAttentionManager  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class TrimAttentionSpec(FullAttentionSpec):
    """Full attention whose requests hold at most the server method's peak (module docstring)."""

    def max_memory_usage_bytes(self, vllm_config) -> int:
        method = method_for_vllm(server_method(vllm_config))
        tokens = longest_peak(method, vllm_config.model_config.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


def trim_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """`spec` as kvtrim's worker reports it: plain full attention becomes `TrimAttentionSpec`."""
    if type(spec) is not FullAttentionSpec:
        return spec
    return TrimAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})


def register() -> None:
    """Register `TrimAttentionSpec` with `TrimAttentionManager` in vLLM's `KVCacheSpecRegistry` (idempotent).
    vLLM fills its registry with its own specs only while it is empty: they are registered first (vLLM's own
    `register_all_kvcache_specs`, which registers the same classes again harmlessly)."""
    register_all_kvcache_specs(get_current_vllm_config_or_none())
    KVCacheSpecRegistry.register(TrimAttentionSpec, TrimAttentionManager, uniform_type_base_spec=FullAttentionSpec)


register()
