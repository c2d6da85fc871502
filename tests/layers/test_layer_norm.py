import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import check_layer
from tfformer.layers import LayerNorm


def _numpy_layer_norm(x, gamma, beta, eps):
    x = x.astype("float64")
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def _pair(rng, dim, eps, policy="float32", **kwargs):
    """A LayerNorm and a keras.layers.LayerNormalization with the same random gamma and beta."""
    ours = LayerNorm(epsilon=eps, dtype=policy, **kwargs)
    ref = keras.layers.LayerNormalization(epsilon=eps, dtype=policy, **kwargs)
    ours.build((None, dim))
    ref.build((None, dim))
    weights = [rng.normal(size=w.shape).astype("float32") for w in ref.get_weights()]
    ours.set_weights(weights)
    ref.set_weights(weights)
    return ours, ref


def _value_and_grads(layer, x, dy):
    """Output and gradients w.r.t. the input and every weight, from an eager tape."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    grads = tape.gradient(y, [x] + [w.value for w in layer.trainable_weights], output_gradients=tf.cast(dy, y.dtype))
    return [np.asarray(tf.cast(t, tf.float32)) for t in [y] + grads]


def test_layer_harness(rng):
    check_layer(LayerNorm, {"epsilon": 1e-5}, {"x": rng.normal(size=(2, 5, 8)).astype("float32")},
                expected_output_shape=(2, 5, 8))


@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (2, 3, 4, 16)])
def test_forward_and_gradients_match_numpy_and_keras(rng, shape):
    """Forward against numpy; input, gamma and beta gradients against Keras' autodiff of its own layer (same weights).
    The tape makes the layer take its hand-written gradient (checked in the next test)."""
    x = (rng.normal(size=shape) * 3 + 2).astype("float32")  # a non-zero mean, a scale far from 1
    dy = rng.normal(size=shape).astype("float32")
    ours, ref = _pair(rng, shape[-1], 1e-5)
    got, want = _value_and_grads(ours, x, dy), _value_and_grads(ref, x, dy)
    np.testing.assert_allclose(got[0], _numpy_layer_norm(x, ours.gamma.numpy(), ours.beta.numpy(), 1e-5), atol=1e-5)
    for g, w, name in zip(got, want, ["y", "dx", "dgamma", "dbeta"]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=name)
    # Inference (no tape): the same numbers.
    np.testing.assert_allclose(np.asarray(ours(x)), got[0], atol=1e-6)


def test_gradient_tape_takes_the_hand_written_gradient(rng):
    """Under a tape the forward is wrapped in tf.custom_gradient (IdentityN ops); without one it is plain ops, so that
    inference and export graphs keep grappler's fusions. The gradient graph has no Tile (autodiff of a broadcast
    mean) and gamma/beta sums are matmuls."""
    layer, _ = _pair(rng, 16, 1e-5)
    x = rng.normal(size=(4, 6, 16)).astype("float32")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, layer.gamma.value, layer.beta.value], output_gradients=tf.ones_like(y))

    kinds = [n.op for n in step.get_concrete_function(x).graph.as_graph_def().node]
    assert "IdentityN" in kinds and "Tile" not in kinds and kinds.count("MatMul") == 2
    infer = tf.function(lambda x: layer(x)).get_concrete_function(x).graph.as_graph_def().node
    assert "IdentityN" not in [n.op for n in infer]
    # With the hand-written gradient switched off the same step has autodiff's broadcast ops: the check above can fail.
    from tfformer.layers import layer_norm

    original = layer_norm.gradient_recording
    layer_norm.gradient_recording = lambda: False
    try:
        plain = tf.function(step.python_function).get_concrete_function(x).graph.as_graph_def().node
    finally:
        layer_norm.gradient_recording = original
    assert "IdentityN" not in [n.op for n in plain]


def test_mixed_bfloat16_computes_in_float32(rng):
    """bf16 in, bf16 out, statistics in float32: within bf16 rounding of the float32 layer, gradients too."""
    x = (rng.normal(size=(3, 8, 32)) * 4 + 10).astype("float32")  # mean 10: bf16 statistics would be far off
    dy = rng.normal(size=x.shape).astype("float32")
    ours, _ = _pair(rng, 32, 1e-5, policy="mixed_bfloat16")
    _, ref = _pair(np.random.default_rng(0), 32, 1e-5)  # Keras' layer in float32
    ref.set_weights(ours.get_weights())
    x16 = tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy()  # the bf16 layer sees rounded inputs
    y = ours(tf.cast(x, tf.bfloat16))
    assert y.dtype == tf.bfloat16 and ours.gamma.dtype == "float32"
    got = _value_and_grads(ours, tf.cast(x, tf.bfloat16), dy)
    want = _value_and_grads(ref, x16, tf.cast(tf.cast(dy, tf.bfloat16), tf.float32))
    for g, w, name in zip(got, want, ["y", "dx", "dgamma", "dbeta"]):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max(), err_msg=name)


def test_constant_rows_stay_finite(rng):
    """Zero variance (a constant row, e.g. padding): output beta, finite gradients."""
    layer, _ = _pair(rng, 8, 1e-6)
    x = np.ones((2, 3, 8), "float32")
    y, dx, dgamma, dbeta = _value_and_grads(layer, x, rng.normal(size=x.shape).astype("float32"))
    np.testing.assert_allclose(y, np.broadcast_to(layer.beta.numpy(), y.shape), atol=1e-5)
    assert all(np.all(np.isfinite(t)) for t in (dx, dgamma, dbeta))


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
@pytest.mark.parametrize("kwargs", [dict(axis=1), dict(center=False), dict(scale=False), dict(rms_scaling=True),
                                    dict(axis=[1, 2])])
def test_other_configurations_use_keras_code(rng, kwargs):
    x = rng.normal(size=(2, 5, 6)).astype("float32")
    ours = LayerNorm(epsilon=1e-4, **kwargs)
    ref = keras.layers.LayerNormalization(epsilon=1e-4, **kwargs)
    ours.build(x.shape)
    ref.build(x.shape)
    weights = [rng.normal(size=w.shape).astype("float32") for w in ref.get_weights()]
    ours.set_weights(weights)
    ref.set_weights(weights)
    dy = rng.normal(size=x.shape).astype("float32")
    for g, w in zip(_value_and_grads(ours, x, dy), _value_and_grads(ref, x, dy)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_passes_the_keras_mask_through(rng):
    x = rng.normal(size=(2, 4, 8)).astype("float32")
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool)
    np.testing.assert_array_equal(np.asarray(LayerNorm().compute_mask(x, mask)), mask)
