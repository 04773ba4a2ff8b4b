# The two quick-start commands: `make demo` runs the main job, `make test` runs the whole test suite.
# Both create (or reuse) the virtual environment .venv, installing torch==2.13.0 first (the CPU build),
# then the project with its dev extra.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/sparsegen: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m sparsegen.kernels  # the C++ kernels, built once for this machine (cached)
	touch $@

.PHONY: install demo demo-long test test-fast lint
install: $(BIN)/sparsegen

demo: install  # a first look in minutes: 3 policies over 10k tokens (`make demo-long`: every policy, 20k)
	$(BIN)/sparsegen stream --tokens 10000 --policies window,streaming,h2o --out results/stream

demo-long: install
	$(BIN)/sparsegen stream --out results/stream-long

test: install
	$(BIN)/python -m pytest -q

# while developing: unit tests on tiny models (no real model, no worker processes), on two pytest
# workers of one thread each (the tiny models' tests and compiles are mostly Python)
test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not real and not slow" -n 2

lint: install
	$(BIN)/ruff check src tests
