import math

import keras
import tensorflow as tf
from keras import ops

from tfformer.checks import check_int, check_one_of
from tfformer.compat import gradient_recording
from tfformer.layers.dropout import Dropout
from tfformer.layers.layer_utils import (PLAIN, check_dropout, clone_initializer, dense, matmul_bias, quantized,
                                         silu)

ACTIVATIONS = ("relu", "gelu", "gelu_approximate", "swiglu")


def _in_float32(fn, x):
    # erf/exp/sigmoid on bfloat16 tensors run element by element through float conversions on CPU:
    # casting around them is faster (and more precise) than computing in bfloat16.
    return ops.cast(fn(ops.cast(x, "float32")), x.dtype)


@tf.custom_gradient
def _gelu_with_gradient(x):
    """Exact (erf) GELU in float32, and its gradient, each one XLA computation: TF runs the erf, the products and
    autodiff's gradient of them as about ten full-size passes; XLA fuses each direction into one
    (docs/performance.md)."""
    return _gelu_forward(x), lambda dy: _gelu_backward(x, dy)


@tf.function(jit_compile=True, autograph=False)
def _gelu_forward(x):
    x32 = tf.cast(x, tf.float32)
    return tf.cast(x32 * (0.5 + 0.5 * tf.math.erf(x32 * math.sqrt(0.5))), x.dtype)  # x * Phi(x)


@tf.function(jit_compile=True, autograph=False)
def _gelu_backward(x, dy):
    x32 = tf.cast(x, tf.float32)
    cdf = 0.5 + 0.5 * tf.math.erf(x32 * math.sqrt(0.5))  # Phi(x)
    pdf = tf.exp(-0.5 * tf.square(x32)) * (1 / math.sqrt(2 * math.pi))  # phi(x)
    return tf.cast(tf.cast(dy, tf.float32) * (cdf + x32 * pdf), dy.dtype)  # d/dx x Phi(x) = Phi(x) + x phi(x)


_TANH_SCALE = 2 * math.sqrt(2 / math.pi)  # sigmoid(2u) = (1 + tanh(u)) / 2
_CUBIC = 0.044715


@tf.custom_gradient
def _gelu_approximate_with_gradient(x):
    """GPT-2's tanh GELU, `x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2`, written as `x s` with
    `s = sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`, in float32, as one XLA computation each way. The forward pass
    keeps `s` (float32, the size of `x`), so the gradient `s + x s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2)` has
    no transcendental left to compute (docs/performance.md)."""
    y, s = _gelu_approximate_forward(x)
    return y, lambda dy: _gelu_approximate_backward(x, s, dy)


@tf.function(jit_compile=True, autograph=False)
def _gelu_approximate_forward(x):
    x32 = tf.cast(x, tf.float32)
    s = tf.sigmoid(_TANH_SCALE * (x32 + _CUBIC * x32 * x32 * x32))  # (1 + tanh(u)) / 2
    return tf.cast(x32 * s, x.dtype), s


@tf.function(jit_compile=True, autograph=False)
def _gelu_approximate_backward(x, s, dy):
    x32 = tf.cast(x, tf.float32)
    spread = s * (1.0 - s)  # sigmoid's derivative
    slope = s + x32 * spread * _TANH_SCALE * (1.0 + 3 * _CUBIC * x32 * x32)  # d/dx x s(x)
    slope = tf.where(spread > 0, slope, s)  # saturated (|x| > ~10): 0 or 1, not 0 * inf for |x| > 1e19
    return tf.cast(tf.cast(dy, tf.float32) * slope, dy.dtype)


# Each GELU's training form: the activation and its gradient as XLA computations.
_GELUS = {"gelu": _gelu_with_gradient, "gelu_approximate": _gelu_approximate_with_gradient}


