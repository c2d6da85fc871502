import keras

from tfformer.layers import masks as masks_lib
from tfformer.layers.encoder_block import EncoderBlock
from tfformer.layers.gated_feedforward import GatedFeedForward
from tfformer.layers.layer_norm import LayerNorm
from tfformer.layers.layer_utils import check_sequences
from tfformer.layers.rms_norm import RMSNorm
from tfformer.layers.rotary_embedding import check_rope_max_wavelength

NORMALIZATIONS = ("layer", "rms")


@keras.saving.register_keras_serializable(package="tfformer")
class DecoderBlock(EncoderBlock):
    """Transformer decoder block: causal self-attention, cross-attention, FFN.

    The paper's decoder layer: masked self-attention over the target, attention
    over the encoder output (`cross_attention=True`), then the feed-forward
    network, each wrapped in residual dropout + LayerNorm (post-LN by default,
    pre-LN with `norm_first=True`). With `cross_attention=False` it is a
    GPT-style decoder-only block.

    Masking: self-attention is causal by default (`use_causal_mask=True`) and
    ANDs `padding_mask` `(B, T)` (or, with a cache, `(B, S_max)` over the cache
    slots) and `attention_mask` `(B, T, T)`. Cross-attention hides padded
    encoder positions through `encoder_padding_mask` `(B, S)`. Outputs at
    position `t` never depend on inputs after `t`.

    Incremental decoding: pass `cache` `(B, 2, K, S_max, H)` (`K` key/value heads) and `cache_index`;
    the block writes this step's keys/values and returns `(outputs, cache)`.
    `cross_attention_cache` (from `compute_cross_attention_cache`) saves
    re-projecting the encoder output at every step.

    Llama-style blocks (SmolLM2): `normalization="rms"` (`RMSNorm`),
    `use_bias=False` (no biases in the attention and feed-forward projections;
    the feed-forward is then a `GatedFeedForward`, which needs
    `activation="swiglu"`) and `rope_max_wavelength` (rotary positions on
    the self-attention's q and k).

    Args:
        num_heads, intermediate_dim, dropout, activation, norm_first,
        layer_norm_epsilon, score, window, kernel_initializer,
        num_key_value_heads: as `EncoderBlock`.
        cross_attention: bool. Whether the block attends over an encoder
            output. Defaults to `True`.
        normalization: str. `"layer"` (`LayerNorm`) or `"rms"` (`RMSNorm`), both
            with `layer_norm_epsilon`. Defaults to `"layer"`.
        use_bias: bool. Whether the projections have biases. Defaults to `True`.
        rope_max_wavelength: float. If set, rotary positions with this base in
            the self-attention. Defaults to `None` (none).
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, hidden_dim)`.
        encoder_outputs: `(B, S, hidden_dim)`, needed when `cross_attention`.
        padding_mask: optional bool `(B, T)` (`(B, S_max)` with a cache).
        encoder_padding_mask: optional bool `(B, S)`.
        attention_mask: optional bool `(B, T, T)` for the self-attention.
        use_causal_mask: bool. Defaults to `True`.
        cache: optional self-attention cache `(B, 2, K, S_max, H)`, or split
            (`layers.layer_utils.split_cache`: `(keys, values)`, each `(B*K, S_max, H)`,
            or as a `layers.layer_utils.SplitCache`, which Keras does not cast).
        cache_index: int scalar, position of the first of the `T` inputs.
        cross_attention_cache: optional `(B, 2, K, S, H)`.
        training: bool.
        return_attention_scores: bool. Also return the cross-attention weights
            `(B, N, T, S)` (self-attention weights for a decoder-only block).
        plan: optional decode plan (see `layers.layer_utils`), handed to the
            attention and feed-forward layers.

    Returns:
        `outputs` `(B, T, hidden_dim)`, then `scores` if asked, then `cache` if given.

    Example:
    ```python
    block = tfformer.layers.DecoderBlock(num_heads=2, intermediate_dim=16)
    y = block(np.zeros((1, 4, 8)), np.zeros((1, 6, 8)))  # (1, 4, 8)
    ```
    """

    def __init__(self, num_heads, intermediate_dim, cross_attention=True, normalization="layer", use_bias=True,
                 rope_max_wavelength=None, **kwargs):
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"`normalization` must be one of {NORMALIZATIONS}. Received: "
                             f"normalization={normalization!r}")
        if not use_bias and kwargs.get("activation", "relu") != "swiglu":
            raise ValueError("`use_bias=False` needs activation='swiglu' (a GatedFeedForward). "
                             f"Received: activation={kwargs.get('activation', 'relu')!r}")
        check_rope_max_wavelength(rope_max_wavelength)
        super().__init__(num_heads, intermediate_dim, **kwargs)
        self.cross_attention = cross_attention
        self.normalization = normalization
        self.use_bias = use_bias
        self.rope_max_wavelength = rope_max_wavelength

    def _attention(self, hidden_dim, name):
        # Rotary positions and the window are the self-attention's: cross-attention sees the whole memory.
        own = name == "self_attention"
        return super()._attention(hidden_dim, name, use_bias=self.use_bias, window=self.window if own else None,
                                  rope_max_wavelength=self.rope_max_wavelength if own else None)

    def _norm(self, name):
        if self.normalization == "rms":
            return RMSNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)
        return LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)

    def _feedforward(self, hidden_dim):
        if self.use_bias:
            return super()._feedforward(hidden_dim)
        return GatedFeedForward(hidden_dim, self.intermediate_dim, use_bias=False,
                                kernel_initializer=self.kernel_initializer, dtype=self.dtype_policy, name="feedforward")

    def build(self, inputs_shape, encoder_outputs_shape=None):
        self._build_common(inputs_shape)
        if self.cross_attention:
            encoder_outputs_shape = encoder_outputs_shape or inputs_shape
            self.cross_attention_layer = self._attention(inputs_shape[-1], "cross_attention")
            self.cross_attention_layer.build(inputs_shape, encoder_outputs_shape)
            self.cross_attention_norm = self._norm("cross_attention_norm")
            self.cross_attention_norm.build(inputs_shape)
        self.built = True

    def compute_cross_attention_cache(self, encoder_outputs):
        """Keys/values of the encoder output for cross-attention, `(B, 2, K, S, H)`."""
        return self.cross_attention_layer.compute_cache(encoder_outputs)

    def call(
        self,
        inputs,
        encoder_outputs=None,
        padding_mask=None,
        encoder_padding_mask=None,
        attention_mask=None,
        use_causal_mask=True,
        cache=None,
        cache_index=None,
        cross_attention_cache=None,
        training=None,
        return_attention_scores=False,
        plan=None,
    ):
        self._check_call(inputs, encoder_outputs, padding_mask, encoder_padding_mask, attention_mask, cache,
                         cache_index, cross_attention_cache)

        # Causal self-attention block.
        self_mask = masks_lib.merge_masks(masks_lib.key_mask(padding_mask), attention_mask)
        x, extra = self._sublayer(
            inputs,
            self.self_attention_norm,
            lambda h: self.self_attention(
                h,
                h,
                attention_mask=self_mask,
                use_causal_mask=use_causal_mask,
                return_attention_scores=return_attention_scores and not self.cross_attention,
                cache=cache,
                cache_index=cache_index,
                training=training,
                plan=plan,
            ),
            training,
        )
        scores = extra[0] if return_attention_scores and not self.cross_attention else None
        cache = extra[-1] if cache is not None else None

        # Cross-attention block.
        if self.cross_attention:
            memory = inputs if encoder_outputs is None else encoder_outputs  # ignored with a cross cache
            x, extra = self._sublayer(
                x,
                self.cross_attention_norm,
                lambda h: self.cross_attention_layer(
                    h,
                    memory,
                    attention_mask=masks_lib.key_mask(encoder_padding_mask),
                    return_attention_scores=return_attention_scores,
                    cache=cross_attention_cache,
                    training=training,
                    plan=plan,
                ),
                training,
            )
            if return_attention_scores:
                scores = extra[0]

        # Feed-forward block.
        x, _ = self._sublayer(x, self.feedforward_norm, lambda h: self.feedforward(h, training=training, plan=plan),
                              training)

        result = (x,)
        if return_attention_scores:
            result += (scores,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result

    def _check_call(self, inputs, encoder_outputs, padding_mask, encoder_padding_mask, attention_mask, cache,
                    cache_index, cross_attention_cache):
        if self.cross_attention and encoder_outputs is None and cross_attention_cache is None:
            raise ValueError("This DecoderBlock has cross_attention=True: pass `encoder_outputs` (or "
                             "`cross_attention_cache`).")
        if cache is not None and cache_index is None:
            raise ValueError("`cache_index` is required with `cache` (the position of the first new token).")
        check_sequences(inputs=inputs, encoder_outputs=encoder_outputs)
        batch, length = inputs.shape[:2]
        slots = length if cache is None else None  # with a cache: its slots
        masks_lib.check_mask("padding_mask", padding_mask, "(B, T)" if cache is None else "(B, S_max)", (batch, slots),
                             exact=(1,))
        masks_lib.check_mask("attention_mask", attention_mask, "(B, T, T)", (batch, length, slots))
        memory = None if encoder_outputs is None else encoder_outputs.shape[1]
        masks_lib.check_mask("encoder_padding_mask", encoder_padding_mask, "(B, S)", (batch, memory), exact=(1,))

    def compute_output_spec(self, inputs, encoder_outputs=None, padding_mask=None, encoder_padding_mask=None,
                            attention_mask=None, use_causal_mask=True, cache=None, cache_index=None,
                            cross_attention_cache=None, training=None, return_attention_scores=False, plan=None):
        # As EncoderBlock's: the residual stream keeps the input's shape; scores and caches are traced.
        if return_attention_scores or cache is not None:
            return super(EncoderBlock, self).compute_output_spec(
                inputs, encoder_outputs=encoder_outputs, padding_mask=padding_mask,
                encoder_padding_mask=encoder_padding_mask, attention_mask=attention_mask,
                use_causal_mask=use_causal_mask, cache=cache, cache_index=cache_index,
                cross_attention_cache=cross_attention_cache, training=training,
                return_attention_scores=return_attention_scores, plan=plan)
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"cross_attention": self.cross_attention, "normalization": self.normalization,
                       "use_bias": self.use_bias, "rope_max_wavelength": self.rope_max_wavelength})
        return config
