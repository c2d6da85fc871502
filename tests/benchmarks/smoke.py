"""Runs a benchmark workload in smoke mode, as the smoke tests do, with no peers or with stand-ins for them."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_in_peer.py")
PEERS = ("none", "stand-in", "installed")  # what a smoke test runs against: `peers_dir`'s kinds


def peers_dir(kind, directory):
    """A peers directory for `TFFORMER_PEERS` (`benchmarks.peers`): for "none", an empty `directory`; for
    "stand-in", `directory` with `bin/python`, `bin/llama-bench` and `bin/llama-perplexity` that run
    `stand_in_peer.py`; for "installed",
    the clone's own `.venv-peers` (`make peers`), real PyTorch, faster-whisper and llama.cpp."""
    from benchmarks import peers

    if kind not in PEERS:
        raise ValueError(f"kind must be one of {PEERS}, got {kind!r}")
    if kind == "installed":
        return peers.DEFAULT_DIR
    os.makedirs(directory)
    if kind == "stand-in":
        os.makedirs(os.path.join(directory, "bin"))
        for role in ("python", "llama-bench", "llama-perplexity"):
            path = os.path.join(directory, "bin", role)
            with open(path, "w") as f:
                f.write(f'#!/bin/sh\nexec "{sys.executable}" "{STAND_IN}" {role} "$@"\n')
            os.chmod(path, 0o755)
    return str(directory)


def light_xla_flags():
    """`XLA_FLAGS` with XLA's LLVM backend at -O0, as the Makefile's first run, for smoke runs whose tiny models
    compile more than they run. Measured on an Intel Xeon (model 207, 2 cores), one test at a time: the runner's
    smoke 127 -> 115 s, warmup 66 -> 57 s, translation_bleu 56 -> 48 s, llm 44 -> 36 s. The others keep XLA's
    default: asr's Whisper loops took 60 s against 48 s, and lm_perplexity, serving and encoder did not change."""
    return " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))


def smoke_env(peers=None, light_xla=False):
    """The environment of a smoke run: CPU only, TensorFlow quiet, peers from `peers` (a `peers_dir`; None: this
    process's `TFFORMER_PEERS`, if any, for a run without peers); with `light_xla`, `light_xla_flags()`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    if peers is not None:
        env["TFFORMER_PEERS"] = peers
    if light_xla:
        env["XLA_FLAGS"] = light_xla_flags()
    return env


def run_smoke(module, peers, light_xla=False):
    """`python -m <module> --smoke` from the repository root, on CPU, with `peers` (a `peers_dir`) and
    `smoke_env`'s `light_xla`, in the environment the runner gives its workload (`workload_environment`): its stdout
    and the JSON records it printed. Fails the test on a non-zero exit."""
    from benchmarks.__main__ import WORKLOADS, workload_environment

    name = {module_name: name for name, module_name in WORKLOADS.items()}[module]
    out = subprocess.run([sys.executable, "-m", module, "--smoke"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=workload_environment(name, smoke_env(peers, light_xla)))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
