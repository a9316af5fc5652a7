"""`TrimCpuPlatform`: vLLM's CPU platform, plus a 400 for a request that can never fit the server's KV pool, or
whose method fails on its input.

vLLM's front end checks each request, once its prompt is tokenised and before it reaches the engine, with its
platform's `validate_request(prompt, params)` (`InputProcessor.process_inputs`), and answers what it raises as
a client error (HTTP 400, the message as its one line). It is the one place of vLLM's front end that sees both
a request's prompt tokens and its sampling parameters (a logits processor's `validate_params` sees only the
parameters). kvtrim's `vllm.platform_plugins` entry point (`kvtrim.vllm.plugin:platform`) makes this subclass
vLLM's platform in the processes of `kvtrim serve` only (the server's environment has `SERVE_ENV`; plain vLLM in
the same environment keeps its own platform). It changes nothing else of the CPU platform.

The rule is the scheduler's manager's (`kvtrim.vllm.planning.never_fits`: the request's peak under its method
against the pool's blocks); the manager still ends such a request (HTTP 500) where this check cannot run: a
request given as embeddings, or before the engine has told the front end its pool's size. The method is also asked
here what the scheduler will ask it (`ask_as_the_scheduler`): a method that raises on this request's input is a
400 with its one line, not a 500 once the request has reached the engine.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

from kvtrim.methods.base import EvictionMethod, KvtrimError, one_line
from kvtrim.vllm.config import server_method
from kvtrim.vllm.planning import block_end, never_fits, plan_forward, prompt_block, request_peak, request_total
from kvtrim.vllm.spec import reads_prefix_cache, request_context, request_method, request_refusal, shares_context


def unfit_request(vllm_config, prompt_tokens: int, params) -> str | None:
    """Why a request of `prompt_tokens` with `params` (`SamplingParams`) can never run in the server of
    `vllm_config` (one line): its method or context is refused there (`request_refusal`), or it can never fit the
    pool;
    or None (also when the pool's size is not known yet, or the request is one vLLM refuses itself)."""
    pool = vllm_config.cache_config.num_gpu_blocks  # set by vLLM's engine client once the engine has started
    max_len = vllm_config.model_config.max_model_len
    if prompt_tokens >= max_len:  # (vLLM's own check refuses a prompt past max_model_len)
        return None
    try:
        method = request_method(params, server_method(vllm_config))
        context = request_context(params)
    except KvtrimError:  # a bad spec or context: `MethodSpecCheck` refused it already
        return None
    try:
        why = request_refusal(method, context, prompt_tokens, vllm_config.parallel_config.tensor_parallel_size)
        if why is not None:
            return why
        if method is not None:
            ask_as_the_scheduler(method, context or prompt_tokens)
        if not pool:
            return None
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - prompt_tokens
        total = request_total(prompt_tokens, max_tokens, max_len)
        block_size = vllm_config.cache_config.block_size
        peak, _ = request_peak(method, context or prompt_tokens, total, block_size)
        return never_fits(method, prompt_tokens, max_tokens, total, peak, block_size, pool - 1)  # one null block
    except Exception as err:  # noqa: BLE001 - the method refuses this request's input: the request's fault
        return f"{type(method).__name__} failed on this request: {one_line(err)}"


def ask_as_the_scheduler(method: EvictionMethod, prompt_tokens: int) -> None:
    """Ask `method` what the scheduler's manager asks it of a request whose method is told `prompt_tokens` as its
    prompt (`TrimAttentionManager.start`: whether it shares its context or the prefix cache, its repr for a
    context's key, its prompt block; then the compaction planned after the forward that ends its prompt, or its
    first prompt block): what it raises here it would raise there, where it would end the request with a 500."""
    shares_context(method)
    reads_prefix_cache(method)
    repr(method)
    block = prompt_block(method)
    plan_forward(None, method, 0, prompt_tokens if block is None else block_end(0, prompt_tokens, block), prompt_tokens)


class TrimCpuPlatform(CpuPlatform):
    """vLLM's CPU platform whose `validate_request` also refuses a request that can never fit the pool."""

    #: the server's configuration (the front end's: vLLM's engine client writes the pool's size into it)
    served_config = None

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        cls.served_config = vllm_config  # (vLLM calls it as it builds the server's configuration)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        # (imported here: vLLM loads its platform while `vllm.config`, which these import, is being imported)
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        super().validate_request(processed_inputs, params)
        config = cls.served_config
        tokens = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
        if config is None or tokens is None or not isinstance(params, SamplingParams):
            return
        why = unfit_request(config, len(tokens), params)
        if why is not None:
            raise VLLMValidationError(f"kvtrim: {why}")
