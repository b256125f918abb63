# Two entry points for a fresh machine (Python 3.10+ with venv):
#   make demo   installs kfac_jax with its example extras and trains the MNIST classifier
#   make test   installs kfac_jax with its test extras and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/python -m pip
INSTALL = $(PIP) install -q -c constraints.txt

.PHONY: demo test install-examples install-test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install-examples: $(VENV)/bin/python
	$(INSTALL) -e ".[examples]"

install-test: $(VENV)/bin/python
	$(INSTALL) -e ".[test]"

demo: install-examples
	$(VENV)/bin/python examples/mnist_classifier.py

# Tests run on PYTEST_WORKERS processes (pytest-xdist): XLA compiles on one
# thread, so two tests at a time keep both cores of the CI machine busy,
# and one OpenBLAS thread each keeps their LAPACK calls from oversubscribing
# them (pytest took 11.3 min this way against 17.5 min one at a time with the
# default threads, on that 2-core machine).
PYTEST_WORKERS ?= 2

test: install-test
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS)
