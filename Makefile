# The two set-up commands: `make demo` and `make test`. Each creates or updates .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# libtpu (the tpu extra) is only for ahead-of-time TPU compilation here; never open a TPU.
export JAX_PLATFORMS ?= cpu

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Runtime install (what `lhc demo` needs).
$(VENV)/.runtime-stamp: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# Everything the test suite needs: runtime, every method's extra, dev tools, libtpu,
# the TabICL prior, and the reference packages for parity tests (torch CPU,
# transformers, tabicl 0.1.4).
$(VENV)/.test-stamp: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[all,dev,tpu,prior,parity]"
	touch $@ $(VENV)/.runtime-stamp

demo: $(VENV)/.runtime-stamp
	$(BIN)/lhc demo

# The suite runs as a few pytest runs (tests/groups.py says why), each in TEST_WORKERS
# parallel processes (pytest-xdist): most tests are compile-bound and single-threaded,
# so two workers use both cores of a 2-core machine.
TEST_WORKERS ?= 2

test: $(VENV)/.test-stamp
	$(BIN)/python tests/groups.py -q -n $(TEST_WORKERS) --durations=15

lint: $(VENV)/.test-stamp
	$(BIN)/ruff check lhc kernels_pallas configs tests

clean:
	rm -rf $(VENV) .pytest_cache
