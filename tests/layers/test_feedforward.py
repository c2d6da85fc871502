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


def test_harness(rng):
    check_layer(FeedForward, dict(hidden_dim=8, intermediate_dim=16, activation="swiglu", dropout=0.1),
                {"inputs": rng.normal(size=(2, 3, 8)).astype("float32")}, expected_output_shape=(2, 3, 8))


def test_bad_activation():
    with pytest.raises(ValueError, match="activation.*relu"):
        FeedForward(8, 16, activation="tanh")
