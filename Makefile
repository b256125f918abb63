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

test: install-test
	$(VENV)/bin/python -m pytest
