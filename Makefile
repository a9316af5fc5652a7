# Two commands for a fresh machine (each installs what it needs into .venv):
#   make demo   - the main job on the default model (SmolLM2-135M-Instruct)
#   make test   - the wheel check (scripts/check_wheel.sh: the built wheel installs and imports with only the
#                 core dependencies, outside the repository), then the test suite (unit tests on tiny
#                 random models + integration tests on the real model)
.PHONY: setup demo test test-fast

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/kvtrim eval --preset quick

test: setup
	./scripts/check_wheel.sh
	.venv/bin/python -m pytest -q

test-fast: setup
	.venv/bin/python -m pytest -q -m "not integration"
