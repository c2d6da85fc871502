import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.harness import session_directory, session_lock
from tests.training.adam import assert_adam_weights_close
from tfformer import models

WORKER = os.path.join(os.path.dirname(__file__), "replica_worker.py")
# The jobs of this module's tests (replica_worker.py's): {name: (replicas, optimizer, loss projection,
# micro_batches)}, each 3 steps from the same initial weights; one worker process per replica count.
JOBS = {"sgd on 1": (1, "sgd", "fused", 1), "sgd on 2": (2, "sgd", "fused", 1),
        "sgd unfused on 1": (1, "sgd", "unfused", 1), "sgd on 2 in 3 micro-batches": (2, "sgd", "fused", 3),
        "adam on 1": (1, "adam", "fused", 1), "fused_adam on 2": (2, "fused_adam", "fused", 1)}


def _run(replicas, *jobs):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, WORKER, str(replicas), *[json.dumps(list(map(str, job))) for job in jobs]],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`{"init": path, name: path}`: the initial weights and each of JOBS' weights after its steps (its `evaluate`
    results at `<path>.evaluate.json`). Made once per session: `make test`'s first run hands tests out with
    `--dist load`, which can split this module over both xdist workers, and each would otherwise train every job
    again; the first to arrive trains, under `session_lock` in the directory the session's workers share
    (as tests/conftest.py's `one_at_a_time`), and the other reads its files."""
    directory = session_directory(tmp_path_factory) / "distributed-replicas"
    paths = {name: directory / f"{name.replace(' ', '_')}.weights.h5" for name in ["init", *JOBS]}
    with session_lock(tmp_path_factory, "distributed-replicas.lock"):
        if not (directory / "done").exists():
            directory.mkdir(exist_ok=True)
            for replicas in (1, 2):
                first = [("-", paths["init"])] if replicas == 1 else []
                _run(replicas, *first, *[(paths["init"], paths[name], *job[1:]) for name, job in JOBS.items()
                                         if job[0] == replicas])
            (directory / "done").touch()
    return paths


def _weights(path):
    config = models.TransformerConfig(vocabulary_size=30, hidden_dim=16, num_heads=2, intermediate_dim=32,
                                      num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
    model = models.build_seq2seq(config)
    model.load_weights(path)
    return model.get_weights()


def test_two_replicas_equal_one_replica(trained):
    """Same initial weights, same global batch with padding, plain SGD: 3 steps on 2 replicas == on 1."""
    init, one, two = trained["init"], trained["sgd on 1"], trained["sgd on 2"]
    start, w1, w2 = _weights(init), _weights(one), _weights(two)
    assert any(not np.allclose(a, b) for a, b in zip(start, w1)), "training did not move the weights"
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_fused_projection_on_two_replicas_equals_unfused_on_one(trained):
    """The model's fused projection + loss step (its own loss reduction, scaled by 1/replicas as Keras scales a
    loss) on 2 replicas == Keras' unfused step on 1: 3 SGD steps, padding spread unevenly over the replicas.
    Also with `micro_batches=3`: each replica's 4 examples in parts of 1, 1 and 2."""
    init, fused, unfused = trained["init"], trained["sgd on 2"], trained["sgd unfused on 1"]
    split = trained["sgd on 2 in 3 micro-batches"]
    start, w1, w2 = _weights(init), _weights(fused), _weights(unfused)
    assert any(not np.allclose(a, b) for a, b in zip(start, w1)), "training did not move the weights"
    for fused_weights in (w1, _weights(split)):
        for a, b in zip(fused_weights, w2):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # Evaluation in 3 parts per replica (of 1, 1 and 2 examples) reports the whole batch's loss and metrics.
    results = {path: json.loads(open(f"{path}.evaluate.json").read()) for path in (fused, split, unfused)}
    assert results[split].keys() == results[unfused].keys() and results[unfused]["loss"] > 0
    for key, value in results[unfused].items():
        np.testing.assert_allclose(results[split][key], value, rtol=1e-4)
        np.testing.assert_allclose(results[fused][key], value, rtol=1e-4)


def test_fused_adam_on_two_replicas_equals_keras_adam_on_one(trained):
    """FusedAdam's ResourceApplyAdam on mirrored variables and slots: 3 steps on 2 replicas == Keras' Adam on 1."""
    init, ours, theirs = trained["init"], trained["fused_adam on 2"], trained["adam on 1"]
    start, w1, w2 = _weights(init), _weights(ours), _weights(theirs)
    assert any(not np.allclose(a, b) for a, b in zip(start, w1)), "training did not move the weights"
    config = models.TransformerConfig(vocabulary_size=30, hidden_dim=16, num_heads=2, intermediate_dim=32,
                                      num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
    paths = [w.path for w in models.build_seq2seq(config).weights]
    for path, a, b in zip(paths, w1, w2):
        # 3 steps of lr 0.01
        assert_adam_weights_close(path, a, b, hidden_dim=16, max_drift=3 * 0.01, rtol=1e-7, atol=1e-5)
