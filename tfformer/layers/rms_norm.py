"""Root-mean-square normalization over the last axis (Llama's norm)."""

import keras
from keras import ops

from tfformer.checks import check_number


@keras.saving.register_keras_serializable(package="tfformer")
class RMSNorm(keras.layers.Layer):
    """Root-mean-square layer normalization (Zhang & Sennrich, 2019).

    `y = x * rsqrt(mean(x^2) + epsilon) * scale` over the last axis: no centering and no bias, as in Llama,
    SmolLM2 and keras-hub's `LlamaLayerNorm`. The statistics and the product run in float32 (also under mixed
    precision); the result is cast to the compute dtype.

    Args:
        epsilon: float. Added to the mean square. Defaults to `1e-6`.
        **kwargs: Base layer arguments (`name`, `dtype`, `trainable`).

    Call arguments:
        inputs: `(..., D)`.

    Returns:
        A tensor of the input's shape.

    Example:
    ```python
    norm = tfformer.layers.RMSNorm(epsilon=1e-5)
    y = norm(np.random.normal(size=(2, 3, 8)))  # (2, 3, 8), each row's mean square ~1
    ```

    Reference:
        Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.
    """

    def __init__(self, epsilon=1e-6, **kwargs):
        check_number("epsilon", epsilon, at_least=0, expected="a non-negative float")
        super().__init__(**kwargs)
        self.epsilon = epsilon
        self.supports_masking = True

    def build(self, inputs_shape):
        dim = inputs_shape[-1]
        if dim is None:
            raise ValueError(f"RMSNorm needs a known last axis. Received: inputs_shape={inputs_shape}")
        self.scale = self.add_weight(name="scale", shape=(dim,), initializer="ones")
        self.built = True

    def call(self, inputs):
        x = ops.cast(inputs, "float32")  # (..., D)
        mean_square = ops.mean(ops.square(x), axis=-1, keepdims=True)  # (..., 1)
        y = x * ops.rsqrt(mean_square + self.epsilon) * ops.cast(self.scale, "float32")
        return ops.cast(y, self.compute_dtype)

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update({"epsilon": self.epsilon})
        return config
