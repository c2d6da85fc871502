import keras
import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import Dropout


@pytest.mark.parametrize("rate", [0.1, 0.3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drop_fraction_and_scale(rate, dtype):
    x = np.ones((64, 33, 65), "float32")  # odd size: the last 16-bit half is unused
    y = keras.ops.convert_to_numpy(keras.ops.cast(Dropout(rate, seed=1, dtype=dtype)(x, training=True), "float32"))
    dropped = np.mean(y == 0)
    # 137,280 Bernoulli draws: 5 standard deviations is < 0.5% absolute.
    assert abs(dropped - rate) < 5 * np.sqrt(rate * (1 - rate) / x.size)
    expected_scale = 65536 / (65536 - round(rate * 65536))
    np.testing.assert_allclose(np.unique(y[y != 0]), [expected_scale], rtol=1e-2 if dtype == "bfloat16" else 1e-7)
    # Mean preserved (unbiased): |mean - 1| within 5 standard errors.
    assert abs(y.mean() - 1) < 5 * expected_scale * np.sqrt(rate * (1 - rate) / x.size) + (1e-2 if dtype == "bfloat16" else 0)


def test_identity_at_inference_and_new_masks_each_call(rng):
    x = rng.normal(size=(4, 16, 32)).astype("float32")
    layer = Dropout(0.5, seed=3)
    np.testing.assert_array_equal(np.asarray(layer(x)), x)
    a, b = np.asarray(layer(x, training=True)), np.asarray(layer(x, training=True))
    assert not np.array_equal(a == 0, b == 0)
    # Same seed, fresh layer: same first mask.
    np.testing.assert_array_equal(np.asarray(Dropout(0.5, seed=3)(x, training=True)) == 0, a == 0)
    # Dropped positions are independent of the values (no correlation with x).
    kept = a != 0
    np.testing.assert_allclose(a[kept], x[kept] * 2, rtol=1e-6)


def test_rate_edges_and_noise_shape(rng):
    x = rng.normal(size=(3, 5, 7)).astype("float32")
    np.testing.assert_array_equal(np.asarray(Dropout(0.0)(x, training=True)), x)
    np.testing.assert_array_equal(np.asarray(Dropout(1.0)(x, training=True)), np.zeros_like(x))
    y = np.asarray(Dropout(0.5, noise_shape=(3, 1, 7), seed=0)(x, training=True))  # Keras' path
    assert ((y == 0).all(axis=1) | (y != 0).all(axis=1)).all()
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.5)


def test_gradient_is_the_mask_times_scale(rng):
    import tensorflow as tf

    x = tf.constant(rng.normal(size=(8, 64)).astype("float32"))
    layer = Dropout(0.25, seed=5)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        total = tf.reduce_sum(y)
    grad = tape.gradient(total, x).numpy()
    np.testing.assert_allclose(grad, (y.numpy() != 0) * (65536 / (65536 - 16384)), rtol=1e-7)


def test_harness(rng):
    check_layer(Dropout, dict(rate=0.2, seed=4), {"inputs": rng.normal(size=(2, 3, 8)).astype("float32")},
                expected_output_shape=(2, 3, 8), fit=False)


def test_gradient_is_the_same_mask_and_scale(rng):
    """d(output)/d(input) is the forward's multiplier: 0 where dropped, 1 / (1 - rate) where kept."""
    import tensorflow as tf

    x = tf.constant(rng.normal(size=(4, 8, 16)).astype("float32"))
    dy = rng.normal(size=(4, 8, 16)).astype("float32")
    layer = Dropout(0.25, seed=2)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
    dx = tape.gradient(y, x, output_gradients=dy).numpy()
    multiplier = y.numpy() / x.numpy()
    np.testing.assert_allclose(dx, dy * multiplier, rtol=1e-6, atol=1e-6)
    assert 0 < np.mean(multiplier == 0) < 0.5
