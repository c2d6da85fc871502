import keras
import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import Dropout
from tfformer.layers.dropout import _REPLICA_KEY


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
    assert abs(y.mean() - 1) < (5 * expected_scale * np.sqrt(rate * (1 - rate) / x.size)
                                + (1e-2 if dtype == "bfloat16" else 0))


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


def test_rate_edges(rng):
    x = rng.normal(size=(3, 5, 7)).astype("float32")
    np.testing.assert_array_equal(np.asarray(Dropout(0.0)(x, training=True)), x)
    np.testing.assert_array_equal(np.asarray(Dropout(1.0)(x, training=True)), np.zeros_like(x))
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.5)


def test_noise_shape_broadcasts_one_hashed_mask(rng):
    """With `noise_shape` (None or missing trailing entries = the input's size) the mask is the hash over the noise
    shape, broadcast as in Keras; kept elements are `x * scale` rounded once, also in bfloat16."""
    x = rng.normal(size=(3, 5, 7)).astype("float32") + 10  # no zeros in x
    for noise_shape in ((3, 1, 7), (None, 1, None), (1, 5, 1), (1, 1)):
        layer, twin = Dropout(0.3, noise_shape=noise_shape, seed=2), Dropout(0.3, seed=2)
        seed = keras.ops.convert_to_numpy(twin.seed_generator.next())
        y = np.asarray(layer(x, training=True))
        padded = noise_shape + (None,) * (x.ndim - len(noise_shape))
        mask_shape = [x.shape[i] if d is None else d for i, d in enumerate(padded)]
        keep = numpy_keep(int(np.prod(mask_shape)), seed, 0.3)
        keep = np.broadcast_to(keep.reshape(mask_shape), x.shape)
        assert 0 < keep.mean() < 1
        np.testing.assert_array_equal(y != 0, keep)
        np.testing.assert_allclose(y[keep], x[keep] * (65536 / (65536 - round(0.3 * 65536))), rtol=1e-6)
    with pytest.raises(ValueError, match="noise_shape"):
        Dropout(0.3, noise_shape=(3, 1, 7, 1))(x, training=True)
    layer = Dropout(0.3, noise_shape=(3, 1, 7), seed=4, dtype="mixed_bfloat16")  # computes in bfloat16
    yb = keras.ops.convert_to_numpy(keras.ops.cast(layer(x, training=True), "float32"))
    xb = keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(x, "bfloat16"), "float32"))
    scale = np.float32(65536 / (65536 - round(0.3 * 65536)))
    expected = keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(xb * scale, "bfloat16"), "float32"))
    np.testing.assert_array_equal(yb[yb != 0], expected[yb != 0])
    assert ((yb == 0).all(axis=1) | (yb != 0).all(axis=1)).all()


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


def _lowbias32(x):
    """numpy transcription of the hash, in uint64 arithmetic reduced mod 2^32 (independent of TF's uint32 ops)."""
    m = np.uint64(0xFFFFFFFF)
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & m
    x ^= x >> np.uint64(16)
    return x


def _numpy_bits(size, seed):
    k0, k1 = (np.uint64(int(s) & 0xFFFFFFFF) for s in seed)
    first = _lowbias32(np.arange(size, dtype=np.uint64) ^ k0)
    return _lowbias32((first + k1 * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF))


def numpy_keep(size, seed, rate, replica=0):
    """The layer's keep indicators for `size` elements: top 16 bits of the hash under (seed[0] + replica * key,
    seed[1]) >= round(rate * 65536). Replica 0 is also the single-device mask."""
    key = (int(seed[0]) + replica * _REPLICA_KEY) & 0xFFFFFFFF
    return (_numpy_bits(size, (key, seed[1])) >> np.uint64(16)) >= round(rate * 65536)


def test_mask_is_the_documented_hash_of_index_and_seed(rng):
    """The layer's mask equals numpy's `top 16 bits of mix(mix(i ^ k0) + k1 * golden) >= round(rate * 65536)`,
    for the seed pair the layer's SeedGenerator hands out (a second layer with the same seed reproduces it)."""
    x = rng.normal(size=(3, 7, 129)).astype("float32") + 10  # no zeros in x
    layer, twin = Dropout(0.3, seed=11), Dropout(0.3, seed=11)
    seeds = [keras.ops.convert_to_numpy(twin.seed_generator.next()) for _ in range(2)]
    for seed in seeds:
        y = np.asarray(layer(x, training=True))
        expected_keep = numpy_keep(x.size, seed, 0.3)
        np.testing.assert_array_equal((y != 0).reshape(-1), expected_keep)


