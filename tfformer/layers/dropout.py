"""Dropout that draws 16 random bits per element instead of a float."""

import keras
import tensorflow as tf

_LEVELS = 65536  # 16 bits per element


@keras.saving.register_keras_serializable(package="tfformer")
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` with half the random numbers.

    On a CPU the random-number generator (Philox) is most of dropout's cost: a
    Transformer block drops out attention weights, sub-layer outputs and the
    embeddings, tens of millions of elements per training step. This layer
    draws one 32-bit random integer for every two elements and compares each
    16-bit half against `round(rate * 65536)`, instead of drawing one float per
    element. The drop probability is therefore `rate` rounded to a multiple of
    1/65536 (0.1 becomes 0.100006) and kept elements are scaled by exactly
    `1 / (1 - that)`, so the expected output still equals the input.

    Same arguments, config and inference behaviour (identity) as
    `keras.layers.Dropout`; with `noise_shape` it falls back to Keras' dropout.

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
        if not training or self.rate == 0 or self.noise_shape is not None:
            return super().call(inputs, training=training)
        threshold = round(self.rate * _LEVELS)  # rate is in [0, 1]
        if threshold == _LEVELS:
            return tf.zeros_like(inputs)
        seed = self.seed_generator.next()
        if seed.dtype != tf.int32:  # stateless ops (and XLA) take int32 seeds
            seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
        size = tf.size(inputs)
        words = tf.random.stateless_uniform([(size + 1) // 2], seed, minval=None, maxval=None, dtype=tf.uint32)
        bits = tf.reshape(tf.bitcast(words, tf.uint16), [-1])[:size]  # (2 * ceil(size / 2),) -> (size,)
        keep = tf.reshape(bits >= tf.constant(threshold, tf.uint16), tf.shape(inputs))
        scale = tf.constant(_LEVELS / (_LEVELS - threshold), inputs.dtype)
        # One (..., D) multiplier, 0 or the scale: the gradient is one multiply by it, no select and scale.
        return inputs * tf.where(keep, scale, tf.zeros([], inputs.dtype))
