import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import PositionEmbedding, RotaryEmbedding, SinusoidalPositionEncoding


def test_sinusoidal_is_the_papers_formula():
    d, length = 16, 50
    pe = np.asarray(SinusoidalPositionEncoding()(np.zeros((1, length, d), "float32")))[0]
    pos = np.arange(length)[:, None]
    two_i = np.arange(0, d, 2)[None, :]
    np.testing.assert_allclose(pe[:, 0::2], np.sin(pos / 10000 ** (two_i / d)), atol=1e-5)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(pos / 10000 ** (two_i / d)), atol=1e-5)


def test_sinusoidal_start_index():
    layer = SinusoidalPositionEncoding()
    full = np.asarray(layer(np.zeros((2, 10, 8), "float32")))
    tail = np.asarray(layer(np.zeros((2, 3, 8), "float32"), start_index=7))
    np.testing.assert_allclose(tail, full[:, 7:], atol=1e-6)


def test_learned_start_index_and_length_check():
    layer = PositionEmbedding(max_sequence_length=10)
    full = np.asarray(layer(np.zeros((2, 10, 4), "float32")))
    np.testing.assert_allclose(full[0], layer.position_embeddings.numpy())
    np.testing.assert_allclose(np.asarray(layer(np.zeros((1, 2, 4), "float32"), start_index=5))[0], full[0, 5:7])
    with pytest.raises(ValueError, match="max_sequence_length=10"):
        layer(np.zeros((1, 11, 4), "float32"))


def _rope_reference(x, start=0):
    b, t, n, h = x.shape
    pos = np.arange(start, start + t)[:, None]
    theta = pos * 10000 ** (-np.arange(0, h, 2) / h)  # (T, H/2)
    out = x.copy()
    cos, sin = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def test_rotary_matches_reference_and_is_relative(rng):
    x = rng.normal(size=(2, 6, 3, 8)).astype("float32")
    rope = RotaryEmbedding()
    np.testing.assert_allclose(np.asarray(rope(x)), _rope_reference(x), atol=1e-5)
    np.testing.assert_allclose(np.asarray(rope(x[:, 4:], start_index=4)), _rope_reference(x)[:, 4:], atol=1e-5)
    # <R_m q, R_n k> depends only on m - n.
    q = np.repeat(rng.normal(size=(1, 1, 1, 8)).astype("float32"), 6, axis=1)
    k = np.repeat(rng.normal(size=(1, 1, 1, 8)).astype("float32"), 6, axis=1)
    rq, rk = np.asarray(rope(q))[0, :, 0], np.asarray(rope(k))[0, :, 0]
    np.testing.assert_allclose(rq[3] @ rk[1], rq[4] @ rk[2], atol=1e-5)


def test_harnesses(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    check_layer(SinusoidalPositionEncoding, {}, {"inputs": x}, expected_output_shape=(2, 5, 8))
    check_layer(PositionEmbedding, dict(max_sequence_length=16), {"inputs": x}, expected_output_shape=(2, 5, 8))
    check_layer(RotaryEmbedding, {}, {"inputs": x}, expected_output_shape=(2, 5, 8))