def test_masks_are_uncorrelated_across_elements_calls_and_layers():
    """Pearson correlation of keep indicators, at index strides that line up with (B, N, T, S) axes, between
    consecutive calls (also shifted) and between layers: each within 5 standard errors (1 / sqrt(n)) of zero.
    Drop rates per position of the first and last axes are within 5 binomial standard deviations of the rate."""
    shape, rate = (32, 4, 64, 64), 0.5
    x = np.ones(shape, "float32")
    layer = Dropout(rate, seed=7)
    first, second = (np.asarray(layer(x, training=True)).reshape(-1) != 0 for _ in range(2))
    other = np.asarray(Dropout(rate, seed=8)(x, training=True)).reshape(-1) != 0

    def corr(a, b):
        return np.corrcoef(a.astype("float64"), b.astype("float64"))[0, 1]

    n = first.size
    for stride in (1, 2, 3, 8, 64, 4096, 16384):
        assert abs(corr(first[:-stride], first[stride:])) < 5 / np.sqrt(n - stride), stride
    for shift in (0, 1, 2, 64):  # the next call's mask is not this one's, shifted
        assert abs(corr(first[shift:], second[:n - shift])) < 5 / np.sqrt(n - shift), shift
        assert abs(corr(second[shift:], first[:n - shift])) < 5 / np.sqrt(n - shift), shift
    assert abs(corr(first, other)) < 5 / np.sqrt(n)
    keep = first.reshape(shape)
    for axis in (0, 3):
        per_position = 1 - keep.mean(axis=tuple(a for a in range(4) if a != axis))
        count = n // shape[axis]
        assert np.abs(per_position - rate).max() < 5 * np.sqrt(rate * (1 - rate) / count), axis


def test_compiled_mixed_precision_gradient_uses_the_forward_mask(rng):
    """In a tf.function under mixed_bfloat16 the gradient (which recomputes the mask from the seed) is zero exactly
    where the forward dropped, and dy * scale elsewhere; no random-number op is in the graph."""
    import tensorflow as tf

    x = tf.constant(rng.normal(size=(4, 32, 48)).astype("float32") + 10)
    dy = tf.constant(rng.normal(size=(4, 32, 48)).astype("float32"))
    layer = Dropout(0.2, seed=9, dtype="mixed_bfloat16")

    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return y, tape.gradient(y, x, output_gradients=tf.cast(dy, y.dtype))

    y, dx = (t.numpy().astype("float32") for t in step(x, dy))
    assert y.dtype == np.float32 and layer.compute_dtype == "bfloat16"
    scale = 65536 / (65536 - round(0.2 * 65536))
    np.testing.assert_array_equal(dx == 0, y == 0)

    def to_bf16(a):
        return np.asarray(keras.ops.cast(keras.ops.cast(a, "bfloat16"), "float32"))

    bf16 = to_bf16(to_bf16(dy.numpy()) * scale)  # dy arrives in bfloat16; the product is rounded once
    np.testing.assert_array_equal(dx[y != 0], bf16[y != 0])
    ops = {op.type for op in step.get_concrete_function(x, dy).graph.get_operations()}
    assert not any("Random" in t for t in ops), ops


def test_replicas_draw_different_masks(tmp_path):
    """Under MirroredStrategy with 2 replicas each replica's mask is the hash under seed[0] + replica_id * key, so
    replica 0 keeps the single-device mask and replica 1 draws an independent one (Keras' Dropout repeats it)."""
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "dropout_replicas_worker.py")
    out = tmp_path / "masks.npz"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, worker, str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = np.load(out)
    seed, masks = result["seed"].astype("int64"), result["masks"].reshape(2, -1)
    assert not np.array_equal(masks[0], masks[1])
    for replica in range(2):
        np.testing.assert_array_equal(masks[replica], numpy_keep(masks.shape[1], seed, 0.5, replica))
