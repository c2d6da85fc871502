"""The benchmark runner must not rot: its smoke mode runs in CI (numbers are meaningless there)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_runner_smoke():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "benchmarks", "run", "training", "generation", "tflite", "--smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    benches = {r["bench"] for r in records}
    assert {"train_seq2seq", "train_lm", "generation", "generation_ratio", "per_token", "per_token_ratio",
            "latency_batch1"} <= benches
    for r in records:  # every ratio comes with its per-round (median, min, max)
        if r["bench"] in ("generation_ratio", "per_token_ratio"):
            median, low, high = r["per_round"]
            assert low <= median <= high
    assert "over rounds" in out.stdout
    assert all(r.get("tokens_per_s", 1) > 0 for r in records)
    assert "| system |" in out.stdout or "| bench |" in out.stdout
