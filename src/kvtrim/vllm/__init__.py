"""kvtrim inside vLLM: token eviction in vLLM's own engine, with the same method objects.

Pieces (each through one of vLLM's extension points; vLLM's files are never edited):

* `kvtrim.vllm.spec`: which methods run in the engine, and the one-line refusals (no vLLM import).
* `kvtrim.vllm.layout`: the CPU backend's KV block layout (kernels "vec", "vec16"), read and written as
  `(kv_heads, n, head_dim)`; `kvtrim.vllm.layout_amx`: the same for its "amx" kernel (`block_layout` picks).
* `kvtrim.vllm.planning`: what each forward of a request is to its method, and how many entries the request
  stores after it (the scheduler's counts and plan).
* `kvtrim.vllm.compact`: the kept positions of one request, chosen by a `TrimCache` (the same code path
  as `model.generate`, `kvtrim.vllm.decide`), and the compaction of its blocks (`kvtrim.vllm.block_io`,
  `kvtrim.vllm.entries`).
* `kvtrim.vllm.worker`: `--worker-cls kvtrim.vllm.worker.TrimCPUWorker` (a model runner subclass that
  compacts after the forward and keeps true positions for later tokens).
* `kvtrim.vllm.attention`: vLLM's CPU attention backend subclassed (registered through `register_backend`),
  which copies the post-RoPE queries the worker asks for (a prompt's last window) and computes the decode steps'
  logits of the methods fed attention (`kvtrim.vllm.kernels`: kvtrim's C++ kernel, built once per machine;
  `kvtrim.vllm.live`: the decision layer such a request keeps between its steps).
* `kvtrim.vllm.validate`: `--logits-processors kvtrim.vllm.validate:MethodSpecCheck`, whose
  `validate_params` refuses a bad per-request spec before the request is admitted (HTTP 400).
* `kvtrim.vllm.platform`: vLLM's CPU platform (a `vllm.platform_plugins` entry point, in `kvtrim serve` only)
  whose front-end check refuses a request that can never fit the pool (HTTP 400).
* `kvtrim.vllm.cli`: `kvtrim serve`, which starts `python -m vllm.entrypoints.openai.api_server` with those.

The worker overrides private methods of vLLM's model runner, so it runs on exactly `VLLM_VERSION`.
"""

VLLM_VERSION = "0.32.0"
#: the server's default method, read by the worker from `--additional-config '{"kvtrim_method": SPEC}'`
CONFIG_KEY = "kvtrim_method"
#: how the scheduler admits requests: `--additional-config '{"kvtrim_admission": "peak" | "vllm"}'`
ADMISSION_KEY = "kvtrim_admission"
#: "peak" (default): by their method's peak, never preempted by a later one; "vllm": as vLLM admits
ADMISSIONS = ("peak", "vllm")
#: the per-request method: `extra_body={"vllm_xargs": {"kvtrim": SPEC}}` (SamplingParams.extra_args)
REQUEST_KEY = "kvtrim"
#: a context to compress on its own: `vllm_xargs={"kvtrim_context": N}`, the number of leading prompt tokens the
#: method is told as the prompt (compressed query-agnostically, as `kvtrim.compress`); the rest is read after it
CONTEXT_KEY = "kvtrim_context"
#: set to "1" in the environment of `kvtrim serve`'s server only: kvtrim's platform plugin activates there
SERVE_ENV = "KVTRIM_SERVE"
