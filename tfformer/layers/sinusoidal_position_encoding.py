import keras
from keras import ops

from tfformer.checks import check_number


@keras.saving.register_keras_serializable(package="tfformer")
class SinusoidalPositionEncoding(keras.layers.Layer):
    """The paper's fixed position encoding (no weights).

    `PE(pos, 2i) = sin(pos / max_wavelength^(2i/d))` and
    `PE(pos, 2i+1) = cos(pos / max_wavelength^(2i/d))`, sine and cosine
    interleaved along the feature axis exactly as written in the paper.
    The encoding is returned, not added, so the caller decides how to combine it.

    Args:
        max_wavelength: float. The base of the geometric progression of
            wavelengths. Defaults to `10000`.
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, D)`; only its shape is read.
        start_index: int. Position of the first timestep (for cached decoding).
            Defaults to `0`.

    Returns:
        `(B, T, D)` encodings in the layer's compute dtype.

    Example:
    ```python
    x = np.zeros((1, 50, 16), "float32")
    pe = tfformer.layers.SinusoidalPositionEncoding()(x)  # (1, 50, 16)
    ```
    """

    def __init__(self, max_wavelength=10000.0, **kwargs):
        check_number("max_wavelength", max_wavelength, above=1)
        super().__init__(**kwargs)
        self.max_wavelength = max_wavelength
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0):
        shape = ops.shape(inputs)
        length, dim = shape[-2], inputs.shape[-1]
        positions = ops.cast(ops.arange(length) + start_index, "float32")  # (T,)
        i = ops.arange(dim) // 2  # (D,): 0, 0, 1, 1, ... so 2i = 2 * (d // 2)
        inverse_freq = ops.power(float(self.max_wavelength), -ops.cast(2 * i, "float32") / dim)  # (D,)
        angles = positions[:, None] * inverse_freq[None, :]  # (T, D)
        encoding = ops.where(ops.arange(dim) % 2 == 0, ops.sin(angles), ops.cos(angles))  # (T, D)
        return ops.broadcast_to(ops.cast(encoding, self.compute_dtype), shape)

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update({"max_wavelength": self.max_wavelength})
        return config
