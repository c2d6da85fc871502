"""Runs a benchmark workload in smoke mode, as the smoke tests do."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_smoke(module):
    """`python -m <module> --smoke` from the repository root, on CPU: its stdout and the JSON records it printed.
    Fails the test on a non-zero exit."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", module, "--smoke"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
