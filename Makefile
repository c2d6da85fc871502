# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) setup.py
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/tfformer demo

test: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) build *.egg-info
