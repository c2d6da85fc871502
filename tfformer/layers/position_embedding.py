import keras
from keras import ops

from tfformer.checks import check_int


@keras.saving.register_keras_serializable(package="tfformer")
class PositionEmbedding(keras.layers.Layer):
    """Learned position embeddings (BERT, GPT-2).

    One trainable vector per position up to `max_sequence_length`; returns the
    embeddings for the input's positions (it does not add them).

    Args:
        max_sequence_length: int. Number of positions.
        initializer: initializer for the table. Defaults to `"glorot_uniform"`.
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, D)`; only its shape is read.
        start_index: int. Position of the first timestep (for cached decoding).

    Returns:
        `(B, T, D)`.

    Example:
    ```python
    layer = tfformer.layers.PositionEmbedding(max_sequence_length=32)
    layer(np.zeros((2, 10, 8))).shape  # (2, 10, 8)
    ```
    """

    def __init__(self, max_sequence_length, initializer="glorot_uniform", **kwargs):
        check_int("max_sequence_length", max_sequence_length)
        super().__init__(**kwargs)
        self.max_sequence_length = max_sequence_length
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        self.position_embeddings = self.add_weight(
            name="embeddings", shape=(self.max_sequence_length, inputs_shape[-1]), initializer=self.initializer
        )
        self.built = True

    def call(self, inputs, start_index=0):
        shape = ops.shape(inputs)
        length = shape[-2]
        if isinstance(start_index, int) and start_index < 0:
            raise ValueError(f"`start_index` must be >= 0 (the first position). Received: start_index={start_index}")
        if isinstance(length, int) and isinstance(start_index, int) and start_index + length > self.max_sequence_length:
            raise ValueError(
                f"Sequence of length {length} starting at {start_index} exceeds "
                f"max_sequence_length={self.max_sequence_length}."
            )
        table = ops.convert_to_tensor(self.position_embeddings)
        positions = ops.slice(table, (start_index, 0), (length, table.shape[-1]))  # (T, D)
        return ops.broadcast_to(ops.cast(positions, self.compute_dtype), shape)

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_sequence_length": self.max_sequence_length,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config
