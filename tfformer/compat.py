"""The only place tfformer touches non-public Keras or TensorFlow APIs.

Each need that has no public API is one small function here, with the reason. `tests/test_compat.py` checks each
one against the installed Keras/TensorFlow, so that an upgrade that changes what they reach fails loudly there,
not as a wrong number elsewhere. Nothing else in `tfformer/` imports `keras.src`, `tensorflow.python` or
`tensorflow.compiler` (`tests/test_public_api.py` walks the package with `ast` to enforce it).
"""

import contextlib
import gc
import types


def gradient_recording():
    """Whether a `tf.GradientTape` could record the ops built now (a training step, not inference or export).

    Why: hand-written gradients (`tf.custom_gradient`) are worth building only then; in inference graphs their
    IdentityN ops sit between ops that grappler fuses. TensorFlow has no public way to ask whether a tape is
    active (`tf.autodiff` exposes tapes, not whether one is recording).
    """
    from tensorflow.python.eager import record  # no public equivalent

    return bool(record.could_possibly_record())


def onednn_enabled():
    """Whether TensorFlow runs its oneDNN kernels in this process: `TF_ENABLE_ONEDNN_OPTS` as the process started,
    else TensorFlow's choice by CPU (on with AVX-512 VNNI or BF16 or AMX).

    Why: a benchmark row says which CPU kernels its time comes from (`tfformer transcribe` turns oneDNN on,
    `tfformer_command`); TensorFlow has no public way to ask.
    """
    from tensorflow.python.util import _pywrap_util_port  # no public equivalent

    return bool(_pywrap_util_port.IsMklEnabled())


def optimization_barrier(*tensors):
    """XLA's OptimizationBarrier on `tensors`: they come out unchanged, but XLA may not move work across it.

    Why: a decode loop carries loop-invariant narrow (bfloat16) weights through it, so that XLA does not hoist
    their conversion to float32 out of the loop. TensorFlow exposes the op only under `tensorflow.compiler`.
    """
    from tensorflow.compiler.tf2xla.python import xla  # no public name

    return tuple(xla.optimization_barrier(*tensors))


def flatten_layers(layer):
    """`layer` and every layer nested in it, outer first, each once.

    Why: a model's nested layers (a block's attention, its feed-forward's Dense) are reachable only through
    Keras' private `_flatten_layers`; `Model.layers` lists one level.
    """
    return list(layer._flatten_layers(include_self=True, recursive=True))


def keras_mask(tensor):
    """The Keras mask a layer attached to `tensor` (what a loss would weight it by), or None.

    Why: the fused projection + loss must refuse hidden states that carry a mask, since it would not apply it;
    Keras keeps a tensor's mask in the private `_keras_mask` attribute and exports no getter.
    """
    return getattr(tensor, "_keras_mask", None)


def optimizer_variable_index(optimizer, variable):
    """The position of `variable` in the list `optimizer.build` got, for a variable as `update_step` receives it.

    Why: `update_step` gets the backend variable (under `tf.distribute`, one replica's component of it), and a
    custom optimizer needs its slots for that variable; Keras maps it back with the private
    `_get_variable_index` (which its own custom-optimizer example uses) and has no public lookup.
    """
    return optimizer._get_variable_index(variable)


def begin_training(callbacks, model):
    """Run `callbacks.on_train_begin()` (a `keras.callbacks.CallbackList`) and return the epoch to start at.

    Why: a training loop of our own that drives Keras callbacks must start where `keras.callbacks.BackupAndRestore`
    restored a run; the callback hands that epoch to `fit` through the model's private `_initial_epoch`, and
    Keras has no public way to read it.
    """
    model._initial_epoch = None  # fit leaves it set after a restore: not this run's
    callbacks.on_train_begin()
    return model._initial_epoch or 0


@contextlib.contextmanager
def collection_paused():
    """A block in which `gc.collect()` skips every object that existed when it began (`gc.freeze`).

    Why: Keras' `Layer.__delattr__` runs a full `gc.collect()` after each variable deleted from a layer, so
    deleting many (the low-rank adapters a merge removes) on a large heap takes minutes; Keras has no public way
    to delete a variable without it.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Untracked(types.SimpleNamespace):
    """Named fields kept on a layer or model out of sight of Keras' and TensorFlow's attribute tracking.

    Keras tracks what is set on a layer when it is a layer, a variable, a metric, a list, a dict or a tuple, and
    TensorFlow's SavedModel saves a layer's `tf.function` attributes; a plain object holding them is neither, so
    `model.holder = Untracked(function=f, metrics=[...])` is not saved with the model, and its weights, metrics
    and functions are not counted as the model's own. The tracking rules are Keras' and TensorFlow's, not a
    public contract: `tests/test_compat.py` checks them.
    """


def untracked_holder(owner, name):
    """The `Untracked` that `owner` (a layer or model) holds under `name`, made empty the first time: state that a
    module outside the layer's class keeps on it (e.g. the generate functions of a model), out of Keras' sight."""
    attribute = f"_tfformer_{name}"
    holder = getattr(owner, attribute, None)
    if holder is None:
        holder = Untracked()
        setattr(owner, attribute, holder)
    return holder
