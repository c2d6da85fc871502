import math

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfformer.checks import check_int
from tfformer.layers.layer_utils import PLAIN


def check_token_ids(token_ids, vocabulary_size, name="token_ids"):
    """Eagerly reject ids outside `[0, vocabulary_size)`; a no-op while tracing a graph.

    On CPU an out-of-range gather raises, but on GPU it silently returns zeros,
    so the check is ours and does not depend on the device.
    """
    if not tf.executing_eagerly() or isinstance(token_ids, keras.KerasTensor):
        return
    ids = np.asarray(ops.convert_to_numpy(token_ids))
    if ids.size and (ids.min() < 0 or ids.max() >= vocabulary_size):
        bad = ids.max() if ids.max() >= vocabulary_size else ids.min()
        raise ValueError(
            f"`{name}` must be in [0, vocabulary_size={vocabulary_size}). Received an id of {int(bad)}."
        )


@keras.saving.register_keras_serializable(package="tfformer")
class TokenEmbedding(keras.layers.Layer):
    """Token embeddings scaled by sqrt(d_model), reusable as the output projection.

    `call(ids)` looks up `E[ids] * sqrt(hidden_dim)` (the paper's scaling, off
    with `scale=False`). `call(x, reverse=True)` (or `attend(x)`) computes the
    pre-softmax logits `x E^T` with the same matrix, the paper's weight tying;
    the logits are returned in float32 even under mixed precision.

    With `mask_zero=True` the layer emits a Keras mask `ids != 0`, which our
    attention layers honour.

    Args:
        vocabulary_size: int. Number of tokens.
        hidden_dim: int. Embedding width (`d_model`).
        scale: bool. Multiply the looked-up vectors by sqrt(hidden_dim). Defaults to `True`.
        mask_zero: bool. Emit a padding mask for id 0. Defaults to `False`.
        initializer: initializer for the table. Defaults to normal with stddev `hidden_dim**-0.5`.
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: int ids `(B, T)`, or with `reverse=True` hidden states `(B, T, hidden_dim)`.
        reverse: bool. Project hidden states to logits instead of looking up ids.
        plan: optional decode plan (see `layer_utils`): its forms of the lookup and of the projection.

    Returns:
        `(B, T, hidden_dim)` embeddings, or `(B, T, vocabulary_size)` float32 logits.

    Example:
    ```python
    emb = tfformer.layers.TokenEmbedding(vocabulary_size=100, hidden_dim=8)
    h = emb(np.array([[5, 7, 0]]))  # (1, 3, 8)
    logits = emb(h, reverse=True)  # (1, 3, 100)
    ```
    """

    def __init__(self, vocabulary_size, hidden_dim, scale=True, mask_zero=False, initializer=None, **kwargs):
        check_int("vocabulary_size", vocabulary_size)
        check_int("hidden_dim", hidden_dim)
        super().__init__(**kwargs)
        self.autocast = False  # variables are read in float32; call() and attend() cast what they use
        self.vocabulary_size = vocabulary_size
        self.hidden_dim = hidden_dim
        self.scale = scale
        self.mask_zero = mask_zero
        self.initializer = keras.initializers.get(
            initializer or keras.initializers.RandomNormal(stddev=hidden_dim**-0.5)
        )

    def build(self, inputs_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.vocabulary_size, self.hidden_dim), initializer=self.initializer
        )
        self.built = True

    def call(self, inputs, reverse=False, plan=None):
        if reverse:
            if inputs.shape[-1] not in (None, self.hidden_dim):
                raise ValueError(f"`inputs` with reverse=True must be hidden states (..., hidden_dim="
                                 f"{self.hidden_dim}). Received: shape={tuple(inputs.shape)}")
            return self.attend(inputs, plan)
        check_token_ids(inputs, self.vocabulary_size)
        # Gather from the float32 table, then cast the (B, T, D) rows: not the whole (V, D) table.
        rows = (plan or PLAIN).lookup(self.embeddings, ops.cast(inputs, "int32"))  # (B, T, D)
        x = ops.cast(rows, self.compute_dtype)
        return x * ops.cast(math.sqrt(self.hidden_dim), x.dtype) if self.scale else x

    def attend(self, inputs, plan=None):
        """Logits `inputs @ E^T`, `(B, T, vocabulary_size)` in float32; `plan`: a decode plan (`layer_utils`)."""
        if (plan or PLAIN).one_row(inputs):
            # A batch-1 decode step under XLA (the plan's "rows" layout): float32 also under mixed
            # precision, so that XLA fuses the transposed table into one loop (a cast would be hoisted with it);
            # or the plan's own transposed table `(D, V)` (`DecodePlan(transposed_embeddings=True)`).
            laid_out = plan.kernels.get(id(self.embeddings))
            columns = ops.transpose(self.embeddings) if laid_out is None else laid_out[0]
            return ops.matmul(ops.cast(inputs, "float32"), columns)  # (B, 1, D) x (D, V) -> (B, 1, V)
        return (plan or PLAIN).logits(inputs, self.embeddings)

    def compute_mask(self, inputs, mask=None, reverse=False, plan=None):
        if reverse or not self.mask_zero:
            return mask
        return ops.not_equal(inputs, 0)

    def compute_output_shape(self, inputs_shape, reverse=False, plan=None):
        if reverse:
            return tuple(inputs_shape[:-1]) + (self.vocabulary_size,)
        return tuple(inputs_shape) + (self.hidden_dim,)

    def compute_output_spec(self, inputs, reverse=False, plan=None):
        shape = self.compute_output_shape(inputs.shape, reverse=reverse)
        return keras.KerasTensor(shape, dtype="float32" if reverse else self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "hidden_dim": self.hidden_dim,
                "scale": self.scale,
                "mask_zero": self.mask_zero,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config