@keras.saving.register_keras_serializable(package="tfformer")
class FeedForward(keras.layers.Layer):
    """Position-wise feed-forward network: `W_2 act(W_1 x + b_1) + b_2`.

    The paper's FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 with `activation="relu"`;
    `"gelu"` (exact, erf) as in BERT; `"gelu_approximate"` (the tanh form) as in
    GPT-2 and keras-hub's `GPT2Backbone`; `"swiglu"` (Shazeer, 2020) computes
    `W_2 (silu(x W_g) * x W_1)` with `W_g` and `W_1` in one fused kernel.
    Masks pass through unchanged. Under a gradient tape (training) either GELU
    and its gradient are XLA computations, compiled once per input shape.

    Args:
        hidden_dim: int. Output width (`d_model`).
        intermediate_dim: int. Inner width (`d_ff`).
        activation: str. One of `"relu"`, `"gelu"`, `"gelu_approximate"`, `"swiglu"`. Defaults to
            `"relu"`.
        dropout: float. Dropout on the inner activations. Defaults to `0.0`.
        kernel_initializer: initializer for both kernels.
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, D)`.
        training: bool, enables dropout.
        plan: optional decode plan (see `layer_utils`): a decode step's kernels laid out before the loop.

    Returns:
        `(B, T, hidden_dim)`.

    Example:
    ```python
    ffn = tfformer.layers.FeedForward(hidden_dim=8, intermediate_dim=32)
    ffn(np.zeros((2, 3, 8))).shape  # (2, 3, 8)
    ```
    """

    def __init__(self, hidden_dim, intermediate_dim, activation="relu", dropout=0.0,
                 kernel_initializer="glorot_uniform", **kwargs):
        check_int("hidden_dim", hidden_dim)
        check_int("intermediate_dim", intermediate_dim)
        check_one_of("activation", activation, ACTIVATIONS)
        check_dropout(dropout)
        super().__init__(**kwargs)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.activation = activation
        self.dropout = dropout
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        inner = 2 * self.intermediate_dim if self.activation == "swiglu" else self.intermediate_dim
        make_dense = lambda units, name: keras.layers.Dense(  # noqa: E731
            units, kernel_initializer=clone_initializer(self.kernel_initializer), dtype=self.dtype_policy, name=name
        )
        self.intermediate_dense = make_dense(inner, "intermediate_dense")
        self.intermediate_dense.build(inputs_shape)
        self.output_dense = make_dense(self.hidden_dim, "output_dense")
        self.output_dense.build(tuple(inputs_shape[:-1]) + (self.intermediate_dim,))
        self._dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy)
        self.built = True

    def call(self, inputs, training=None, plan=None):
        plan = plan or PLAIN
        # A decode step on the plan's kernel layout takes `plan.dense` instead of the fused chain.
        prepared = plan.uses(inputs, self.intermediate_dense.kernel, self.intermediate_dense.bias)
        own_calls = any(quantized(layer) for layer in (self.intermediate_dense, self.output_dense))
        if not training and self.activation != "swiglu" and not prepared and not own_calls:
            return dense(self._fused_intermediate(inputs), self.output_dense.kernel, self.output_dense.bias)
        x = self._project(self.intermediate_dense, inputs, plan)  # (B, T, d_ff) or (B, T, 2*d_ff) for swiglu
        if self.activation == "swiglu":
            gate, x = ops.split(x, 2, axis=-1)  # 2 x (B, T, d_ff)
            x = _in_float32(silu, gate) * x
        elif self.activation in _GELUS and gradient_recording():
            x = _GELUS[self.activation](x)
        elif self.activation in _GELUS:
            approximate = self.activation == "gelu_approximate"
            x = _in_float32(lambda h: ops.gelu(h, approximate=approximate), x)
        else:
            x = ops.relu(x)
        x = self._dropout_layer(x, training=training)
        return self._project(self.output_dense, x, plan)

    def _project(self, layer, x, plan):
        # `dense` on the layer's weights: a 2-D MatMul + BiasAdd (a matmul for the bias gradient under a tape), or a
        # decode step's prepared kernels. Quantized layers run their own call.
        if quantized(layer):
            return layer(x)
        return plan.dense(ops.cast(x, layer.compute_dtype), layer.kernel, layer.bias)

    def _fused_intermediate(self, inputs):
        # Inference: a 2-D matmul -> bias_add -> relu/gelu chain, the pattern grappler rewrites into one
        # oneDNN kernel with the activation as a post-op (faster than the 3-D matmul, add and a separate
        # erfc-based gelu, docs/performance.md; the tanh GELU fuses too).
        layer = self.intermediate_dense
        if self.activation == "relu":
            activation = tf.nn.relu
        else:
            approximate = self.activation == "gelu_approximate"
            activation = lambda h: tf.nn.gelu(h, approximate=approximate)  # noqa: E731
        kernel, bias = ops.cast(layer.kernel, inputs.dtype), ops.cast(layer.bias, inputs.dtype)
        return matmul_bias(inputs, kernel, bias, activation)  # (B, T, d_ff)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape[:-1]) + (self.hidden_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim,
                "activation": self.activation,
                "dropout": self.dropout,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            }
        )
        return config
