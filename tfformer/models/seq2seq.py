import keras
from keras import ops

from tfformer import generation, layers
from tfformer.checks import check_int
from tfformer.data import placeholders
from tfformer.layers.layer_utils import apply_dense, uncast
from tfformer.models import base, task


@keras.saving.register_keras_serializable(package="tfformer")
class Seq2SeqTransformer(base.TransformerModel):
    """The encoder-decoder Transformer of "Attention Is All You Need".

    Inputs: `{"encoder_token_ids": (B, S) int32, "decoder_token_ids": (B, T) int32}`,
    id 0 = padding (masks are derived from it). Output: logits `(B, T, V)` float32.
    Position `t` of the logits depends only on decoder tokens `<= t`.

    With `tie_embeddings` one matrix embeds source and target tokens and is the
    pre-softmax projection (the paper's three-way sharing).
    """

    def _build(self, config, dtype):
        init = base.kernel_initializer(config)
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, dtype=dtype,
            name="token_embedding",
        )
        if config.tie_embeddings:
            decoder_embedding, output_projection = token_embedding, None
        else:
            decoder_embedding = layers.TokenEmbedding(
                config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, dtype=dtype,
                name="decoder_token_embedding",
            )
            output_projection = keras.layers.Dense(
                config.vocabulary_size, kernel_initializer=init, dtype="float32", name="output_projection"
            )
        encoder_position = base.position_layer(config, "encoder_position", dtype)
        decoder_position = base.position_layer(config, "decoder_position", dtype)
        (encoder_dropout, decoder_dropout, encoder_blocks, decoder_blocks, encoder_norm,
         decoder_norm) = base.encoder_decoder_stacks(config, dtype)

        # === Functional model ===
        encoder_ids = base.token_ids_input("encoder_token_ids")
        decoder_ids = base.token_ids_input("decoder_token_ids")
        encoder_mask = base.padding_mask_of(encoder_ids)  # (B, S)
        decoder_mask = base.padding_mask_of(decoder_ids)  # (B, T)

        x = encoder_dropout(base.embed_tokens(token_embedding, encoder_position, encoder_ids))  # (B, S, D)
        for block in encoder_blocks:
            x = block(x, padding_mask=encoder_mask)
        encoder_outputs = encoder_norm(x) if encoder_norm else x

        y = decoder_dropout(base.embed_tokens(decoder_embedding, decoder_position, decoder_ids))  # (B, T, D)
        for block in decoder_blocks:
            y = block(y, encoder_outputs, padding_mask=decoder_mask, encoder_padding_mask=encoder_mask)
        if decoder_norm:
            y = decoder_norm(y)
        logits = token_embedding(y, reverse=True) if output_projection is None else output_projection(y)  # (B, T, V)

        inputs = {"encoder_token_ids": encoder_ids, "decoder_token_ids": decoder_ids}
        sublayers = dict(
            token_embedding=token_embedding,
            decoder_token_embedding=decoder_embedding,
            output_projection=output_projection,
            encoder_position=encoder_position,
            decoder_position=decoder_position,
            encoder_blocks=encoder_blocks,
            decoder_blocks=decoder_blocks,
            encoder_norm=encoder_norm,
            decoder_norm=decoder_norm,
            hidden_states=y,  # (B, T, D)
            projection_inputs=y if output_projection is None else None,  # (B, T, D)
        )
        return inputs, logits, sublayers

    # === Strings in, strings out ===
    def generate(self, inputs, max_new_tokens=None, beam_size=None, length_penalty=0.6, sampler=None,
                 batch_size=64, protect_placeholders=True, jit_compile=True):
        """Translate (or otherwise transduce) source texts.

        Args:
            inputs: a str or a list of str (tokenized by the preprocessor), or source ids `(B, S)`.
            max_new_tokens: int > 0, or None for `max_sequence_length`.
            beam_size: int or None. Beam search with the GNMT `length_penalty` instead of the sampler.
            sampler: a `tfformer.generation.Sampler` (e.g. `TopKSampler(k=5)`), "greedy", "temperature" or None
                (greedy).
            batch_size: texts per decoding call.
            protect_placeholders: bool. Mask printf conversions, brace fields, tags, accelerators and edge
                whitespace before the model and put them back after (`tfformer.data.placeholders`), as the
                exported SavedModel does: each output keeps them exactly.
            jit_compile: bool. Decode with XLA; False runs the graph an exported SavedModel holds.

        Returns:
            A str for a str, a list of str for a list, new ids `(B, max_new_tokens)` for ids.
        """
        if max_new_tokens is None:
            max_new_tokens = self.config.max_sequence_length
        if task.is_token_ids(inputs):
            return generation.generate_ids(self, inputs, max_new_tokens, sampler, beam_size, length_penalty,
                                           jit_compile=jit_compile, end_id=self.end_ids[0])
        # Protected, a blank text is its own translation (its whitespace is kept, nothing goes to the model).
        texts, single = task.as_texts(inputs, "inputs", allow_blank=protect_placeholders)
        check_int("batch_size", batch_size)
        masked = [placeholders.mask(text) if protect_placeholders else None for text in texts]
        todo = [i for i, m in enumerate(masked) if m is None or m.translatable]
        sources = [texts[i] if masked[i] is None else masked[i].text for i in todo]
        outputs = []
        for start in range(0, len(sources), batch_size):
            new_ids = generation.generate_ids(self, self.tokenize(sources[start:start + batch_size]), max_new_tokens,
                                              sampler, beam_size, length_penalty, jit_compile=jit_compile,
                                              end_id=self.end_ids[0])
            outputs += self.detokenize(new_ids)
        by_index = dict(zip(todo, outputs))
        results = [by_index.get(i, "") if m is None else placeholders.restore(m, by_index.get(i, ""))
                   for i, m in enumerate(masked)]
        return results[0] if single else results

    def translate(self, inputs, **kwargs):
        """`generate`, under the name translators look for."""
        return self.generate(inputs, **kwargs)

    # === Incremental decoding ===
    def encode(self, encoder_token_ids):
        """Encoder outputs `(B, S, D)` and the source padding mask `(B, S)` (inference mode)."""
        mask = base.padding_mask_of(encoder_token_ids)
        x = base.embed_tokens(self.token_embedding, self.encoder_position, encoder_token_ids)
        for block in self.encoder_blocks:
            x = block(x, padding_mask=mask)
        return (self.encoder_norm(x) if self.encoder_norm else x), mask

    def cross_attention_caches(self, encoder_outputs):
        """Per-layer cross-attention keys/values of the encoder output, `(L, B, 2, K, S, H)`."""
        return ops.stack([block.compute_cross_attention_cache(encoder_outputs) for block in self.decoder_blocks])

    empty_cache = base.empty_cache  # (batch_size, max_length, dtype="float32") -> zeros (L, B, 2, K, T, H)

    def decode_step(self, token_ids, cache, cache_index, cross_caches, encoder_padding_mask, plan=None,
                    last_only=False):
        """Logits `(B, T, V)` for `token_ids` `(B, T)` at positions `cache_index...`, and the updated cache.

        `cross_caches`: per layer, the read-only cache of `cross_attention_caches` `(B, 2, K, S, H)` or its keys and
        values as a pair `((B, K, S, H), (B, K, S, H))`, which a decode loop reads without a copy per step. With
        `last_only=True` only the last position's logits are computed, `(B, 1, V)`: what a prompt pass needs (as
        `CausalLM.decode_step`'s).
        `plan`: a decode plan (`generation.plan.DecodePlan`) for the layers, the fast forms of a step inside a
        compiled decode loop.
        """
        y = base.embed_tokens(self.decoder_token_embedding, self.decoder_position, token_ids, start_index=cache_index)
        caches = []
        # A stacked (L, ...) cache, or a tuple of per-layer caches, stacked or split (`split_cache`; cheaper inside
        # decode loops: no re-stacking).
        per_layer = isinstance(cache, (list, tuple))
        for i, block in enumerate(self.decoder_blocks):
            y, layer_cache = block(
                y,
                encoder_padding_mask=encoder_padding_mask,
                cache=uncast(cache[i]),  # a split pair: kept in its dtype (SplitCache)
                cache_index=cache_index,
                cross_attention_cache=uncast(cross_caches[i]),  # a pair: read in place
                plan=plan,
            )
            caches.append(layer_cache)
        if last_only:
            y = y[:, -1:]  # (B, 1, D)
        if self.decoder_norm:
            y = self.decoder_norm(y)
        if self.output_projection is None:
            logits = self.token_embedding(y, reverse=True, plan=plan)
        else:
            logits = apply_dense(self.output_projection, y, plan)  # the plan's kernel layout in decode loops
        return logits, (tuple(caches) if per_layer else ops.stack(caches))


def build_seq2seq(config, dtype=None):
    """Build the paper's encoder-decoder Transformer from a `TransformerConfig` (or dict). `dtype`: the
    dtype policy of every layer (`TransformerModel`'s `dtype`; None: the global one)."""
    config = base.as_config(config)
    if config.architecture != "seq2seq":
        config = config.replace(architecture="seq2seq")
    return Seq2SeqTransformer(config, dtype=dtype)
