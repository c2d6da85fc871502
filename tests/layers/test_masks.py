import numpy as np
import pytest
from keras import ops

from tfformer.layers import masks


def test_causal_mask_is_lower_triangular():
    got = ops.convert_to_numpy(masks.causal_mask(4))
    np.testing.assert_array_equal(got[0], np.tril(np.ones((4, 4), bool)))


def test_causal_mask_with_offset_matches_cached_positions():
    # Queries at absolute positions 3, 4 over 6 cache slots.
    got = ops.convert_to_numpy(masks.causal_mask(2, 6, offset=3))[0]
    expected = np.arange(6)[None, :] <= np.array([3, 4])[:, None]
    np.testing.assert_array_equal(got, expected)


def test_window_mask():
    got = ops.convert_to_numpy(masks.window_mask(5, 5, 1))[0]
    i, j = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
    np.testing.assert_array_equal(got, np.abs(i - j) <= 1)


def test_padding_and_merge():
    ids = np.array([[5, 3, 0, 0], [1, 2, 3, 4]])
    pad = ops.convert_to_numpy(masks.padding_mask(ids))
    np.testing.assert_array_equal(pad, ids != 0)
    merged = ops.convert_to_numpy(masks.merge_masks(masks.key_mask(pad), masks.causal_mask(4), None))
    expected = (ids != 0)[:, None, :] & np.tril(np.ones((4, 4), bool))[None]
    np.testing.assert_array_equal(merged, expected)
    assert masks.merge_masks(None, None) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_masked_softmax_fully_masked_row_is_zero_not_nan(dtype):
    scores = ops.cast(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), dtype)
    mask = np.array([[True, False, True], [False, False, False]])
    weights = ops.convert_to_numpy(masks.masked_softmax(scores, mask))
    assert weights.dtype == np.float32
    assert np.all(np.isfinite(weights))
    np.testing.assert_array_equal(weights[1], 0.0)
    e = np.exp(np.array([1.0, 3.0]) - 3.0)
    np.testing.assert_allclose(weights[0], [e[0] / e.sum(), 0.0, e[1] / e.sum()],
                               rtol=1e-2 if dtype != "float32" else 1e-6)


def test_mask_value_is_finite():
    assert np.isfinite(masks.MASK_VALUE)
    # Large negative scores next to the mask value still softmax correctly.
    weights = ops.convert_to_numpy(masks.masked_softmax(np.array([[-1e8, 0.0]]), np.array([[True, True]])))
    np.testing.assert_allclose(weights, [[0.0, 1.0]], atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_mask_bias_masks_like_select_and_stays_finite(dtype):
    mask = np.array([[True, False, True, False], [False, False, False, False]])
    bias = ops.convert_to_numpy(ops.cast(masks.mask_bias(mask, dtype), "float32"))
    assert np.all(np.isfinite(bias))  # float16 cannot hold -1e9: it would round to -inf and give NaN
    np.testing.assert_array_equal(bias[mask], 0.0)
    assert np.all(bias[~mask] <= -3e4)
    scores = ops.cast(np.array([[1.0, 9.0, 3.0, 7.0], [4.0, 5.0, 6.0, 7.0]]), dtype)
    biased = ops.convert_to_numpy(masks.masked_softmax(ops.add(scores, masks.mask_bias(mask, dtype)), None))
    selected = ops.convert_to_numpy(masks.masked_softmax(scores, mask, zero_empty_rows=False))
    assert np.all(np.isfinite(biased))
    np.testing.assert_array_equal(biased[0][~mask[0]], 0.0)  # masked keys get exactly zero weight
    np.testing.assert_allclose(biased[0], selected[0], rtol=1e-2 if dtype != "float32" else 1e-6)
