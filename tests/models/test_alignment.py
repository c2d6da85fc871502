"""The word-timing pieces of `models.alignment` against independent math: dynamic time warping's path cost equals
the cheapest monotonic path's (an exhaustive search on small matrices), the median filter equals SciPy's, and the
word split follows faster-whisper's rules on hand-made pieces."""

import itertools

import numpy as np
import pytest
from scipy import ndimage

from tfformer.models import alignment


def _cheapest_path(cost):
    """The cheapest cost of a path from (0, 0) to (N-1, M-1) moving by (1, 0), (0, 1) or (1, 1), by brute force."""
    n, m = cost.shape
    best = np.inf
    for moves in itertools.product(((1, 0), (0, 1), (1, 1)), repeat=n + m - 2):
        i = j = 0
        total = cost[0, 0]
        for di, dj in moves:
            i, j = i + di, j + dj
            if i >= n or j >= m:
                break
            total += cost[i, j]
            if (i, j) == (n - 1, m - 1):
                best = min(best, total)
                break
    return best


@pytest.mark.parametrize("shape", [(2, 3), (3, 4), (4, 4), (3, 6)])
def test_dtw_finds_the_cheapest_monotonic_path(shape):
    rng = np.random.default_rng(sum(shape))
    cost = rng.normal(size=shape).astype(np.float32)
    rows, columns = alignment.dtw(cost)
    assert rows[0] == 0 and columns[0] == 0 and rows[-1] == shape[0] - 1 and columns[-1] == shape[1] - 1
    steps = np.stack([np.diff(rows), np.diff(columns)], axis=1)
    assert set(map(tuple, steps)) <= {(1, 0), (0, 1), (1, 1)}
    assert cost[rows, columns].sum() == pytest.approx(_cheapest_path(cost), abs=1e-5)


def test_median_filter_equals_scipys():
    x = np.random.default_rng(0).normal(size=(3, 5, 40)).astype(np.float32)
    expected = ndimage.median_filter(x, size=(1, 1, 7), mode="mirror")  # SciPy's "mirror" is numpy's "reflect"
    np.testing.assert_allclose(alignment.median_filter(x, 7), expected, rtol=0, atol=0)


def test_split_words_as_faster_whisper():
    pieces = {1: " The", 2: " quick", 3: "est", 4: ",", 5: " fox", 6: ".", 99: "<|endoftext|>"}
    words, tokens = alignment.split_words(lambda ids: "".join(pieces[i] for i in ids), [1, 2, 3, 4, 5, 6, 99], 99)
    assert words == [" The", " quickest", ",", " fox", ".", "<|endoftext|>"]
    assert tokens == [[1], [2, 3], [4], [5], [6], [99]]
