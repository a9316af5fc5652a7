"""`kvtrim eval --server` against a real `kvtrim serve` on 127.0.0.1 (SmolLM2, float32), next to the in-process
`kvtrim eval` on the same jobs: the same greedy answers, token for token.

Run from .venv-serve (the server needs vLLM); both `kvtrim eval` commands run as subprocesses in kvtrim's own
environment (`.venv`, or $KVTRIM_PLAIN_PYTHON): the in-process path needs transformers >= 5.24, which
.venv-serve does not have, and the client imports no vLLM. Skipped where either is missing."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

from vllm_server import Server  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAIN = os.environ.get("KVTRIM_PLAIN_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
#: one list_recall sample of 400 tokens (296 prompt tokens, answers up to 104): `full`, and LazyEviction at a
#: budget of 120 entries evicting every 8 decode steps (the prompt stays whole, then it evicts while decoding)
JOB = ["--tasks", "list_recall", "--lengths", "400", "--samples", "1", "--methods", "full,lazyeviction:window=8",
       "--budgets", "120", "--query-aware", "--full-answers", "--no-plots", "--quiet"]


def _eval(out: pathlib.Path, *flags: str) -> list[dict]:
    done = subprocess.run([PLAIN, "-m", "kvtrim.cli", "eval", *JOB, "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "results.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.skipif(not os.path.exists(PLAIN), reason=f"needs kvtrim's own environment at {PLAIN} (make setup)")
def test_server_answers_equal_the_in_process_answers(tmp_path):
    server = Server(method="full", extra=["--dtype", "float32"])  # the last --dtype wins over SERVER_FLAGS'
    try:
        served = _eval(tmp_path / "server", "--server", server.url)
    finally:
        server.stop()
    local = _eval(tmp_path / "local")
    assert [r["key"] for r in served] == [r["key"] for r in local]
    for s, t in zip(served, local):
        assert s["backend"] == "vllm" and t["backend"] == "transformers" and "error" not in s, s
        assert s["prompt_tokens"] == t["prompt_tokens"] == 296
        assert (s["new_tokens"], s["prediction"]) == (t["new_tokens"], t["prediction"]), s["method"]
        assert s["score"] == t["score"]
    lazy = served[1]
    assert lazy["vllm_spec"] == "lazyeviction:budget=120:window=8"
    assert local[1]["peak_stored"] < local[1]["prompt_tokens"] + local[1]["new_tokens"]  # it did evict
    assert lazy["new_tokens"] != served[0]["new_tokens"]  # and that changed the answer (33 vs 104 tokens)
