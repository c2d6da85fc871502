"""`python -m benchmarks.lm_perplexity --smoke` runs (tiny model, 150 steps; the numbers mean little)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks import lm_perplexity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_lm_perplexity_smoke(tmp_path, capsys):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "benchmarks.lm_perplexity", "--smoke", "--out", str(tmp_path / "run")]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = {r["system"]: r for r in records if r["bench"] != "goal"}
    assert set(rows) == {"tfformer float32", "tfformer bfloat16", "keras-hub float32 (recipe schedule)",
                         "keras-hub float32 (keras.io)"}
    vocabulary = lm_perplexity.SMOKE["vocabulary_size"]
    for row in rows.values():
        # Trained models beat the uniform guess (perplexity = the vocabulary size) on held-out text.
        assert 1 < row["test_perplexity"] < 0.5 * vocabulary, row
        assert row["steps"] > 10 and row["parameters"] > 0
        if row["system"].startswith("tfformer"):
            assert row["steps"] == lm_perplexity.SMOKE["max_steps"], row  # its 2-minute budget is a ceiling
        # The systems run one after another: the machine's matmul limits right before and after each.
        assert row["bench"] == "lm_perplexity" and set(row["matmul_limit_gflops"]) == {"float32", "bfloat16"}, row
        assert all(len(pair) == 2 and min(pair) > 0 for pair in row["matmul_limit_gflops"].values()), row
    for system in ("tfformer float32", "tfformer bfloat16"):
        # The saved model, evaluated by the benchmark's loop, gives what the recipe's `evaluate` reported.
        assert rows[system]["test_perplexity"] == pytest.approx(rows[system]["recipe_test_perplexity"], rel=1e-3)
    # keras-hub trains tfformer float32's fit time, to one step, unless it needs longer for its floor of steps
    # (a loaded machine can spend seconds tracing).
    budget, floor = rows["tfformer float32"]["train_seconds"], lm_perplexity.SMOKE["min_baseline_steps"]
    for system in ("keras-hub float32 (recipe schedule)", "keras-hub float32 (keras.io)"):
        theirs = rows[system]
        assert budget - 0.5 <= theirs["train_seconds"], (budget, theirs)
        assert theirs["train_seconds"] <= budget + 5 or theirs["steps"] == floor, (budget, theirs)
    assert rows["tfformer bfloat16"]["same_vocabulary"] is True  # both tfformer runs learned the same file
    assert "| system | test perplexity |" in out.stdout
    # The goal lines: each tfformer run's perplexity over the better keras-hub run's.
    best = min(rows[system]["test_perplexity"]
               for system in ("keras-hub float32 (recipe schedule)", "keras-hub float32 (keras.io)"))
    goals = {r["goal"]: r for r in records if r["bench"] == "goal"}
    assert len(goals) == 2
    for system in ("tfformer float32", "tfformer bfloat16"):
        r = goals[f"lm_perplexity {system} test perplexity <= 1x keras-hub float32's (same budget)"]
        assert r["value"] == pytest.approx(rows[system]["test_perplexity"] / best, rel=1e-3)
        assert r["met"] == (r["value"] <= 1) and rows[r["rows"][1]]["test_perplexity"] == best
    # An existing run is replaced only with --overwrite: the same command stops at its arguments (run here, in
    # `main`: no fresh interpreter importing TensorFlow and keras-hub to see it).
    capsys.readouterr()
    with pytest.raises(SystemExit) as again:
        lm_perplexity.main(command[3:])
    assert again.value.code != 0 and "already holds a run; pass --overwrite" in capsys.readouterr().err


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    vocabulary = 37
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    zeros = keras.layers.Lambda(lambda t: tf.zeros(tf.concat([tf.shape(t), [vocabulary]], 0)))(token_ids)
    model = keras.Model({"token_ids": token_ids}, zeros)
    labels = np.random.default_rng(0).integers(1, vocabulary, (5, 7))
    dataset = tf.data.Dataset.from_tensor_slices(({"token_ids": labels}, labels)).batch(2)
    assert lm_perplexity.perplexity_on(model, dataset) == pytest.approx(vocabulary, rel=1e-5)
