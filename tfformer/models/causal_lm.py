import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfformer import generation, layers
from tfformer.checks import check_int, check_messages
from tfformer.generation.decode import cached_function
from tfformer.layers.layer_utils import apply_dense, uncast
from tfformer.models import base, task
from tfformer.tokens import PAD_ID


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

    def _build(self, config, dtype):
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, dtype=dtype,
            name="token_embedding",
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
        position = None if config.position == "rotary" else base.position_layer(config, "position", dtype)
        dropout = layers.Dropout(config.dropout, dtype=dtype, name="embedding_dropout")
        variants = dict(
            normalization=config.normalization,
            use_bias=config.use_bias,
            rope_max_wavelength=config.rope_max_wavelength if config.position == "rotary" else None,
        )
        blocks = base.decoder_blocks(config, dtype, **variants, cross_attention=False)
        norm = base.final_norm(config, "final_norm", dtype)

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
            hidden_states=x,  # (B, T, D)
            projection_inputs=x if output_projection is None else None,  # (B, T, D)
        )
        return {"token_ids": token_ids}, logits, sublayers

    # === Strings in, strings out ===
    def generate(self, inputs, max_new_tokens=32, sampler=None, beam_size=None, length_penalty=0.6, jit_compile=True,
                 prefill_jit_compile=None):
        """Continue prompts.

        Args:
            inputs: a str or a list of str (tokenized by the preprocessor), or right-padded prompt ids `(B, L)`.
            max_new_tokens: int > 0. Tokens to generate after each prompt.
            sampler: a `tfformer.generation.Sampler` (e.g. `TopKSampler(k=5)`), "greedy", "temperature" or None
                (greedy).
            beam_size: int or None. Beam search with the GNMT `length_penalty` instead of the sampler.
            jit_compile: bool. Decode with XLA (`generation.generate_ids`).
            prefill_jit_compile: bool or None. With `jit_compile`, whether the prompts' pass runs under XLA too, or
                in TensorFlow's graph runtime before the XLA decode loop. None: `prefill_jit_compile_for_policy()`.

        Returns:
            The continuations without the prompt: a str for a str, a list of str for a list, new ids
            `(B, max_new_tokens)` for ids. Generation stops at the preprocessor's end token (`end_ids`) and at id 0,
            padding to the model (SmolLM2's `<|endoftext|>`); ids after it are 0.
        """
        if prefill_jit_compile is None:
            prefill_jit_compile = jit_compile and self.prefill_jit_compile_for_policy()
        options = dict(jit_compile=jit_compile, end_id=self.end_ids[0], prefill_jit_compile=prefill_jit_compile)
        if task.is_token_ids(inputs):
            new_ids = generation.generate_ids(self, inputs, max_new_tokens, sampler, beam_size, length_penalty,
                                              **options)
            # A generated id 0 ends its row, as in the exported files: the model reads it as padding.
            return tf.where(tf.cumsum(tf.cast(new_ids == PAD_ID, tf.int32), axis=1) > 0, PAD_ID, new_ids)
        texts, single = task.as_texts(inputs, "inputs")
        new_ids = generation.generate_ids(self, self.tokenize(texts), max_new_tokens, sampler, beam_size,
                                          length_penalty, **options)
        outputs = self.detokenize(new_ids)
        return outputs[0] if single else outputs

    def prefill_jit_compile_for_policy(self):
        """Whether `generate` runs the prompts' pass under XLA with the decode loop: not under a bfloat16 compute
        dtype. XLA's CPU backend multiplies bfloat16 at about the float32 rate; TensorFlow's graph runtime (oneDNN)
        uses the CPU's bfloat16 units, so a long prompt is read faster there."""
        return self.compute_dtype != "bfloat16"

    def chat(self, messages, max_new_tokens=256, sampler=None, stream=False, jit_compile=True, **template_variables):
        """The assistant's reply to `messages` (a list of `{"role": str, "content": str}`), rendered with the
        preprocessor's chat template (`BytePairTokenizer.apply_chat_template`). With `stream=True`, a generator of
        the reply's text pieces as they are produced (`stream`)."""
        tokenizer = self.require_preprocessor("chat")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"`chat` needs a preprocessor with a chat template; this {type(self).__name__}'s "
                             f"{type(tokenizer).__name__} has none. Use `generate`.")
        check_messages(messages)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_variables)
        if stream:
            return self.stream(prompt, max_new_tokens=max_new_tokens, sampler=sampler)
        return self.generate(prompt, max_new_tokens=max_new_tokens, sampler=sampler, jit_compile=jit_compile)

    def stream(self, prompt, max_new_tokens=256, sampler=None):
        """Continue one prompt (a str), yielding the continuation's text piece by piece as tokens are produced.

        The same tokens as `generate(prompt, jit_compile=False)` with the same sampler: the prompt goes through
        `decode_step` in one pass, then one compiled step per token on the key/value cache. A piece is yielded when
        its bytes form whole characters; generation stops at the end token or after `max_new_tokens`. The arguments
        are checked when it is called, before the first piece is asked for.
        """
        prompts, _ = task.as_texts([prompt] if isinstance(prompt, str) else prompt, "prompt")
        if len(prompts) != 1:
            raise ValueError(f"`prompt` must be one string: `stream` continues one prompt (`generate` takes several). "
                             f"Received {len(prompts)} prompts.")
        (prompt,) = prompts
        sampler = generation.samplers.get(sampler)
        if sampler.beams > 1:
            raise ValueError(f"`sampler` must pick one token a step: `stream` yields one row (beam search needs the "
                             f"whole search; use `generate`). Received: sampler={sampler!r}")
        ids = self.tokenize([prompt])  # (1, L)
        length = ids.shape[1]
        check_int("max_new_tokens", max_new_tokens)
        if length + max_new_tokens > self.config.max_sequence_length:
            raise ValueError(f"Prompt of {length} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"max_sequence_length={self.config.max_sequence_length}; shorten the prompt or ask for "
                             "fewer tokens.")
        return self._pieces(ids, max_new_tokens, sampler)

    def _pieces(self, ids, max_new_tokens, sampler):
        """`stream`'s generator of text pieces for the prompt ids `(1, L)`."""
        length = ids.shape[1]
        step = self._stream_step()
        cache = self.empty_cache(1, length + max_new_tokens, self.compute_dtype)  # (L, 1, 2, K, T, H)
        logits, cache = step(ids, cache, tf.constant(0))  # (1, L, V): the whole prompt
        new_ids, shown = [], ""
        for i in range(max_new_tokens):
            token = int(sampler.get_next_token(logits[:, -1, :], tf.constant(length + i))[0])
            if token in self.end_ids or token == PAD_ID:  # id 0 is padding to the model, an end in `generate`
                break
            new_ids.append(token)
            text = self.detokenize([new_ids])[0]
            if not text.endswith("\ufffd"):  # a character's bytes may span tokens: wait for the rest
                yield text[len(shown):]
                shown = text
            if i + 1 < max_new_tokens:
                logits, cache = step(np.array([[token]], np.int32), cache, tf.constant(length + i))  # (1, 1, V)

    def _stream_step(self):
        """`decode_step` as a `tf.function`, kept with the generate functions (`compile` drops them); no XLA: each
        prompt length would compile. Traced once, for any number of tokens and any cache length: the shapes that
        `reduce_retracing` reached only after tracing a prompt's pass, then its steps, then a new cache length
        (each trace of SmolLM2-135M's 30 layers takes seconds)."""
        c = self.config
        signature = [tf.TensorSpec([1, None], tf.int32),  # (1, T) ids
                     tf.TensorSpec([c.num_decoder_layers, 1, 2, c.key_value_heads, None, c.head_dim],
                                   self.compute_dtype),  # (L, 1, 2, K, S, H) cache
                     tf.TensorSpec([], tf.int32)]  # the cache index
        return cached_function(self, ("stream_step",), lambda: tf.function(
            lambda ids, cache, index: self.decode_step(ids, cache, index), input_signature=signature))

    # === Incremental decoding ===
    empty_cache = base.empty_cache  # (batch_size, max_length, dtype="float32") -> zeros (L, B, 2, K, T, H)

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
        x = _embed(self.token_embedding, self.position, token_ids, start_index=cache_index, plan=plan)  # (B, T, D)
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


def _embed(token_embedding, position, token_ids, start_index=0, plan=None):
    """Token embeddings plus positions, or alone when the positions are rotary (`position` None), `(B, T, D)`;
    `plan`: a decode plan (`layer_utils`) for the lookup."""
    if position is None:
        return token_embedding(token_ids, plan=plan)
    return base.embed_tokens(token_embedding, position, token_ids, start_index=start_index, plan=plan)


def build_causal_lm(config, dtype=None):
    """Build a GPT-style decoder-only LM from a `TransformerConfig` (or dict). `dtype`: the
    dtype policy of every layer (`TransformerModel`'s `dtype`; None: the global one)."""
    config = base.as_config(config)
    if config.architecture != "causal_lm":
        config = config.replace(architecture="causal_lm")
    return CausalLM(config, dtype=dtype)
