import keras

from tfformer.checks import check_int, check_number, check_one_of
from tfformer.layers import masks as masks_lib
from tfformer.layers.attention import SCORES, MultiHeadAttention
from tfformer.layers.dropout import Dropout
from tfformer.layers.feedforward import ACTIVATIONS, FeedForward
from tfformer.layers.layer_norm import LayerNorm
from tfformer.layers.layer_utils import check_dropout, check_sequences


def check_heads(hidden_dim, num_heads):
    if hidden_dim is None or hidden_dim % num_heads:
        raise ValueError(
            f"`hidden_dim` must be divisible by `num_heads`. Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )
    return hidden_dim // num_heads


@keras.saving.register_keras_serializable(package="tfformer")
class EncoderBlock(keras.layers.Layer):
    """Transformer encoder block (Vaswani et al., 2017): self-attention, then FFN.

    Each sub-layer is wrapped as in the paper, `LayerNorm(x + Dropout(Sublayer(x)))`
    (post-LN, the default), or `x + Dropout(Sublayer(LayerNorm(x)))` with
    `norm_first=True` (pre-LN, GPT-2 style; the model then adds a final norm).

    Masking: `padding_mask` `(B, T)` (True = real token) hides padded keys;
    `attention_mask` `(B, T, T)` is ANDed in; a Keras implicit mask on the
    input counts as the padding mask. Outputs at real positions never depend
    on the content of padded positions.

    Args:
        num_heads: int. Attention heads; must divide the input width.
        intermediate_dim: int. Feed-forward inner width (`d_ff`).
        dropout: float. Residual and attention dropout. Defaults to `0.0`.
        activation: str. FFN activation, `"relu"`, `"gelu"`, `"gelu_approximate"` or `"swiglu"`.
        norm_first: bool. Pre-LN if True, post-LN (the paper) if False.
        layer_norm_epsilon: float. Defaults to `1e-5`.
        score: str. Attention score function, see `MultiHeadAttention`.
        window: int. Restricted self-attention radius. Defaults to `None`.
        kernel_initializer: initializer for every kernel.
        num_key_value_heads: int. Key/value heads of the attention (grouped-query
            attention); must divide `num_heads`. Defaults to `None` (`num_heads`).
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, hidden_dim)`.
        padding_mask: optional bool `(B, T)`.
        attention_mask: optional bool `(B, T, T)`.
        training: bool.
        return_attention_scores: bool. Also return the weights `(B, N, T, T)`.
        query_chunk_size: int. The self-attention's queries this many at a time (`MultiHeadAttention`'s).
            Defaults to `None` (all at once).

    Returns:
        `(B, T, hidden_dim)`, or `(outputs, scores)`.

    Example:
    ```python
    block = tfformer.layers.EncoderBlock(num_heads=2, intermediate_dim=16)
    block(np.zeros((1, 4, 8)), padding_mask=np.array([[1, 1, 1, 0]])).shape  # (1, 4, 8)
    ```
    """

    def __init__(
        self,
        num_heads,
        intermediate_dim,
        dropout=0.0,
        activation="relu",
        norm_first=False,
        layer_norm_epsilon=1e-5,
        score="scaled_dot",
        window=None,
        kernel_initializer="glorot_uniform",
        num_key_value_heads=None,
        **kwargs,
    ):
        check_int("num_heads", num_heads)
        check_int("intermediate_dim", intermediate_dim)
        check_dropout(dropout)
        check_int("num_key_value_heads", num_key_value_heads, allow_none=True)
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads`. "
                f"Received: num_key_value_heads={num_key_value_heads}, num_heads={num_heads}"
            )
        # Checked here too, not only when the sublayers are made at the first call.
        check_one_of("activation", activation, ACTIVATIONS)
        check_one_of("score", score, SCORES)
        check_number("layer_norm_epsilon", layer_norm_epsilon, at_least=0, expected="a non-negative float")
        check_int("window", window, minimum=0, allow_none=True)
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.activation = activation
        self.norm_first = norm_first
        self.layer_norm_epsilon = layer_norm_epsilon
        self.score = score
        self.window = window
        self.num_key_value_heads = num_key_value_heads
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.supports_masking = True

    def _attention(self, hidden_dim, name, **kwargs):
        # Subclasses pass the arguments of their variants (DecoderBlock: use_bias, rope_max_wavelength, window).
        options = dict(dropout=self.dropout, score=self.score, window=self.window,
                       num_key_value_heads=self.num_key_value_heads, kernel_initializer=self.kernel_initializer)
        return MultiHeadAttention(self.num_heads, check_heads(hidden_dim, self.num_heads), dtype=self.dtype_policy,
                                  name=name, **{**options, **kwargs})

    def _feedforward(self, hidden_dim):
        return FeedForward(
            hidden_dim,
            self.intermediate_dim,
            activation=self.activation,
            kernel_initializer=self.kernel_initializer,
            dtype=self.dtype_policy,
            name="feedforward",
        )

    def _norm(self, name):
        return LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)

    def _build_common(self, inputs_shape):
        hidden_dim = inputs_shape[-1]
        self.self_attention = self._attention(hidden_dim, "self_attention")
        self.self_attention.build(inputs_shape, inputs_shape)
        self.self_attention_norm = self._norm("self_attention_norm")
        self.self_attention_norm.build(inputs_shape)
        self.feedforward = self._feedforward(hidden_dim)
        self.feedforward.build(inputs_shape)
        self.feedforward_norm = self._norm("feedforward_norm")
        self.feedforward_norm.build(inputs_shape)
        self._residual_dropout = Dropout(self.dropout, dtype=self.dtype_policy)

    def build(self, inputs_shape):
        self._build_common(inputs_shape)
        self.built = True

    def _sublayer(self, x, norm, fn, training):
        """Residual wrapper: post-LN `norm(x + drop(fn(x)))` or pre-LN `x + drop(fn(norm(x)))`."""
        y = fn(norm(x) if self.norm_first else x)
        extra = ()
        if isinstance(y, tuple):
            y, *extra = y
        x = x + self._residual_dropout(y, training=training)
        return (x if self.norm_first else norm(x)), tuple(extra)

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None, return_attention_scores=False,
             mask=None, query_chunk_size=None):
        if padding_mask is None:
            padding_mask = mask
        check_sequences(inputs=inputs)
        batch, length = inputs.shape[:2]
        masks_lib.check_mask("padding_mask", padding_mask, "(B, T)", (batch, length), exact=(1,))
        masks_lib.check_mask("attention_mask", attention_mask, "(B, T, T)", (batch, length, length))
        self_mask = masks_lib.merge_masks(masks_lib.key_mask(padding_mask), attention_mask)
        x, scores = self._sublayer(
            inputs,
            self.self_attention_norm,
            lambda h: self.self_attention(
                h, h, attention_mask=self_mask, return_attention_scores=return_attention_scores, training=training,
                query_chunk_size=query_chunk_size,
            ),
            training,
        )
        x, _ = self._sublayer(x, self.feedforward_norm, lambda h: self.feedforward(h, training=training), training)
        return (x, scores[0]) if return_attention_scores else x

    def compute_output_spec(self, inputs, padding_mask=None, attention_mask=None, training=None,
                            return_attention_scores=False, mask=None, query_chunk_size=None):
        # The residual stream keeps the input's shape. Said here, Keras need not trace `call` in a scratch graph
        # to find out, which was 70% of building transformer-tiny's functional model.
        if return_attention_scores:
            return super().compute_output_spec(inputs, padding_mask=padding_mask, attention_mask=attention_mask,
                                               training=training, return_attention_scores=True, mask=mask,
                                               query_chunk_size=query_chunk_size)
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "dropout": self.dropout,
                "activation": self.activation,
                "norm_first": self.norm_first,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "score": self.score,
                "window": self.window,
                "num_key_value_heads": self.num_key_value_heads,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            }
        )
        return config
