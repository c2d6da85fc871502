import keras
from keras import ops

from tfformer import layers
from tfformer.layers.layer_utils import apply_dense, uncast
from tfformer.models import base


@keras.saving.register_keras_serializable(package="tfformer")
class CausalLM(base.TransformerModel):
    """A GPT-style decoder-only language model.

    Input: `{"token_ids": (B, T) int32}`, id 0 = padding (right padding; padded
    keys are masked). Output: next-token logits `(B, T, V)` in float32, from the
    tied token embedding when `tie_embeddings`. Position `t` depends only on
    tokens `<= t`.

    Llama-style models (SmolLM2) take `position="rotary"` (rotary positions on
    q and k in every self-attention, no position embedding), `normalization="rms"`
    and `use_bias=False` (gated feed-forward, no projection biases).
    """

    def _build(self, config):
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, name="token_embedding"
        )
        output_projection = None
        if not config.tie_embeddings:
            output_projection = keras.layers.Dense(
                config.vocabulary_size,
                use_bias=config.use_bias,
                kernel_initializer=base.kernel_initializer(config),
                dtype="float32",
                name="output_projection",
            )
        # Rotary positions live in the attention layers: no position added to the embeddings.
        position = None if config.position == "rotary" else base.position_layer(config, "position")
        dropout = layers.Dropout(config.dropout, name="embedding_dropout")
        variants = dict(
            normalization=config.normalization,
            use_bias=config.use_bias,
            rope_max_wavelength=config.rope_max_wavelength if config.position == "rotary" else None,
        )
        blocks = base.decoder_blocks(config, **variants, cross_attention=False)
        norm = base.final_norm(config, "final_norm")

        # === Functional model ===
        token_ids = base.token_ids_input("token_ids")
        padding_mask = base.padding_mask_of(token_ids)  # (B, T)
        x = dropout(_embed(token_embedding, position, token_ids))  # (B, T, D)
        for block in blocks:
            x = block(x, padding_mask=padding_mask)
        if norm:
            x = norm(x)
        logits = token_embedding(x, reverse=True) if output_projection is None else output_projection(x)  # (B, T, V)

        sublayers = dict(
            token_embedding=token_embedding,
            output_projection=output_projection,
            position=position,
            decoder_blocks=blocks,
            final_norm=norm,
            projection_inputs=x if output_projection is None else None,  # (B, T, D)
        )
        return {"token_ids": token_ids}, logits, sublayers

    # === Incremental decoding ===
    def empty_cache(self, batch_size, max_length, dtype="float32"):
        """A zero key/value cache `(L, B, 2, K, max_length, H)`, `K` the key/value heads."""
        c = self.config
        return ops.zeros((c.num_decoder_layers, batch_size, 2, c.key_value_heads, max_length, c.head_dim), dtype=dtype)

    def decode_step(self, token_ids, cache, cache_index, last_only=False, logits_index=None, plan=None):
        """Logits `(B, T, V)` for `token_ids` `(B, T)` at positions `cache_index...`, and the updated cache.

        With `last_only=True` only the last position's logits are computed, `(B, 1, V)`: what a prefill
        needs (the vocabulary projection of a whole prompt is most of a prefill's cost). `logits_index`
        (an int scalar, may be a tensor) computes only the logits at that index of `token_ids`, `(B, 1, V)`:
        for a prefill of a whole right-padded prompt, where slicing the prompt to a computed length would
        make XLA compile once per prompt. `plan`: a decode plan (`generation.plan.DecodePlan`) for the layers, the
        fast forms of a step inside a compiled decode loop.
        """
        if last_only and logits_index is not None:
            raise ValueError(f"Pass `last_only` or `logits_index`, not both. Received: last_only=True, "
                             f"logits_index={logits_index!r}")
        x = _embed(self.token_embedding, self.position, token_ids, start_index=cache_index)  # (B, T, D)
        caches = []
        # A stacked (L, ...) cache, or a tuple of per-layer caches, stacked or split (`split_cache`; cheaper inside
        # decode loops: no re-stacking).
        per_layer = isinstance(cache, (list, tuple))
        for i, block in enumerate(self.decoder_blocks):
            # A split pair as a SplitCache: kept in its dtype (Keras casts a tuple's tensors to the compute dtype).
            x, layer_cache = block(x, cache=uncast(cache[i]), cache_index=cache_index, plan=plan)
            caches.append(layer_cache)
        if logits_index is not None:
            x = ops.take(x, ops.reshape(logits_index, (1,)), axis=1)  # (B, T, D) -> (B, 1, D)
        elif last_only:
            x = x[:, -1:]  # (B, 1, D)
        if self.final_norm:
            x = self.final_norm(x)
        if self.output_projection is None:
            logits = self.token_embedding(x, reverse=True, plan=plan)
        else:
            logits = apply_dense(self.output_projection, x, plan)  # the plan's kernel layout in decode loops
        return logits, (tuple(caches) if per_layer else ops.stack(caches))


def _embed(token_embedding, position, token_ids, start_index=0):
    """Token embeddings plus positions, or alone when the positions are rotary (`position` None), `(B, T, D)`."""
    if position is None:
        return token_embedding(token_ids)
    return base.embed_tokens(token_embedding, position, token_ids, start_index=start_index)


def build_causal_lm(config):
    """Build a GPT-style decoder-only LM from a `TransformerConfig` (or dict)."""
    config = base.as_config(config)
    if config.architecture != "causal_lm":
        config = config.replace(architecture="causal_lm")
    return CausalLM(config)
