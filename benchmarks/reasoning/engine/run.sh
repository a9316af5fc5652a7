#!/bin/bash
# The reasoning preset through the vLLM engine next to the in-process path, both query-aware (the engine
# compresses the whole prompt). Run from the repository root; writes OUT/{vllm,transformers,comparison.md}.
#   benchmarks/reasoning/engine/run.sh [OUT]        # default: runs/reasoning-engine
set -euo pipefail
OUT=${1:-runs/reasoning-engine}
PORT=8011
mkdir -p "$OUT"
# a small KV pool (128 blocks) and the environment vLLM's CPU build needs for it (the server's, not the user's shell)
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-serve/bin/kvtrim serve --model qwen2.5-coder-0.5b \
    --method full --port $PORT --dtype float32 --enforce-eager --max-model-len 2048 --max-num-seqs 8 \
    --num-gpu-blocks-override 128 --seed 0 > "$OUT/server.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 2; done
.venv/bin/kvtrim eval --preset reasoning --query-aware --server http://127.0.0.1:$PORT --batch-size 8 --out "$OUT/vllm"
kill $PID; wait $PID 2>/dev/null || true; trap - EXIT
.venv/bin/kvtrim eval --preset reasoning --query-aware --out "$OUT/transformers" --quiet
.venv/bin/python benchmarks/reasoning/compare_backends.py "$OUT/transformers" "$OUT/vllm" > "$OUT/comparison.md"
cat "$OUT/comparison.md"
