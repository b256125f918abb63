# Two entry points for a fresh machine (Python 3.11+ with venv):
#   make demo   installs kfac_jax with its example extras and trains the MNIST classifier
#   make test   installs kfac_jax with its test extras and runs the test suite
# constraints.txt pins one known-good set per Python version, so
#   make test PYTHON=python3.12 VENV=.venv-newest
# tests the newest jax (what .ci/run runs after make test).
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/python -m pip
INSTALL = $(PIP) install -q -c constraints.txt

.PHONY: demo test lint install-examples install-test install-lint

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install-examples: $(VENV)/bin/python
	$(INSTALL) -e ".[examples]"

install-test: $(VENV)/bin/python
	$(INSTALL) -e ".[test]"

demo: install-examples
	$(VENV)/bin/python -m examples.mnist_classifier

# Tests run on PYTEST_WORKERS processes (pytest-xdist): XLA compiles on one
# thread, so two tests at a time keep both cores of the CI machine busy,
# and one OpenBLAS thread each keeps their LAPACK calls from oversubscribing
# them (faster than one test at a time with the default threads).
PYTEST_WORKERS ?= 2
# Tests compile with XLA's LLVM optimizations off: the same HLO programs,
# compiled faster, which shortens the suite, and the tests' models are too
# small for the generated code's speed to matter.
# TEST_XLA_FLAGS= (empty) runs them as users' programs are compiled.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
# Set only when non-empty: XLA reads a blank XLA_FLAGS as a file name and aborts.
TEST_XLA_ENV = $(strip $(XLA_FLAGS) $(TEST_XLA_FLAGS))
# PYTEST_ARGS="-k name" (or test paths) narrows the run.
PYTEST_ARGS ?=

test: install-test
	OPENBLAS_NUM_THREADS=1 $(if $(TEST_XLA_ENV),XLA_FLAGS="$(TEST_XLA_ENV)") $(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# make lint: ruff (lint and format) over the Python files and pyright over
# the package, zero findings; the tools are pinned in pyproject's lint extra.
# pyright reads jax, flax and optax from the venv's python.
LINT_PATHS = kfac_jax tests examples benchmarks docs

install-lint: $(VENV)/bin/python
	$(INSTALL) -e ".[lint]"

lint: install-lint
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/pyright --pythonpath $(abspath $(VENV))/bin/python

# make docs: the Sphinx site (docs/) into docs/_build/html, warnings as
# errors; a name of kfac_jax.__all__ missing from docs/api.md fails it too
# (docs/conf.py). The guide's code runs in make test (tests/test_docs.py).
.PHONY: docs install-docs

install-docs: $(VENV)/bin/python
	$(INSTALL) -e ".[docs]"

docs: install-docs
	$(VENV)/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html
