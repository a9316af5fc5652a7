#!/usr/bin/env bash
# Find out whether kvtrim works with a given transformers release: install it (with torch 2.13.0, the local
# CPU wheel) into a scratch venv and run the fast tests (-m "not integration") from this checkout.
#   scripts/transformers_bound.sh 5.23.0 5.24.0      (VENV: scratch venv, default /tmp/kvtrim-tf-bound)
# The result behind the lower bound in pyproject.toml is in benchmarks/transformers_bound.md.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/kvtrim-tf-bound}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q pytest matplotlib "gguf>=0.10" "accelerate>=1.1"
fi
for version in "$@"; do
  "$VENV/bin/python" -m pip install -q "transformers==$version" 2>/dev/null || { echo "transformers $version: pip failed"; continue; }
  summary=$(PYTHONPATH=$PWD/src "$VENV/bin/python" -m pytest -q -x -m "not integration" -p no:cacheprovider 2>&1 | tail -1)
  first_error=$(PYTHONPATH=$PWD/src "$VENV/bin/python" -c "import kvtrim" 2>&1 | tail -1)
  echo "transformers $version: ${summary}${first_error:+ | import kvtrim: $first_error}"
done
