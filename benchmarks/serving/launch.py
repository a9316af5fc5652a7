"""Start one OpenAI-compatible server on 127.0.0.1 (plain vLLM or `kvtrim serve`), wait for `/health`, stop it.

The server runs in its own session with its log in a file, so `stop()` ends it and its engine process
together. Both kinds get the same vLLM flags, the same environment (OpenMP preloaded as `kvtrim serve`
does it, `VLLM_CPU_KVCACHE_SPACE=1`, `VLLM_CPU_OMP_THREADS_BIND=nobind`) and prefix caching off (on for both
in the document-QA load, `docqa.py`).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_binding(ranks: int) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` for `ranks` workers: "nobind" for one; else this process's CPUs split
    into `ranks` runs ("0|1" for two ranks on two cores: vLLM's automatic binding refuses one NUMA node)."""
    if ranks == 1:
        return "nobind"
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    runs = [cpus[r * per:(r + 1) * per] or cpus[-1:] for r in range(ranks)]
    return "|".join(str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" for c in runs)


def server_env(plain: bool = False, ranks: int = 1, path: str | None = None) -> dict[str, str]:
    """The caller's environment plus the checkout's `src` first on PYTHONPATH (the server runs this
    checkout's kvtrim; `path`: folders after it, e.g. a package of methods), OpenMP preloaded and HF_HUB_OFFLINE=1
    (`kvtrim.vllm.cli.child_env`), the threads bound for `ranks` workers (`thread_binding`); for plain vLLM (`plain`)
    no general plugin either: kvtrim's entry point would install its attention backend there."""
    from kvtrim.vllm.cli import child_env

    env = dict(child_env(), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=thread_binding(ranks))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(SRC), path, env.get("PYTHONPATH", "")) if x)
    if plain:
        env["VLLM_PLUGINS"] = ""  # vLLM as shipped: none of the installed general plugins
    return env


def server_command(model: str, method: str | None, port: int, flags: list[str],
                   prefix_caching: bool = False) -> list[str]:
    """argv of plain vLLM (`method=None`) or of `kvtrim serve --method METHOD`; prefix caching off unless
    `prefix_caching` (the document-QA load)."""
    caching = [] if prefix_caching else ["--no-enable-prefix-caching"]
    if method is None:
        from kvtrim.models import resolve_model_dir

        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_dir(model)),
                "--host", "127.0.0.1", "--port", str(port), *caching, *flags]
    return [sys.executable, "-m", "kvtrim.cli", "serve", "--model", model, "--method", method,
            "--host", "127.0.0.1", "--port", str(port), *caching, *flags]


class Server:
    """A running server: `url`, `log_path`, `start_s` (seconds until `/health` answered)."""

    def __init__(self, model: str, method: str | None, flags: list[str], log_path: pathlib.Path,
                 timeout: float = 900, prefix_caching: bool = False, ranks: int = 1, path: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.cmd = server_command(model, method, self.port, flags, prefix_caching)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=server_env(plain=method is None, ranks=ranks, path=path),
                                     start_new_session=True)
        try:
            self._wait_healthy(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.cause()} (log: {self.log_path})\n"
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server did not answer /health in time (log: {self.log_path}):\n{self.tail()}")

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def cause(self) -> str:
        """The first line of the log that is an exception's (vLLM prints the root cause first), or '?'."""
        for line in self.log_text().splitlines():
            m = re.match(r"(?:.*\] )?(\w*(?:Error|Exception): .*)", line)  # bare, or after vLLM's `[file:line] `
            if m:
                return m.group(1)[:300]
        return "?"

    def tail(self, n: int = 30) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-n:])

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s, then SIGKILL to whatever of the
        group is left (an engine process outliving its server); idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
