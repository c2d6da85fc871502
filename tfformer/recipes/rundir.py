"""The run directory: what a training run writes, and the rule that nothing is overwritten silently."""

import functools
import json
import os
import shutil

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
    """Start (or resume) a run in `out`: returns `(state, strategy)` with the dtype policy and seeds set.

    The global dtype policy becomes the mixed one or "float32", whatever an earlier run in the process set; a
    recipe wrapped in `restores_dtype_policy` puts its caller's back when it returns.
    """
    import keras

    from tfformer import training

    state = prepare(out, overwrite=overwrite)
    strategy = training.get_strategy(replicas)
    keras.config.set_dtype_policy(training.mixed_precision_policy() if mixed_precision else "float32")
    keras.utils.set_random_seed(seed)
    return state, strategy


def restores_dtype_policy(recipe):
    """Wrap `recipe` so that the caller's global dtype policy is back when it returns or raises.

    A recipe sets the policy of its run (`begin`); without this, a model built after a `mixed_precision=True`
    run in the same process (a notebook, a benchmark) would silently compute in bfloat16.
    """

    @functools.wraps(recipe)
    def wrapper(*args, **kwargs):
        import keras

        policy = keras.config.dtype_policy()
        try:
            return recipe(*args, **kwargs)
        finally:
            keras.config.set_dtype_policy(policy)

    return wrapper


def read_json(path):
    with open(path) as handle:
        return json.load(handle)
