"""Pick the tf.distribute strategy for this machine."""

import json
import os

import tensorflow as tf


def get_strategy(replicas=None):
    """The strategy `model.fit` should run under.

    - `TF_CONFIG` set with more than one worker: `MultiWorkerMirroredStrategy`.
    - GPUs present: `MirroredStrategy` over all of them (or the first `replicas`).
    - `replicas=N` on a CPU machine: `MirroredStrategy` over N logical CPU
      devices (how the tests exercise data parallelism). This must run before
      TensorFlow initialises its devices, i.e. before any tensor is created.
    - otherwise the default (no-op) strategy.
    """
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"`replicas` must be a positive integer or None. Received: replicas={replicas!r}")
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    workers = tf_config.get("cluster", {}).get("worker", [])
    if len(workers) > 1:
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        names = [f"/gpu:{i}" for i in range(len(gpus))][: replicas or len(gpus)]
        return tf.distribute.MirroredStrategy(names)
    if replicas and replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        configured = tf.config.get_logical_device_configuration(cpu) or []
        if len(configured) < replicas:
            try:
                # Listing logical devices would initialise the runtime, so only configure here.
                tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
            except RuntimeError as error:
                raise RuntimeError(
                    f"get_strategy(replicas={replicas}) must be called before TensorFlow creates any tensor "
                    f"(it splits the CPU into {replicas} logical devices): {error}"
                ) from error
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    return tf.distribute.get_strategy()


def mixed_precision_policy():
    """`mixed_float16` on GPU (with loss scaling by Keras), `mixed_bfloat16` on CPU."""
    return "mixed_float16" if tf.config.list_physical_devices("GPU") else "mixed_bfloat16"
