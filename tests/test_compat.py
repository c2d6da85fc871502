"""Each function of tfformer.compat against the installed Keras/TensorFlow: these fail when an upgrade moves
what they reach."""

import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

from tfformer import compat


def test_gradient_recording_sees_a_tape_and_only_a_tape():
    assert compat.gradient_recording() is False
    with tf.GradientTape():
        assert compat.gradient_recording() is True
    seen = []

    @tf.function
    def traced(x):
        seen.append(compat.gradient_recording())
        return x

    traced(tf.constant(1.0))
    assert seen == [False]


def test_onednn_enabled_is_what_the_command_environment_asked_for():
    """In a fresh process (TensorFlow reads the setting once): on as `tfformer transcribe` sets it up, off when the
    user said so, whatever TensorFlow would choose for this CPU."""
    script = ("import tfformer_command; tfformer_command.tensorflow_environment(['transcribe']); "
              "from tfformer import compat; print(compat.onednn_enabled())")
    for user, expected in ((None, "True"), ("0", "False")):
        env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
        env.update({} if user is None else {"TF_ENABLE_ONEDNN_OPTS": user})
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env=dict(env, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3"))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == expected


def test_optimization_barrier_passes_tensors_through_under_xla():
    @tf.function(jit_compile=True)
    def f(a, b):
        a, b = compat.optimization_barrier(a, b)
        return a + 1, b * 2

    a, b = f(tf.constant([1.0, 2.0]), tf.constant(3, tf.int32))
    np.testing.assert_array_equal(a.numpy(), [2.0, 3.0])
    assert int(b) == 6


def test_flatten_layers_walks_nested_layers_outer_first():
    inner = keras.layers.Dense(3, name="inner")
    outer = keras.Sequential([keras.Input((2,)), inner], name="outer")
    names = [layer.name for layer in compat.flatten_layers(outer)]
    assert names[0] == "outer" and "inner" in names and len(names) == len(set(names))


def test_keras_mask_is_what_a_masking_layer_attached():
    ids = tf.constant([[3, 0]])
    masked = keras.layers.Embedding(5, 2, mask_zero=True)(ids)
    np.testing.assert_array_equal(compat.keras_mask(masked).numpy(), [[True, False]])
    assert compat.keras_mask(keras.layers.Embedding(5, 2)(ids)) is None
    assert compat.keras_mask(ids) is None


def test_optimizer_variable_index_finds_the_variable_update_step_gets():
    variables = [keras.Variable(np.zeros(2, "float32")), keras.Variable(np.zeros(3, "float32"))]

    class Recording(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            seen.append((compat.optimizer_variable_index(self, variable), tuple(variable.shape)))
            return super().update_step(gradient, variable, learning_rate)

    for run in (lambda f: f(), lambda f: tf.function(f)()):
        seen = []
        optimizer = Recording(0.1)
        optimizer.build(variables)
        run(lambda: optimizer.apply([tf.ones(2), tf.ones(3)], variables))
        assert sorted(seen) == [(0, (2,)), (1, (3,))], seen


def test_begin_training_returns_the_epoch_backup_and_restore_restored(tmp_path):
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 1), "float32")
    backup = str(tmp_path / "backup")

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt  # a kill after the second epoch's backup

    try:
        model.fit(x, x, epochs=5, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), Stop()])
    except KeyboardInterrupt:
        pass
    callbacks = keras.callbacks.CallbackList([keras.callbacks.BackupAndRestore(backup)], model=model)
    assert compat.begin_training(callbacks, model) == 2
    empty = keras.callbacks.CallbackList([keras.callbacks.BackupAndRestore(str(tmp_path / "none"))], model=model)
    assert compat.begin_training(empty, model) == 0  # not the previous run's epoch


def test_collection_paused_is_needed_and_spares_old_objects(monkeypatch):
    """Keras still collects garbage when a layer's variable is deleted (else the pause can go), and inside the
    block a collection leaves the objects that existed before it alone."""
    import gc

    class WithWeight(keras.layers.Layer):
        def build(self, input_shape):
            self.extra = self.add_weight(shape=(2,), name="extra")

    layer = WithWeight()
    layer.build((None, 3))
    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or collect(*a))
    del layer.extra
    assert calls, "Keras no longer runs gc.collect() when a variable is deleted: compat.collection_paused can go"
    monkeypatch.undo()

    class Node:
        pass

    old = Node()
    old.self = old  # a cycle: only the collector frees it
    ref = __import__("weakref").ref(old)
    del old
    with compat.collection_paused():
        gc.collect()
        assert ref() is not None  # frozen: not collected inside the block
    gc.collect()
    assert ref() is None


def test_untracked_fields_are_not_the_layers_weights_metrics_or_saved_functions(tmp_path):
    other = keras.layers.Dense(4)
    other.build((None, 2))
    function = tf.function(lambda x: other(x), input_signature=[tf.TensorSpec((1, 2))])
    host, tracking = keras.layers.Layer(), keras.layers.Layer()
    host.holder = compat.Untracked(layer=other, metric=keras.metrics.Mean(), weights=[other.kernel], function=function)
    tracking.layers, tracking.function = [other], function  # set on a layer itself, they are its own: can fail
    assert host.weights == [] and host.metrics == [] and len(tracking.weights) == 2
    tf.saved_model.save(host, str(tmp_path / "host"))
    tf.saved_model.save(tracking, str(tmp_path / "tracking"))
    assert not hasattr(tf.saved_model.load(str(tmp_path / "host")), "holder")
    assert hasattr(tf.saved_model.load(str(tmp_path / "tracking")), "function")
    assert host.holder.function(tf.ones((1, 2))).shape == (1, 4)


def test_untracked_holder_is_made_once_and_not_tracked():
    host = keras.layers.Dense(2)
    holder = compat.untracked_holder(host, "functions")
    holder.kernel = keras.Variable(np.zeros(3, "float32"))
    assert compat.untracked_holder(host, "functions") is holder and host.weights == []
