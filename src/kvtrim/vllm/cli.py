"""`kvtrim serve`: vLLM's own OpenAI-compatible server with kvtrim's worker (run it from `.venv-serve`).

    .venv-serve/bin/kvtrim serve --model smollm2-135m --method lagkv:compression_ratio=0.5 --port 8000 \
        --dtype bfloat16 --enforce-eager --gpu-memory-utilization 0.25     # unknown flags go to vLLM

It checks what it can before anything loads (the method spec, the vLLM version, refused features), then
runs `python -m vllm.entrypoints.openai.api_server` with:
`--worker-cls kvtrim.vllm.worker.TrimCPUWorker` (eviction), `--scheduler-cls
kvtrim.vllm.scheduler.TrimScheduler` (the emptied blocks go back to the pool), `--logits-processors
kvtrim.vllm.validate:MethodSpecCheck` (a bad per-request spec is a 400), `--additional-config
{"kvtrim_method": SPEC}` (the server's default). Prefix caching is vLLM's (on unless
`--no-enable-prefix-caching`): requests whose method compacts neither read nor write it
(`kvtrim.vllm.manager`).
Named models (`kvtrim models`) resolve to their local safetensors copy (built on first use). The child
process alone gets `HF_HUB_OFFLINE=1`, `KVTRIM_SERVE=1` (kvtrim's platform plugin: `kvtrim.vllm.platform`)
and `LD_PRELOAD` of the environment's `libiomp5.so` (OpenMP wants it loaded first); the caller's environment
is left as it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

from kvtrim.methods.base import KvtrimError, check
from kvtrim.vllm import ADMISSIONS, SERVE_ENV

#: flags kvtrim serve sets itself, or refuses (the reason)
_OWN = {"--worker-cls": "kvtrim serve sets the worker itself",
        "--scheduler-cls": "kvtrim serve sets the scheduler itself (it returns compacted blocks to the pool)",
        "--logits-processors": "kvtrim serve sets it itself",
        "--additional-config": "use --method for the server's default", "--model": None}
_REFUSED = {
    "--speculative-config": "speculative decoding would replay evicted entries",
    "--kv-transfer-config": "a KV connector would save or load compacted blocks as if they held the tokens in order",
    "--kv-offloading-size": "KV offloading is a KV connector: it would save or load compacted blocks as if they held "
                            "the tokens in order",
    "--pipeline-parallel-size": "pipeline stages are not supported yet (tensor and data parallelism are)",
    "-pp": "pipeline stages are not supported yet (tensor and data parallelism are)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", allow_abbrev=False,
                       help="vLLM's OpenAI-compatible server with kvtrim eviction (from .venv-serve: make serve-env)",
                       description="Start vLLM's OpenAI server with kvtrim's worker; any other flag goes to vLLM "
                                   "unchanged (e.g. --max-num-seqs, --num-gpu-blocks-override, --dtype).")
    p.add_argument("--model", required=True, help="a name of `kvtrim models`, a local model directory or a hub id "
                                                  "in the local Hugging Face cache")
    p.add_argument("--method", default="full", help="the server's default method spec (a request may pick its own "
                                                    "with vllm_xargs={'kvtrim': SPEC}); default: full")
    p.add_argument("--admission", choices=ADMISSIONS, default="peak",
                   help="peak (default): a request is admitted when the pool holds its method's peak beside what "
                        "the running requests may still take, so it is never preempted by a later one; vllm: as "
                        "vLLM admits (by the prompt; growing requests are preempted when the pool runs out)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command line instead of running it")
    p.set_defaults(func=cmd_serve, passes_unknown=True)


def _check_passthrough(extra: list[str]) -> None:
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):  # as vLLM reads it: --kv_transfer_config, --kv-transfer-config.kv_connector
            flag = flag.split(".", 1)[0].replace("_", "-")
        if flag in _REFUSED:
            raise KvtrimError(f"kvtrim serve refuses {flag}: {_REFUSED[flag]}")
        if flag in _OWN and _OWN[flag]:
            raise KvtrimError(f"kvtrim serve refuses {flag}: {_OWN[flag]}")


def _libiomp() -> str | None:
    lib = pathlib.Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(lib) if lib.exists() else None


def vllm_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The child's argv (checks first: spec, passthrough flags, model)."""
    from kvtrim.models import resolve_model_dir
    from kvtrim.vllm import ADMISSION_KEY, CONFIG_KEY
    from kvtrim.vllm.spec import method_for_vllm

    method_for_vllm(args.method)
    _check_passthrough(extra)
    check(1 <= args.port <= 65535, f"--port must be in 1..65535, got {args.port}")
    model = str(resolve_model_dir(args.model))
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", args.host, "--port", str(args.port),
            "--worker-cls", "kvtrim.vllm.worker.TrimCPUWorker",
            "--scheduler-cls", "kvtrim.vllm.scheduler.TrimScheduler",
            "--logits-processors", "kvtrim.vllm.validate:MethodSpecCheck",
            "--additional-config", json.dumps({CONFIG_KEY: args.method, ADMISSION_KEY: args.admission}), *extra]


def child_env() -> dict[str, str]:
    """The server's environment: the caller's plus HF_HUB_OFFLINE=1 and the OpenMP preload (unless the caller
    preloads an OpenMP runtime already)."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    lib = _libiomp()
    preload = env.get("LD_PRELOAD", "")
    # one OpenMP runtime: vLLM refuses Intel's and GNU's preloaded together
    if lib and not any(omp in preload for omp in ("libiomp", "libgomp", "libomp")):
        env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    return env


def cmd_serve(args: argparse.Namespace) -> int:
    extra = list(getattr(args, "unknown_args", []))
    if importlib.util.find_spec("vllm") is None:
        raise KvtrimError("kvtrim serve needs vLLM's CPU build: run `make serve-env`, then .venv-serve/bin/kvtrim serve")
    from kvtrim.vllm.worker_check import check_vllm_version

    check_vllm_version()
    cmd = vllm_command(args, extra)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    proc = subprocess.Popen(cmd, env=dict(child_env(), **{SERVE_ENV: "1"}))  # kvtrim's platform (plugin.platform)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: stop the server, then report
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
