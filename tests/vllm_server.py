"""Start `kvtrim serve` on 127.0.0.1 for the tests run from .venv-serve (tests/test_vllm_*.py), and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request



def native_bf16() -> bool:
    """True on a CPU that computes in bfloat16 natively (AMX or AVX-512 BF16). Elsewhere (e.g. AVX2 only) torch's
    bfloat16 matrix products are emulated: a SmolLM2 linear layer there took 39 ms in bfloat16 against 5.7 in
    float32 (one thread, 150 tokens, an AMD EPYC with AVX2, 2026-12-07)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


#: the test servers' dtype: vLLM's bfloat16 kernels ("amx" attention included) where the CPU runs them natively,
#: float32 where it would emulate them (the same tests, several times faster there)
SERVER_DTYPE = "bfloat16" if native_bf16() else "float32"

# a small, fixed pool and no large host reservation: other jobs share this machine
SERVER_FLAGS = ["--dtype", SERVER_DTYPE, "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "8",
                "--num-gpu-blocks-override", "128", "--seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`kvtrim serve --model MODEL --method METHOD` as a child process; `url` once `/health` answers."""

    def __init__(self, model: str = "smollm2-135m", method: str = "full", extra: list[str] | None = None,
                 timeout: float = 300, plain: bool = False, env_extra: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvtrim-serve-", suffix=".log", delete=False)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        if plain:  # vLLM alone, its own worker (OpenMP preloaded as kvtrim serve does it)
            from kvtrim.models import resolve_model_dir
            from kvtrim.vllm.cli import child_env

            env = dict(child_env(), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(model)),
                   "--port", str(self.port), *SERVER_FLAGS, *(extra or [])]  # (prefix caching on, as kvtrim serve)
        else:
            cmd = [sys.executable, "-m", "kvtrim.cli", "serve", "--model", model, "--method", method,
                   "--port", str(self.port), *SERVER_FLAGS, *(extra or [])]
        env.update(env_extra or {})  # the server's own environment (e.g. PYTHONPATH for a test plugin)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtrim serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"kvtrim serve did not answer in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # the server and its engine process (its own session)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
