import keras
import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import RMSNorm


def _numpy_rms_norm(x, scale, eps):
    x = x.astype("float64")
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def test_harness(rng):
    check_layer(RMSNorm, {"epsilon": 1e-5}, {"x": rng.normal(size=(2, 5, 8)).astype("float32")},
                expected_output_shape=(2, 5, 8))


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 0.5])
def test_matches_numpy(rng, eps):
    x = (rng.normal(size=(3, 4, 16)) * 3 + 1).astype("float32")
    layer = RMSNorm(epsilon=eps)
    layer.build(x.shape)
    scale = rng.normal(size=(16,)).astype("float32")
    layer.set_weights([scale])
    np.testing.assert_allclose(np.asarray(layer(x)), _numpy_rms_norm(x, scale, eps), rtol=1e-5, atol=1e-6)


def test_epsilon_matters_for_small_rows():
    # A row of 1e-3's: mean square 1e-6, so epsilon=1e-6 halves the variance term and moves the output.
    x = np.full((1, 4), 1e-3, "float32")
    small, large = RMSNorm(epsilon=0.0)(x), RMSNorm(epsilon=1e-6)(x)
    np.testing.assert_allclose(np.asarray(small), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(large), 1 / np.sqrt(2), rtol=1e-5)


def test_float32_math_under_mixed_precision(rng):
    # Rows of large values whose squares overflow float16: the statistics run in float32.
    x = (rng.normal(size=(2, 8)) * 1000).astype("float32")
    layer = RMSNorm(epsilon=1e-5, dtype="mixed_float16")
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == "float16"
    np.testing.assert_allclose(np.asarray(y, "float32"), _numpy_rms_norm(x, 1.0, 1e-5), rtol=2e-3, atol=2e-3)


def test_weight_is_named_scale():
    layer = RMSNorm()
    layer.build((None, 6))
    assert [w.name for w in layer.weights] == ["scale"]
    np.testing.assert_array_equal(np.asarray(layer.scale), np.ones(6))


def test_bad_epsilon():
    with pytest.raises(ValueError, match="epsilon"):
        RMSNorm(epsilon=-1.0)
