import json
import os
import socket
import subprocess
import sys

import numpy as np

from tests.layers.test_dropout import numpy_keep

WORKER = os.path.join(os.path.dirname(__file__), "multiworker_worker.py")


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_workers_end_with_identical_weights_and_draw_different_dropout_masks(tmp_path):
    """MultiWorkerMirroredStrategy, two processes on 127.0.0.1: Keras' fit can't, our loop trains one epoch (dropout
    0.1) and both workers end with the same weights. Each worker's Dropout mask is the hash under seed[0] +
    worker index * key (one replica per worker): the workers' examples get different masks."""
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path / f"w{index}.npz")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    w0, w1 = np.load(tmp_path / "w0.npz"), np.load(tmp_path / "w1.npz")
    weights = [key for key in w0.files if key.startswith("arr_")]
    assert len(weights) == len([key for key in w1.files if key.startswith("arr_")]) > 0
    for key in weights:
        np.testing.assert_array_equal(w0[key], w1[key])
    np.testing.assert_array_equal(w0["seed"], w1["seed"])
    assert not np.array_equal(w0["mask"], w1["mask"])
    for index, result in enumerate((w0, w1)):  # one replica per worker: replica id = worker index
        expected = numpy_keep(result["mask"].size, w0["seed"], 0.5, replica=index)
        np.testing.assert_array_equal(result["mask"].reshape(-1), expected)
