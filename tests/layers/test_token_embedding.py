import keras
import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import TokenEmbedding


def test_scaling_and_tied_projection(rng):
    layer = TokenEmbedding(vocabulary_size=20, hidden_dim=8)
    ids = np.array([[1, 5, 0]])
    x = np.asarray(layer(ids))
    table = layer.embeddings.numpy()
    np.testing.assert_allclose(x, table[ids] * np.sqrt(8), atol=1e-6)
    h = rng.normal(size=(1, 3, 8)).astype("float32")
    logits = layer(h, reverse=True)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    np.testing.assert_allclose(logits, h @ table.T, atol=1e-5)
    unscaled = TokenEmbedding(20, 8, scale=False)
    np.testing.assert_allclose(unscaled(ids), unscaled.embeddings.numpy()[ids], atol=1e-6)


def test_logits_are_float32_under_mixed_precision(rng):
    layer = TokenEmbedding(20, 8, dtype="mixed_bfloat16")
    h = layer(np.array([[1, 2]]))
    assert keras.backend.standardize_dtype(h.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(layer(h, reverse=True).dtype) == "float32"


@pytest.mark.parametrize("bad", [20, 25, -1])
def test_out_of_range_ids_raise(bad):
    layer = TokenEmbedding(vocabulary_size=20, hidden_dim=8)
    with pytest.raises(ValueError, match=r"token_ids.*vocabulary_size=20"):
        layer(np.array([[1, bad]]))


def test_mask_zero():
    layer = TokenEmbedding(20, 8, mask_zero=True)
    out = layer(np.array([[3, 0]]))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out._keras_mask), [[True, False]])


def test_harness():
    check_layer(TokenEmbedding, dict(vocabulary_size=20, hidden_dim=8),
                {"inputs": np.array([[1, 2, 3], [4, 5, 0]], "int32")}, expected_output_shape=(2, 3, 8), mixed=True)
