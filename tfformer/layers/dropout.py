"""Dropout whose mask is a keyed hash of each element's index, computed (forward and gradient) by XLA."""

import keras
import tensorflow as tf

_LEVELS = 65536  # the drop probability is a multiple of 1 / 65536
_REPLICA_KEY = 0x2545F491  # added to seed[0] per replica id under a tf.distribute strategy


def _mix(x):
    """`lowbias32` (C. Wellons' hash prospector): a bijection of uint32 with low avalanche bias."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))
    x = x * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(15, tf.uint32)))
    x = x * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def random_bits(shape, seed):
    """32 random bits per element of `shape`, a function of `seed` (int32 (2,)) and the element's flat index.

    `mix(mix(index ^ seed[0]) + seed[1] * 0x9E3779B9)`: the first round scrambles the index under the layer's key,
    the second under the call's counter. Plain TF ops, so it runs anywhere; inside `_apply` XLA fuses it with the
    multiply into one pass. `tests/layers/test_dropout.py` checks it against a numpy transcription.
    """
    key = tf.bitcast(seed, tf.uint32)
    index = tf.reshape(tf.bitcast(tf.range(tf.reduce_prod(shape), dtype=tf.int32), tf.uint32), shape)
    return _mix(_mix(tf.bitwise.bitwise_xor(index, key[0])) + key[1] * tf.constant(0x9E3779B9, tf.uint32))


@tf.function(jit_compile=True, autograph=False)
def _apply(x, seed, threshold, scale):
    """`x * (scale where the element's bits >= threshold, else 0)`, in float32, as one XLA pass."""
    keep = random_bits(tf.shape(x), seed) >= threshold
    return tf.cast(tf.where(keep, tf.cast(x, tf.float32) * scale, 0.0), x.dtype)


@tf.custom_gradient
def _dropout(x, seed, threshold, scale):
    # The gradient recomputes the mask from the seed (one more hash pass) instead of keeping it.
    return _apply(x, seed, threshold, scale), lambda dy: (_apply(dy, seed, threshold, scale), None, None, None)


@keras.saving.register_keras_serializable(package="tfformer")
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` without a random-number generator in the loop.

    On a CPU, Philox (TF's stateless generator) is most of dropout's cost: a
    Transformer block drops out attention weights, sub-layer outputs and the
    embeddings, tens of millions of elements per training step. This layer
    takes one seed pair per call from its `SeedGenerator` (as Keras' layer
    does) and derives each element's 32 random bits from a keyed integer hash
    of the element's index (`random_bits`). Forward and gradient are each one
    XLA pass that computes the mask and multiplies; the gradient recomputes
    the mask instead of storing it. Both are compiled once per input shape.

    An element is dropped when its top 16 bits are below `round(rate * 65536)`,
    so the drop probability is `rate` rounded to a multiple of 1/65536 (0.1
    becomes 0.100006); kept elements are scaled by exactly `1 / (1 - that)`,
    so the expected output equals the input. The product is computed in
    float32 and rounded once to the input's dtype.

    Under a `tf.distribute` strategy with several replicas, each replica adds
    its id times a constant to the layer's key, so replicas draw different
    masks (Keras' `Dropout` draws the same mask on every replica: the seed
    generator's state is mirrored).

    Same arguments, config and inference behaviour (identity) as
    `keras.layers.Dropout`. With `noise_shape` the mask is drawn over that
    shape (`None` entries take the input's size) and broadcast, as in Keras.

    Args:
        rate: float in [0, 1]. Fraction of the inputs to drop.
        noise_shape: optional shape of the binary mask (Keras' meaning).
        seed: optional int, for reproducible masks.
        **kwargs: Base layer arguments (`name`, `dtype`, `trainable`).

    Example:
    ```python
    layer = tfformer.layers.Dropout(0.1)
    y = layer(np.ones((2, 8)), training=True)  # ~10% zeros, the rest 1/(1-0.1)
    ```
    """

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return super().call(inputs, training=training)
        dropped = round(self.rate * _LEVELS)  # rate is in [0, 1]
        if dropped == _LEVELS:
            return tf.zeros_like(inputs)
        seed = self.seed_generator.next()
        if seed.dtype != tf.int32:  # the hash takes 32-bit keys
            seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
        replica = tf.distribute.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            # The seed generator's state is mirrored, so every replica draws the same seed (and, in Keras' own
            # Dropout, the same mask). Key each replica apart, as one device's masks over the global batch would be.
            replica_id = tf.cast(replica.replica_id_in_sync_group, tf.int32)
            seed = seed + tf.stack([replica_id * _REPLICA_KEY, tf.constant(0, tf.int32)])  # wraps mod 2^32
        threshold = tf.constant(dropped * _LEVELS, tf.uint32)  # bits >= dropped * 2^16  <=>  top 16 bits >= dropped
        scale = tf.constant(_LEVELS / (_LEVELS - dropped), tf.float32)
        inputs = tf.convert_to_tensor(inputs)
        if self.noise_shape is None:
            return _dropout(inputs, seed, threshold, scale)
        # One mask over the noise shape (None or missing trailing entries: the input's size, as in Keras), broadcast
        # over the input; product in float32.
        rank, noise_shape = inputs.shape.rank, tuple(self.noise_shape)
        if len(noise_shape) > rank:
            raise ValueError(f"`noise_shape` must have at most the input's rank ({rank} for input shape "
                             f"{inputs.shape}). Received: noise_shape={noise_shape}")
        noise_shape += (None,) * (rank - len(noise_shape))
        shape = [tf.shape(inputs)[i] if d is None else d for i, d in enumerate(noise_shape)]
        factor = _apply(tf.ones(shape, tf.float32), seed, threshold, scale)  # (noise_shape) scale or 0
        return tf.cast(tf.cast(inputs, tf.float32) * factor, inputs.dtype)
