import math

import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import FeedForward


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
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
    else:
        gate, up = h[..., :16], h[..., 16:]
        h = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(out, h @ w2 + b2, atol=1e-5)
    assert out.shape == (2, 3, 6)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
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


@pytest.mark.parametrize("activation", ["relu", "gelu"])
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
    hidden = keras.ops.relu(hidden) if activation == "relu" else keras.ops.gelu(hidden, approximate=False)
    expected = np.asarray(layer.output_dense(hidden))
    np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(layer(x, training=True)), expected, rtol=1e-5, atol=1e-5)


def test_harness(rng):
    check_layer(FeedForward, dict(hidden_dim=8, intermediate_dim=16, activation="swiglu", dropout=0.1),
                {"inputs": rng.normal(size=(2, 3, 8)).astype("float32")}, expected_output_shape=(2, 3, 8))


def test_bad_activation():
    with pytest.raises(ValueError, match="activation.*relu"):
        FeedForward(8, 16, activation="tanh")
