import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import GatedFeedForward


def _numpy_swiglu(x, gate, up, down, biases=(0.0, 0.0, 0.0)):
    x = x.astype("float64")
    g, u = x @ gate + biases[0], x @ up + biases[1]
    silu = g / (1 + np.exp(-g))
    return (silu * u) @ down + biases[2]


@pytest.mark.parametrize("use_bias", [False, True])
def test_harness(rng, use_bias):
    check_layer(GatedFeedForward, dict(hidden_dim=8, intermediate_dim=16, use_bias=use_bias, dropout=0.1),
                {"inputs": rng.normal(size=(2, 3, 8)).astype("float32")}, expected_output_shape=(2, 3, 8))


def test_matches_numpy_without_bias(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = GatedFeedForward(hidden_dim=6, intermediate_dim=12)
    layer.build(x.shape)
    assert [w.name for w in layer.weights] == ["gate_up_kernel", "down_kernel"]
    gate, up, down = (rng.normal(size=s).astype("float32") for s in [(8, 12), (8, 12), (12, 6)])
    layer.set_weights([np.concatenate([gate, up], axis=1), down])  # gate columns first
    np.testing.assert_allclose(np.asarray(layer(x)), _numpy_swiglu(x, gate, up, down), rtol=1e-5, atol=1e-5)


def test_matches_numpy_with_bias(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = GatedFeedForward(hidden_dim=6, intermediate_dim=12, use_bias=True)
    layer.build(x.shape)
    gate, up, down = (rng.normal(size=s).astype("float32") for s in [(8, 12), (8, 12), (12, 6)])
    bg, bu, bd = (rng.normal(size=s).astype("float32") for s in [12, 12, 6])
    layer.set_weights([np.concatenate([gate, up], axis=1), np.concatenate([bg, bu]), down, bd])
    np.testing.assert_allclose(np.asarray(layer(x)), _numpy_swiglu(x, gate, up, down, (bg, bu, bd)),
                               rtol=1e-5, atol=1e-5)


def test_mixed_precision_close_to_float32(rng):
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    full = GatedFeedForward(hidden_dim=8, intermediate_dim=16)
    low = GatedFeedForward(hidden_dim=8, intermediate_dim=16, dtype="mixed_bfloat16")
    full.build(x.shape)
    low.build(x.shape)
    low.set_weights(full.get_weights())
    np.testing.assert_allclose(np.asarray(low(x), "float32"), np.asarray(full(x)), rtol=0.05, atol=0.05)


def test_bad_arguments():
    with pytest.raises(ValueError, match="intermediate_dim"):
        GatedFeedForward(hidden_dim=8, intermediate_dim=0)
    with pytest.raises(ValueError, match="dropout"):
        GatedFeedForward(hidden_dim=8, intermediate_dim=4, dropout=1.5)
