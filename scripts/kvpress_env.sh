#!/usr/bin/env bash
# Create .venv-kvpress: NVIDIA kvpress 0.5.5 (the reference kvtrim is compared with) and the older
# transformers it needs (<5.3), apart from kvtrim's own .venv (transformers 5.x). Safe to re-run.
#   scripts/kvpress_env.sh   then   kvtrim bench --vs-kvpress ...   (runs src/kvtrim/bench/kvpress_side.py there)
# torch is pinned to the same build as .venv and installed first, so the resolver keeps it and never
# pulls a (multi-GB) CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPRESS_VENV:-.venv-kvpress}
stamp="$VENV/.kvpress-installed"
[ -f "$stamp" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q torch==2.13.0 "transformers==4.57.6" "kvpress==0.5.5" safetensors
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
touch "$stamp"
