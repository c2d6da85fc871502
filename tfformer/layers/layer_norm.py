"""LayerNormalization over the last axis with fewer passes and a hand-written gradient."""

import keras
import tensorflow as tf

from tfformer.checks import check_number
from tfformer.compat import gradient_recording


@keras.saving.register_keras_serializable(package="tfformer")
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` with a faster forward pass and gradient.

    Same arguments, weights (`gamma`, `beta`), config and outputs as Keras'
    layer. For the Transformer's case, normalising the last axis with both
    `center` and `scale` and without `rms_scaling`, it computes

        x_hat = (x - mean) * rsqrt(var + epsilon),   y = x_hat * gamma + beta

    in float32 (also under mixed precision), with the gradient written out:

        dx = rsqrt(var + epsilon) * (g - mean(g) - x_hat * mean(g * x_hat)),  g = dy * gamma
        dgamma = sum over rows of dy * x_hat,  dbeta = sum over rows of dy

    Keras' version builds the `(rows, D)` product `rsqrt(var) * gamma` and two
    more full-size tensors from it, and its autodiff gradient runs through
    `moments` (tiles, broadcasts and reductions). This layer takes less time
    forward and backward (docs/performance.md); it is what tfformer's blocks and
    models use. Other axes,
    `center=False`, `scale=False` or `rms_scaling=True` use Keras' code.

    Args:
        epsilon: float. Added to the variance. Defaults to `1e-3` (Keras' default).
        **kwargs: `keras.layers.LayerNormalization` arguments (`axis`,
            `center`, `scale`, `rms_scaling`, initializers, regularizers,
            constraints) and base layer arguments.

    Example:
    ```python
    norm = tfformer.layers.LayerNorm(epsilon=1e-5)
    y = norm(np.random.normal(size=(2, 3, 8)))  # (2, 3, 8), each row mean 0, variance ~1
    ```
    """

    def __init__(self, axis=-1, epsilon=1e-3, **kwargs):  # Keras' signature
        check_number("epsilon", epsilon, at_least=0, expected="a non-negative float")
        super().__init__(axis=axis, epsilon=epsilon, **kwargs)

    def _fast_path(self, inputs):
        axis = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        rank = len(inputs.shape)
        return (
            self.center
            and self.scale
            and not self.rms_scaling
            and len(axis) == 1
            and axis[0] % rank == rank - 1
            and inputs.shape[-1] is not None
        )

    def call(self, inputs):
        if not self._fast_path(inputs):
            return super().call(inputs)
        inputs = tf.convert_to_tensor(inputs)
        stats_dtype = tf.float64 if inputs.dtype == tf.float64 else tf.float32  # Keras: at least float32
        gamma = tf.cast(self.gamma.value, stats_dtype)
        beta = tf.cast(self.beta.value, stats_dtype)
        return tf.cast(_layer_norm(inputs, gamma, beta, self.epsilon, stats_dtype), self.compute_dtype)


def _normalize(x, epsilon, dtype):
    """`(x_hat, rstd)`: `(x - mean) * rsqrt(var + epsilon)` over the last axis and `rsqrt(var + epsilon)` `(..., 1)`."""
    x = tf.cast(x, dtype)  # (..., D)
    centered = x - tf.reduce_mean(x, axis=-1, keepdims=True)  # (..., D)
    rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True) + epsilon)  # (..., 1)
    return centered * rstd, rstd


def _layer_norm(x, gamma, beta, epsilon, dtype):
    if not gradient_recording():  # inference and export graphs: the same math without the IdentityN ops
        return _normalize(x, epsilon, dtype)[0] * gamma + beta

    @tf.custom_gradient
    def forward(x, gamma, beta):
        x_hat, rstd = _normalize(x, epsilon, dtype)  # (..., D), (..., 1)
        y = x_hat * gamma + beta  # (..., D)

        def grad(dy):
            dy = tf.cast(dy, dtype)  # (..., D)
            g = dy * gamma
            mean_g = tf.reduce_mean(g, axis=-1, keepdims=True)  # (..., 1)
            mean_g_x_hat = tf.reduce_mean(g * x_hat, axis=-1, keepdims=True)  # (..., 1)
            dx = rstd * (g - mean_g - x_hat * mean_g_x_hat)  # (..., D)
            # Sums over rows as (1, rows) @ (rows, D): oneDNN's matmul is faster here than a column reduction.
            ones = tf.ones([1, tf.size(dy) // gamma.shape[0]], dtype)  # (1, rows)
            dgamma = tf.matmul(ones, tf.reshape(dy * x_hat, [-1, gamma.shape[0]]))[0]  # (D,)
            dbeta = tf.matmul(ones, tf.reshape(dy, [-1, gamma.shape[0]]))[0]  # (D,)
            return tf.cast(dx, x.dtype), dgamma, dbeta

        return y, grad

    return forward(x, gamma, beta)
