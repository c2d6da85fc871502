"""Attention masks: one vocabulary everywhere.

Every mask here is boolean and `True` means "may attend". Shapes use
B = batch, T = query length, S = key length. A mask of shape `(B, T, S)` (or
anything that broadcasts to it) is what `MultiHeadAttention` consumes.

Scores are masked with a finite value and the softmax runs in float32, so a
row with no visible key gives all-zero weights instead of NaN in float32,
bfloat16 and float16 alike.
"""

import numpy as np
from keras import ops

# Finite, and far below any real float32 score. Never `-inf`: `-inf - -inf`
# inside softmax gives NaN for a fully masked row.
MASK_VALUE = -1e9
# float16 cannot hold -1e9 (it would round to -inf); Keras' Softmax uses the same value.
FLOAT16_MASK_VALUE = -3e4


def causal_mask(query_length, key_length=None, offset=0):
    """Lower-triangular mask `(1, T, S)`: query `i` sees keys `j <= i + offset`.

    `offset` is the position of the first query, e.g. the cache index during
    incremental decoding (the queries are positions `offset .. offset+T-1`).
    """
    key_length = query_length if key_length is None else key_length
    i = ops.arange(query_length, dtype="int32") + ops.cast(offset, "int32")
    j = ops.arange(key_length, dtype="int32")
    return ops.expand_dims(i[:, None] >= j[None, :], 0)  # (1, T, S)


def window_mask(query_length, key_length, window, offset=0):
    """Restricted attention `(1, T, S)`: query `i` sees keys with `|i + offset - j| <= window`."""
    i = ops.arange(query_length, dtype="int32") + ops.cast(offset, "int32")
    j = ops.arange(key_length, dtype="int32")
    return ops.expand_dims(ops.abs(i[:, None] - j[None, :]) <= window, 0)  # (1, T, S)


def padding_mask(token_ids, padding_id=0):
    """`(B, T)` boolean mask, True where `token_ids != padding_id` (a real token)."""
    return ops.not_equal(token_ids, padding_id)


def key_mask(mask):
    """A `(B, S)` padding mask as an attention mask `(B, 1, S)`."""
    return None if mask is None else ops.expand_dims(ops.cast(mask, "bool"), 1)


def query_mask(mask):
    """A `(B, T)` padding mask as an attention mask `(B, T, 1)`."""
    return None if mask is None else ops.expand_dims(ops.cast(mask, "bool"), 2)


def static_shape(x):
    """The static shape of a tensor, array or nested list as a tuple (None for an unknown size); None for None or
    a tensor of unknown rank."""
    if x is None or getattr(getattr(x, "shape", None), "rank", 0) is None:
        return None
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def check_mask(name, mask, axes, shape, exact=()):
    """Raise a ValueError naming `name` unless `mask` (None passes) has one axis per entry of `shape` and each
    static size is that entry (None: any) or 1, which broadcasts (not on the axes listed in `exact`). `axes` names
    them for the message, e.g. `"(B, T, S)"`. Without it a `(B, S)` padding mask given as an `attention_mask`
    would broadcast its batch over the heads: no error, and wrong weights when `B` equals the head count."""
    actual = static_shape(mask)
    if actual is None:
        return
    if len(actual) != len(shape) or not all(
            size is None or want is None or size == want or (size == 1 and axis not in exact)
            for axis, (size, want) in enumerate(zip(actual, shape))):
        broadcast = [label for axis, label in enumerate(axes.strip("()").split(", ")) if axis not in exact]
        raise ValueError(f"`{name}` must be {axes} = {tuple(shape)} (None: any size; 1 broadcasts on "
                         f"{', '.join(broadcast)}). Received: shape={tuple(actual)}")


def merge_masks(*masks):
    """AND together boolean masks that broadcast to `(B, T, S)`; `None`s are skipped.

    Returns `None` when every mask is `None` (attend everywhere).
    """
    merged = None
    for mask in masks:
        if mask is None:
            continue
        mask = ops.cast(mask, "bool")
        merged = mask if merged is None else ops.logical_and(merged, mask)
    return merged


def mask_bias(mask, dtype):
    """`mask` as an additive bias of `dtype`: 0 where True, a large finite negative value where False.

    Adding it to scores masks them like `where(mask, scores, MASK_VALUE)` does, but as an
    add that oneDNN fuses into the score matmul (BatchMatMul + Mul + Add is one kernel on CPU).
    """
    large_negative = FLOAT16_MASK_VALUE if dtype == "float16" else MASK_VALUE
    return ops.cast(ops.where(ops.cast(mask, "bool"), 0.0, large_negative), dtype)


def has_visible_key(mask, axis=-1):
    """True where a row of `mask` lets the query see at least one key (shape of `mask`, `axis` kept as 1)."""
    return ops.any(ops.cast(mask, "bool"), axis=axis, keepdims=True)


def masked_softmax(scores, mask=None, axis=-1, zero_empty_rows=True):
    """Softmax in float32 over `axis` with masked positions set to exactly 0.

    `mask` broadcasts to `scores`. A row whose keys are all masked gets all-zero
    weights (no NaN), whatever the dtype of `scores`. With `zero_empty_rows=False`
    such a row keeps uniform weights and the caller zeroes what it computes from
    it (MultiHeadAttention zeroes the mixed values, a smaller tensor).
    """
    scores = ops.cast(scores, "float32")
    if mask is not None:
        mask = ops.cast(mask, "bool")
        scores = ops.where(mask, scores, MASK_VALUE)
    if scores.shape[axis] == 1:
        weights = ops.ones_like(scores)  # one key: ops.softmax would warn that the result is always 1
    else:
        weights = ops.softmax(scores, axis=axis)  # one fused kernel (and one fused gradient)
    if mask is None or not zero_empty_rows:
        return weights
    # A fully masked row softmaxes to uniform weights; zero it. The row test runs on the
    # (usually broadcast, small) mask, so the full-size cost is one multiply.
    return weights * ops.cast(has_visible_key(mask, axis), "float32")
