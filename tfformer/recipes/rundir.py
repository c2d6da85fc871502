"""The run directory: what a training run writes, and the rule that nothing is overwritten silently."""

import json
import os
import shutil

from tfformer import models
from tfformer.checks import check_int
from tfformer.files import write_json  # noqa: F401 (the recipes' rundir.write_json)

FINISHED_MARKER = "metrics.json"


def prepare(path, overwrite=False):
    """Create `path` for a new run, or return 'resume' for an interrupted one.

    A finished run (it has metrics.json) or a folder with unrelated files is
    never touched unless `overwrite` is set; an interrupted run (it has a
    backup/ and no metrics.json) is resumed.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"Run directory {path!r} exists and is a file.")
    if os.path.isdir(path) and os.listdir(path):
        if overwrite:
            shutil.rmtree(path)
        elif os.path.isdir(os.path.join(path, "backup")) and not os.path.exists(os.path.join(path, FINISHED_MARKER)):
            return "resume"
        else:
            raise ValueError(f"Run directory {path!r} already holds a run; pass --overwrite to replace it, or choose "
                             "--out.")
    os.makedirs(path, exist_ok=True)
    return "new"


def begin(out, overwrite=False, replicas=None, mixed_precision=False, seed=0):
    """Start (or resume) a run in `out`: returns `(state, strategy, dtype)` with the seeds set; `dtype` is the
    run's dtype policy, the mixed one (`training.mixed_precision_policy()`) or "float32", for the recipe to give
    its model. The global dtype policy is left alone.
    """
    import keras

    from tfformer import training

    state = prepare(out, overwrite=overwrite)
    strategy = training.get_strategy(replicas)
    keras.utils.set_random_seed(seed)
    dtype = keras.DTypePolicy(training.mixed_precision_policy() if mixed_precision else "float32")
    return state, strategy, dtype


def check_options(replicas, **positive):
    """A ValueError naming the first bad one of a recipe's options, before its run begins: `replicas` a positive
    integer or None, each of `positive` a positive integer."""
    check_int("replicas", replicas, allow_none=True)
    for name, value in positive.items():
        check_int(name, value)


def preset_config(preset, architecture, task, vocabulary_size, length, overrides):
    """The run's config: `preset` with `overrides`, at least 64 positions and `vocabulary_size` (until the run's
    tokenizer gives its own); a ValueError unless it is a valid config of `architecture`. Made before a run
    begins, so that a bad one writes nothing."""
    config = models.get_preset(preset, vocabulary_size=vocabulary_size, max_sequence_length=max(length, 64),
                               **overrides)
    if config.architecture != architecture:
        raise ValueError(f"{task} needs a {architecture} preset; {preset!r} is {config.architecture!r}.")
    return config


def read_json(path):
    with open(path) as handle:
        return json.load(handle)
