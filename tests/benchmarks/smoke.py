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


def smoke_env(peers):
    """The environment of a smoke run: CPU only, TensorFlow quiet, peers from `peers` (a `peers_dir`)."""
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", TFFORMER_PEERS=peers)


def run_smoke(module, peers):
    """`python -m <module> --smoke` from the repository root, on CPU, with `peers` (a `peers_dir`): its stdout and
    the JSON records it printed. Fails the test on a non-zero exit."""
    out = subprocess.run([sys.executable, "-m", module, "--smoke"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=smoke_env(peers))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
