"""Each function of tfformer.compat against the installed Keras/TensorFlow: these fail when an upgrade moves
what they reach."""

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
