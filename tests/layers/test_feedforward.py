import math

import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import FeedForward


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


def _gelu_tanh(x):
    """GPT-2's GELU (Hendrycks & Gimpel's tanh approximation), as OpenAI's GPT-2 code writes it."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_approximate", "swiglu"])
def test_matches_numpy(rng, activation):
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    layer = FeedForward(hidden_dim=6, intermediate_dim=16, activation=activation)
    out = np.asarray(layer(x))
    w1, b1 = layer.intermediate_dense.kernel.numpy(), layer.intermediate_dense.bias.numpy()
    w2, b2 = layer.output_dense.kernel.numpy(), layer.output_dense.bias.numpy()
    h = x @ w1 + b1
    if activation == "relu":
        h = np.maximum(h, 0)
    elif activation == "gelu":
        h = _gelu(h)
    elif activation == "gelu_approximate":
        h = _gelu_tanh(h)
    else:
        gate, up = h[..., :16], h[..., 16:]
        h = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(out, h @ w2 + b2, atol=1e-5)
    assert out.shape == (2, 3, 6)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_approximate", "swiglu"])
def test_training_gradients_match_keras_dense(rng, activation):
    """Training mode (dropout 0) under a tape: output and gradients equal those of the same weights in
    keras.layers.Dense layers, and the step has no BiasAddGrad (the biases' gradients are matmuls)."""
    import keras
    import tensorflow as tf

    x = rng.normal(size=(2, 3, 8)).astype("float32")
    dy = rng.normal(size=(2, 3, 6)).astype("float32")
    layer = FeedForward(hidden_dim=6, intermediate_dim=16, activation=activation)
    layer(x)
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])  # non-zero biases
    first, second = keras.layers.Dense(layer.intermediate_dense.units), keras.layers.Dense(6)
    first.build(x.shape), second.build((2, 3, 16))
    first.set_weights(layer.intermediate_dense.get_weights()), second.set_weights(layer.output_dense.get_weights())
    act = {"relu": tf.nn.relu, "gelu": lambda h: tf.nn.gelu(h, approximate=False),
           "gelu_approximate": lambda h: tf.nn.gelu(h, approximate=True),
           "swiglu": lambda h: tf.nn.silu(h[..., :16]) * h[..., 16:]}[activation]

    def grads(forward, weights):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = forward(x)
            return [y] + tape.gradient(y, [w.value for w in weights], output_gradients=dy)
        return step

    ours = grads(lambda x: layer(x, training=True), layer.trainable_weights)
    ref = grads(lambda x: second(act(first(x))), first.trainable_weights + second.trainable_weights)
    for got, want in zip(ours(x), ref(x)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    kinds = [n.op for n in ours.get_concrete_function(x).graph.as_graph_def().node]
    assert "BiasAddGrad" not in kinds and kinds.count("BiasAdd") == 2


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_approximate"])
def test_quantized_dense_layers_run_their_own_call(rng, activation):
    """After `quantize("int8")` the kernels are int8 with separate scales: inference must not read them as weights
    (the fused fast path did, with errors of ~1e5); it matches the quantized layers' own chain, as training does."""
    import keras

    x = rng.normal(size=(2, 3, 8)).astype("float32")
    layer = FeedForward(hidden_dim=8, intermediate_dim=16, activation=activation)
    layer(x)
    layer.intermediate_dense.quantize("int8")
    layer.output_dense.quantize("int8")
    hidden = layer.intermediate_dense(x)
    if activation == "relu":
        hidden = keras.ops.relu(hidden)
    else:
        hidden = keras.ops.gelu(hidden, approximate=activation == "gelu_approximate")
    expected = np.asarray(layer.output_dense(hidden))
    np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(layer(x, training=True)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, rtol", [("float32", 2e-6), ("bfloat16", 8e-3)])
def test_tanh_gelu_and_its_gradient_equal_float64_math(dtype, rtol):
    """The training path's `x sigmoid(...)` form and its hand-written gradient against the tanh formula and its
    derivative in float64, over the whole range: saturated ends (s = 0 or 1), huge inputs (where x^2 overflows
    float32) and zero. bfloat16: inputs representable in it, one rounding of the result (2^-8 relative)."""
    import tensorflow as tf

    from tfformer.layers.feedforward import _gelu_approximate_with_gradient

    x = np.concatenate([np.linspace(-12, 12, 4801), [0.0, -40.0, 40.0, -1e20, 1e20, 3e38]])
    x = np.asarray(tf.cast(tf.cast(x, dtype), tf.float64))  # the values the dtype holds
    dy = np.linspace(0.5, 1.5, x.size)
    c, a = np.sqrt(2 / np.pi), 0.044715
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.tanh(c * (x + a * x**3))
        slope = 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * a * x**2)
    slope = np.where(np.abs(x) > 20, (x > 0).astype(float), slope)  # the limits, where float64 overflows too
    want_y, want_dx = np.where(np.abs(x) > 20, np.maximum(x, 0), _gelu_tanh(np.clip(x, -20, 20))), dy * slope

    inputs, upstream = tf.constant(x, dtype), tf.constant(dy, dtype)
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        y = _gelu_approximate_with_gradient(inputs)
    dx = tape.gradient(y, inputs, output_gradients=upstream)
    assert y.dtype == dx.dtype == tf.as_dtype(dtype)
    got_y, got_dx = (np.asarray(tf.cast(v, tf.float64)) for v in (y, dx))
    assert np.isfinite(got_y).all() and np.isfinite(got_dx).all()
    want_dx = want_dx if dtype == "float32" else np.asarray(tf.cast(tf.cast(dy, dtype), tf.float64)) * slope
    np.testing.assert_allclose(got_y, want_y, rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(got_dx, want_dx, rtol=rtol, atol=1e-6)


def test_gelu_approximate_is_keras_hubs_gpt2_activation(rng):
    """keras-hub's GPT2Backbone builds its feed-forward with `gelu_approximate`: the same function, in inference
    (the fused oneDNN path) and under a tape (the XLA path)."""
    import tensorflow as tf
    from keras_hub.src.utils.keras_utils import gelu_approximate

    x = tf.constant(rng.normal(size=(4, 64)).astype("float32") * 4)
    layer = FeedForward(hidden_dim=64, intermediate_dim=64, activation="gelu_approximate")
    layer(x)
    layer.set_weights([np.eye(64, dtype="float32"), np.zeros(64, "float32"), np.eye(64, dtype="float32"),
                       np.zeros(64, "float32")])
    with tf.GradientTape() as tape:
        tape.watch(x)
        trained = layer(x, training=True)
    for got in (layer(x), trained):
        np.testing.assert_allclose(np.asarray(got), np.asarray(gelu_approximate(x)), rtol=2e-6, atol=1e-6)


def test_harness(rng):
    check_layer(FeedForward, dict(hidden_dim=8, intermediate_dim=16, activation="swiglu", dropout=0.1),
                {"inputs": rng.normal(size=(2, 3, 8)).astype("float32")}, expected_output_shape=(2, 3, 8))


def test_bad_activation():
    with pytest.raises(ValueError, match="activation.*relu"):
        FeedForward(8, 16, activation="tanh")
