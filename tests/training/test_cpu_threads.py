"""`training.configure_cpu_threads`: TensorFlow's intra-op threads per micro-batch, set before the runtime starts."""

import os

import pytest
import tensorflow as tf

from tests.harness import run_in_fresh_interpreter
from tfformer import training


def test_sets_intra_op_threads_before_the_runtime_starts_and_refuses_after():
    result = run_in_fresh_interpreter("""
        import json
        import numpy as np
        import tensorflow as tf
        from tfformer import models, training

        threads = training.configure_cpu_threads(2)
        again = training.configure_cpu_threads(2)  # the same count again: nothing to change
        # A model trains in the configured process (two micro-batches, as the setting is meant for).
        config = models.TransformerConfig(vocabulary_size=30, hidden_dim=16, num_heads=2, intermediate_dim=32,
                                          num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
        model = models.build_seq2seq(config)
        model.compile(optimizer="adam", loss=training.MaskedSparseCrossEntropy(0.0), micro_batches=2)
        ids = np.random.default_rng(0).integers(1, 30, (4, 6)).astype("int32")
        loss = float(model.train_on_batch({"encoder_token_ids": ids, "decoder_token_ids": ids}, ids))
        try:
            training.configure_cpu_threads(1)
            error = None
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"threads": threads, "again": again, "loss": loss, "error": error,
                          "tf": tf.config.threading.get_intra_op_parallelism_threads()}))
        """)
    cores = len(os.sched_getaffinity(0))
    assert result["threads"] == result["again"] == result["tf"] == max(1, cores // 2)
    assert 0 < result["loss"] < 10
    # After the runtime started, another count is refused with what to do instead; nothing changed.
    if max(1, cores // 2) != cores:
        assert "configure_cpu_threads(micro_batches=1, replicas=1) must run before TensorFlow" in result["error"]
        assert f"TF_NUM_INTRAOP_THREADS={cores}" in result["error"]


@pytest.mark.parametrize("micro_batches, replicas", [(1, 1), (4, 1), (1, 2), (2, 2)])
def test_thread_count_is_the_cores_per_part(micro_batches, replicas):
    result = run_in_fresh_interpreter(f"""
        import json
        import tensorflow as tf
        from tfformer import training

        threads = training.configure_cpu_threads({micro_batches}, replicas={replicas})
        print(json.dumps({{"threads": threads, "tf": tf.config.threading.get_intra_op_parallelism_threads()}}))
        """)
    cores = len(os.sched_getaffinity(0))
    assert result["threads"] == result["tf"] == max(1, cores // (micro_batches * replicas))


@pytest.mark.parametrize("arguments, message", [
    ({"micro_batches": 0}, "`micro_batches` must be an int >= 1. Received: micro_batches=0"),
    ({"micro_batches": 2.0}, "`micro_batches` must be an int >= 1. Received: micro_batches=2.0"),
    ({"micro_batches": True}, "`micro_batches` must be an int >= 1. Received: micro_batches=True"),
    ({"micro_batches": 2, "replicas": 0}, "`replicas` must be an int >= 1. Received: replicas=0"),
    ({"micro_batches": 2, "replicas": None}, "`replicas` must be an int >= 1. Received: replicas=None"),
])
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        training.configure_cpu_threads(**arguments)


def test_gpus_visible_leaves_threads_alone(monkeypatch):
    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: ["GPU:0"] if kind == "GPU" else real(kind))

    def refuse(threads):
        raise AssertionError(f"set_intra_op_parallelism_threads({threads}) called with a GPU visible")

    monkeypatch.setattr(tf.config.threading, "set_intra_op_parallelism_threads", refuse)
    assert training.configure_cpu_threads(2) is None
