import keras
from keras import ops

from tfformer.checks import check_number


def check_rope_max_wavelength(value):
    """Raise a ValueError unless `value`, a layer's `rope_max_wavelength`, is a number > 1 or None."""
    check_number("rope_max_wavelength", value, above=1, allow_none=True)


@keras.saving.register_keras_serializable(package="tfformer")
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding, RoPE (Su et al., 2021), applied to q or k.

    Feature pairs `(x[2i], x[2i+1])` are rotated by the angle
    `pos * max_wavelength^(-2i/d)`, so the dot product of a rotated query and a
    rotated key depends only on their relative position. No weights.

    Args:
        max_wavelength: float. Defaults to `10000`.
        sequence_axis: int. Axis of the positions. Defaults to `1`.
        feature_axis: int. Axis of the rotated features. Defaults to `-1`.
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: e.g. `(B, T, N, H)` or `(B, T, D)`; the feature size must be even.
        start_index: int. Position of the first timestep (for cached decoding).

    Returns:
        A tensor of the input's shape.

    Example:
    ```python
    rope = tfformer.layers.RotaryEmbedding()
    q = rope(np.random.rand(1, 6, 2, 4).astype("float32"))  # (B, T, N, H)
    ```
    """

    def __init__(self, max_wavelength=10000.0, sequence_axis=1, feature_axis=-1, **kwargs):
        check_number("max_wavelength", max_wavelength, above=1)
        super().__init__(**kwargs)
        self.max_wavelength = max_wavelength
        self.sequence_axis = sequence_axis
        self.feature_axis = feature_axis
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0):
        rank = len(inputs.shape)
        seq_axis, feat_axis = self.sequence_axis % rank, self.feature_axis % rank
        dim = inputs.shape[feat_axis]
        if dim is None or dim % 2:
            raise ValueError(f"RotaryEmbedding needs an even feature size. Received: {dim} on axis {self.feature_axis}")
        length = ops.shape(inputs)[seq_axis]
        positions = ops.cast(ops.arange(length) + start_index, "float32")  # (T,)
        # (D/2,): 1 / base^(2i/D), as Hugging Face and keras-hub compute it, so that the angles round as theirs do.
        inverse_freq = 1.0 / ops.power(float(self.max_wavelength), ops.arange(0, dim, 2, dtype="float32") / dim)
        angles = ops.repeat(positions[:, None] * inverse_freq[None, :], 2, axis=-1)  # (T, D): each angle twice
        shape = [1] * rank
        shape[seq_axis], shape[feat_axis] = -1, dim
        cos = ops.reshape(ops.cos(angles), shape)  # T and D on their axes, 1 elsewhere
        # The rotation's signs ride on sin: (-sin, sin, -sin, sin, ...).
        signs = ops.tile(ops.convert_to_tensor([-1.0, 1.0], "float32"), [dim // 2])  # (D,)
        sin = ops.reshape(ops.sin(angles) * signs, shape)
        x = ops.cast(inputs, "float32")
        # Each pair swapped, (x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...): one reverse, no slices or stack.
        x_last = ops.moveaxis(x, feat_axis, -1)  # (..., D)
        pairs = ops.reshape(x_last, ops.shape(x_last)[:-1] + (dim // 2, 2))  # (..., D/2, 2)
        swapped = ops.reshape(ops.flip(pairs, axis=-1), ops.shape(x_last))  # (..., D/2, 2) -> (..., D)
        swapped = ops.moveaxis(swapped, -1, feat_axis)
        return ops.cast(x * cos + swapped * sin, self.compute_dtype)

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "sequence_axis": self.sequence_axis,
                "feature_axis": self.feature_axis,
            }
        )
        return config
