"""`--logits-processors kvtrim.vllm.validate:MethodSpecCheck`: a bad per-request method (or `kvtrim_context`
value) is an HTTP 400.

vLLM calls each custom logits processor's `validate_params` in the frontend when a request is admitted
(`InputProcessor`), before it reaches the engine, and turns a `ValueError` into a 400 with its message.
The processor itself changes no logits (`apply` returns them unchanged, argmax-invariant).
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor

from kvtrim.methods.base import KvtrimError
from kvtrim.vllm import REQUEST_KEY
from kvtrim.vllm.spec import method_for_vllm, request_context


class MethodSpecCheck(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params):
        extra = sampling_params.extra_args or {}
        try:
            request_context(sampling_params)
            if REQUEST_KEY in extra:
                method_for_vllm(extra[REQUEST_KEY])
        except KvtrimError as err:
            raise ValueError(f"kvtrim: {err}") from None

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass
