"""The gated feed-forward network of Llama-family models (SwiGLU)."""

import keras
from keras import ops

from tfformer.checks import check_int
from tfformer.layers.dropout import Dropout
from tfformer.layers.layer_utils import PLAIN, add_kernel, check_dropout


@keras.saving.register_keras_serializable(package="tfformer")
class GatedFeedForward(keras.layers.Layer):
    """Gated feed-forward network: `down(silu(gate(x)) * up(x))` (SwiGLU, Shazeer 2020).

    The feed-forward block of Llama, SmolLM2 and keras-hub's `LlamaBackbone`. The gate and up projections share
    one kernel `gate_up_kernel` `(D, 2 * intermediate_dim)`, gate columns first, so a decode step reads them with
    one matmul; `down_kernel` is `(intermediate_dim, hidden_dim)`. The SiLU runs in float32 (also under mixed
    precision). Masks pass through unchanged.

    Args:
        hidden_dim: int. Output width (`d_model`).
        intermediate_dim: int. Width of the gate and up projections.
        use_bias: bool. Whether the three projections have biases. Defaults to `False` (Llama).
        dropout: float. Dropout on the gated activations. Defaults to `0.0`.
        kernel_initializer: initializer for the kernels.
        bias_initializer: initializer for the biases.
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, D)`.
        training: bool, enables dropout.
        plan: optional decode plan (see `layer_utils`): a decode step's kernels laid out before the loop.

    Returns:
        `(B, T, hidden_dim)`.

    Example:
    ```python
    ffn = tfformer.layers.GatedFeedForward(hidden_dim=8, intermediate_dim=32)
    ffn(np.zeros((2, 3, 8))).shape  # (2, 3, 8)
    ```

    Reference:
        Shazeer, "GLU Variants Improve Transformer", 2020.
    """

    def __init__(self, hidden_dim, intermediate_dim, use_bias=False, dropout=0.0, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", **kwargs):
        check_int("hidden_dim", hidden_dim)
        check_int("intermediate_dim", intermediate_dim)
        check_dropout(dropout)
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.use_bias = use_bias
        self.dropout = dropout
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        self.gate_up_kernel, self.gate_up_bias = add_kernel(self, "gate_up", inputs_shape[-1],
                                                            2 * self.intermediate_dim)
        self.down_kernel, self.down_bias = add_kernel(self, "down", self.intermediate_dim, self.hidden_dim)
        self._dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy)
        self.built = True

    def call(self, inputs, training=None, plan=None):
        plan = plan or PLAIN
        x = ops.cast(inputs, self.compute_dtype)
        gate_up = plan.dense(x, self.gate_up_kernel, self.gate_up_bias)  # (B, T, 2F)
        gate, up = ops.split(gate_up, 2, axis=-1)  # 2 x (B, T, F)
        x = self._dropout_layer(plan.silu(gate) * up, training=training)
        return plan.dense(x, self.down_kernel, self.down_bias)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape[:-1]) + (self.hidden_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim,
                "use_bias": self.use_bias,
                "dropout": self.dropout,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config
