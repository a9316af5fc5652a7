#!/usr/bin/env bash
# CI step of `make test`: build kvtrim's wheel, install it into a fresh virtual environment with only its
# core dependencies (torch 2.13.0, the local CPU wheel, and transformers), outside the repository, and
# check there that `import kvtrim` and `kvtrim methods` work, that no extra came along, that the files
# an installed kvtrim needs are inside the wheel, and that a missing extra is a one-line error naming it.
#   scripts/check_wheel.sh          (BUILD_PYTHON: the interpreter with setuptools, default .venv/bin/python;
#                                    PYTHON: the base interpreter of the fresh venv, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PYTHON=${BUILD_PYTHON:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtrim-wheel.XXXXXX")
# removing a venv with torch in it takes a minute on a slow disk: done in the background (the tests go on)
trap 'rm -rf "$work" >/dev/null 2>&1 &' EXIT
start=$SECONDS

# build from a copy of what the wheel is made of, so that no stale build/ folder can leak into it
mkdir "$work/src"
cp -r pyproject.toml README.md LICENSE src "$work/src/"
"$BUILD_PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src" >/dev/null
wheel=$(ls "$work"/dist/kvtrim-*.whl)
"${PYTHON:-python3}" -m venv "$work/venv"
# the pinned torch first (a plain `torch` requirement could pull a multi-GB CUDA build); then the wheel
# with whatever it declares, resolved by pip (--no-compile: byte-compiling torch doubles the time)
"$work/venv/bin/python" -m pip install -q --no-compile torch==2.13.0
"$work/venv/bin/python" -m pip install -q --no-compile "$wheel"

cd "$work"  # not the repository: the installed copy is what gets imported
env -u PYTHONPATH "$work/venv/bin/python" - "$work/venv" <<'PY'
import importlib.util
import os
import pathlib
import sys

venv = pathlib.Path(sys.argv[1]).resolve()
before = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_"))}
import kvtrim  # noqa: E402

where = pathlib.Path(kvtrim.__file__).resolve()
assert venv in where.parents, f"kvtrim imported from {where}, not from the fresh venv"
after = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_"))}
assert after == before, f"import kvtrim changed the environment: {before} -> {after}"
extras = [m for m in ("matplotlib", "gguf", "accelerate") if importlib.util.find_spec(m)]
assert not extras, f"optional dependencies installed with the core: {extras}"
for name in ("py.typed", "bench/kvpress_side.py"):
    assert (where.parent / name).is_file(), f"{name} is missing from the wheel"
print(f"import kvtrim {kvtrim.__version__} from {where.parent} with only the core dependencies: ok")
PY
env -u PYTHONPATH "$work/venv/bin/kvtrim" methods >"$work/methods.txt"
grep -q "^lagkv " "$work/methods.txt" || { echo "kvtrim methods did not list lagkv"; exit 1; }
echo "kvtrim methods: $(grep -c '^[a-z]' "$work/methods.txt") methods listed: ok"
mkdir "$work/empty"
set +e
err=$(env -u PYTHONPATH "$work/venv/bin/kvtrim" eval --report-only --out "$work/empty" 2>&1 >/dev/null)
rc=$?
set -e
if [ "$rc" -ne 2 ] || [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ] || [[ "$err" != *"kvtrim[eval]"* ]]; then
  echo "a missing extra should be one line naming kvtrim[eval] (exit 2); got exit $rc: $err"
  exit 1
fi
echo "missing extra: $err"
echo "wheel check passed in $((SECONDS - start)) s"
