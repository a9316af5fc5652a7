# Two commands for a fresh machine (each installs what it needs into .venv):
#   make demo   - the main job on the default model (SmolLM2-135M-Instruct)
#   make test   - the wheel check (scripts/check_wheel.sh: the built wheel installs and imports with only the
#                 core dependencies, outside the repository), then the test suite (unit tests on tiny
#                 random models + integration tests on the real model), without the tests marked `slow`
#   make test-slow - only the tests marked `slow` (minutes on 2 CPU threads; not part of CI)
#   make serve-env - the serving environment .venv-serve (vLLM's CPU build + kvtrim's plugin; scripts/serve_env.sh)
#   make serve     - `kvtrim serve` on SmolLM2 with KeyDiff at half the prompt (OpenAI API on 127.0.0.1:8000)
#   make bench-serving - plain vLLM vs `kvtrim serve` under one concurrent load (benchmarks/serving/README.md; long,
#                 needs a quiet machine; not part of `make test`). Extra flags: make bench-serving ARGS="--resume"
#   make bench-serving-long - the long-generation load: short prompts, 2,000 output tokens each, methods at a
#                 budget of 512 entries that evict while decoding (benchmarks/serving/README.md)
#   make bench-serving-long-4000 - the same with 4,000 output tokens each (22 requests: two waves of kvtrim's 11)
#   make bench-serving-long-prompt - ~7,000-token prompts on a pool of 2,048 tokens (plain vLLM refuses to
#                 start so; KeyDiff reads the prompts in blocks under its budget)
# `make test` also builds .venv-serve and runs the plugin's tests there (tests/test_vllm_*.py: vLLM pulls an
# older transformers than kvtrim's core needs, so they run in their own environment).
.PHONY: setup demo test test-fast test-slow serve-env serve bench-serving bench-serving-long \
	bench-serving-long-4000 bench-serving-long-prompt

VLLM_TESTS = tests/test_vllm_spec.py tests/test_vllm_kernels.py tests/test_vllm_layout.py tests/test_vllm_layout_amx.py tests/test_vllm_layout_flash.py \
	tests/test_vllm_live_batch.py tests/test_vllm_scheduler.py tests/test_vllm_parallel.py \
	tests/test_vllm_server.py tests/test_vllm_attention.py tests/test_vllm_eval.py

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/kvtrim eval --preset quick

test: setup serve-env
	./scripts/check_wheel.sh
	.venv/bin/python -m pytest -q -m "not slow"
	.venv-serve/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

serve-env:
	./scripts/serve_env.sh

serve: serve-env
	.venv-serve/bin/kvtrim serve --model smollm2-135m --method keydiff:compression_ratio=0.5 \
		--dtype bfloat16 --enforce-eager --gpu-memory-utilization 0.25

# setup: the plot runs from .venv (matplotlib is not in .venv-serve)
bench-serving: setup serve-env
	.venv-serve/bin/python benchmarks/serving/run.py --out benchmarks/serving/results $(ARGS)

LONG_METHODS = lazyeviction:budget=512,keydiff:budget=512,streaming:budget=512,lagkv:keep_ratio=0.125
bench-serving-long: setup serve-env
	.venv-serve/bin/python benchmarks/serving/run.py --out benchmarks/serving/results-long-32 --requests 32 \
		--prompt-tokens 256 --max-tokens 2000 --max-model-len 2304 --blocks 56 --methods $(LONG_METHODS) $(ARGS)

LONG_4000_METHODS = streaming:budget=512,keydiff:budget=512,lagkv:keep_ratio=0.0625,lazyeviction:budget=512
bench-serving-long-4000: setup serve-env
	.venv-serve/bin/python benchmarks/serving/run.py --out benchmarks/serving/results-long-4000 --requests 22 \
		--prompt-tokens 256 --max-tokens 4000 --max-model-len 4352 --blocks 56 --methods $(LONG_4000_METHODS) $(ARGS)

LONG_PROMPT_METHODS = keydiff:budget=1024:block_size=256,keydiff:budget=512:block_size=256
bench-serving-long-prompt: setup serve-env
	.venv-serve/bin/python benchmarks/serving/run.py --out benchmarks/serving/results-long-prompt --requests 8 \
		--prompt-tokens 7000 --max-tokens 64 --max-model-len 8192 --blocks 17 --methods $(LONG_PROMPT_METHODS) $(ARGS)

test-slow: setup
	.venv/bin/python -m pytest -q -m slow --durations=0

test-fast: setup
	.venv/bin/python -m pytest -q -m "not integration"
