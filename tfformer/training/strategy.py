"""Pick the tf.distribute strategy for this machine."""

import json
import os

import tensorflow as tf

from tfformer.checks import check_int
from tfformer.cpu import cpu_cores


def get_strategy(replicas=None):
    """The strategy `model.fit` should run under.

    - `TF_CONFIG` set with more than one worker: `MultiWorkerMirroredStrategy`.
    - GPUs present: `MirroredStrategy` over all of them (or the first `replicas`).
    - `replicas=N` on a CPU machine: `MirroredStrategy` over N logical CPU
      devices (how the tests exercise data parallelism). This must run before
      TensorFlow initialises its devices, i.e. before any tensor is created.
    - otherwise the default (no-op) strategy.
    """
    check_int("replicas", replicas, allow_none=True)
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


def configure_cpu_threads(micro_batches, replicas=1):
    """Give each part of a CPU training step that runs side by side its own share of the cores.

    With `compile(..., micro_batches=k)` (see `models.TransformerModel.compile`) TensorFlow runs the k parts of
    each step at once, and by default every op may use all cores (as many intra-op threads as cores), so two
    parts' matmuls split each core between them. This sets TensorFlow's intra-op threads to
    `max(1, cores // (micro_batches * replicas))` (`replicas`: a CPU `MirroredStrategy`'s, see `get_strategy`),
    so that each part keeps cores of its own. On a 2-core CPU, `micro_batches=2` (one thread per part) makes the
    benchmark's seq2seq and LM training steps faster, float32 and mixed_bfloat16 (docs/performance.md).
    A tfformer model's `evaluate` cuts its batches into the same parts and keeps its speed; what does not cut
    its work runs on fewer cores and slower: prediction, generation, a step with `micro_batches=1`, an uncut
    `evaluate`. So call it in a process that mostly trains, first thing
    (`recipes.language_model.train_lm(cpu_threads=True)` and `tfformer train lm` do).

    It is process-wide and must run before TensorFlow's runtime starts (the first tensor, model or strategy).

    Args:
        micro_batches: int >= 1. The parts of each step, as given to `compile(micro_batches=...)`.
        replicas: int >= 1. Replicas of a CPU `MirroredStrategy` (each runs its own parts). Defaults to 1.

    Returns:
        The intra-op thread count set, or None when GPUs are visible (then nothing is changed: a GPU runs a
        step's kernels one after another, and the CPU's threads only feed it).

    Raises:
        ValueError: `micro_batches` or `replicas` is not an int >= 1.
        RuntimeError: TensorFlow's runtime has already started with another intra-op thread count.
    """
    check_int("micro_batches", micro_batches, expected="an int >= 1")
    check_int("replicas", replicas, expected="an int >= 1")
    if tf.config.list_physical_devices("GPU"):  # lists devices without starting the runtime
        return None
    cores = cpu_cores()
    threads = max(1, cores // (micro_batches * replicas))
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError as error:
        raise RuntimeError(
            f"configure_cpu_threads(micro_batches={micro_batches}, replicas={replicas}) must run before TensorFlow "
            f"creates any tensor, model or strategy (it sets {threads} intra-op thread(s) for {cores} cores), or set "
            f"TF_NUM_INTRAOP_THREADS={threads} in the environment before Python starts: {error}"
        ) from error
    return threads


def mixed_precision_policy():
    """`mixed_float16` on GPU (with loss scaling by Keras), `mixed_bfloat16` on CPU."""
    return "mixed_float16" if tf.config.list_physical_devices("GPU") else "mixed_bfloat16"


def evenly_split(dataset, strategy):
    """A batched `dataset` whose first batch `strategy`'s replicas split evenly. Keras 3.15's `fit` and `evaluate`
    under `MirroredStrategy` reduce the first batch across the replicas before they run (`_maybe_symbolic_build`),
    which fails ("Inputs to operation AddN ... must have the same size") when replicas get different numbers of
    rows: a validation split of 3 rows on 2 replicas, a length bucket of 1 row first, a batch of 7. Such a dataset
    is rebatched in batches of a multiple of the replica count (the largest within its first batch, at least the
    count; padded as a padded batch is, with zeros; every row kept); any other input is returned as it is. A
    dataset that still cannot give every replica a row is a ValueError."""
    replicas = strategy.num_replicas_in_sync
    if replicas == 1 or not isinstance(dataset, tf.data.Dataset):
        return dataset

    def first_rows(data):
        first = next(iter(data.take(1)), None)
        return None if first is None else int(tf.shape(tf.nest.flatten(first)[0])[0])

    rows = first_rows(dataset)
    if rows is None or rows % replicas == 0:
        return dataset
    dataset = dataset.unbatch().padded_batch(max(replicas, rows - rows % replicas))
    rows = first_rows(dataset)
    if rows % replicas:
        raise ValueError(f"The dataset holds {rows} row(s), fewer than the {replicas} replicas that each need one: "
                         "give more validation data or fewer replicas.")
    return dataset
