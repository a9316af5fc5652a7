# Two commands for a fresh machine (each installs what it needs into .venv):
#   make demo   - the main job on the default model (SmolLM2-135M-Instruct)
#   make test   - the wheel check (scripts/check_wheel.sh: the built wheel installs and imports with only the
#                 core dependencies, outside the repository), then the test suite (unit tests on tiny
#                 random models + integration tests on the real model), without the tests marked `slow`
#   make test-slow - only the tests marked `slow` (minutes on 2 CPU threads; not part of CI)
.PHONY: setup demo test test-fast test-slow

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/kvtrim eval --preset quick

test: setup
	./scripts/check_wheel.sh
	.venv/bin/python -m pytest -q -m "not slow"

test-slow: setup
	.venv/bin/python -m pytest -q -m slow --durations=0

test-fast: setup
	.venv/bin/python -m pytest -q -m "not integration"
