"""Decoding for speech encoder-decoders (Whisper) as faster-whisper/CTranslate2 decode them: from a prompt of special
tokens, with `suppress_ids` masked at every step and `suppress_ids_begin` (blank, end of text) at the first."""

import numpy as np
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.generation import samplers
from tfformer.generation.beam import BeamSampler
from tfformer.generation.decode import cached_function, decode_next

# Whisper's <|endoftext|>, and the prompt of the English-only models without timestamps.
WHISPER_END_ID = 50256
WHISPER_PROMPT = (50257, 50362)


def whisper_sampler(beam_size=1, length_penalty=1.0, patience=1.0):
    """faster-whisper's search for `beam_size` (its defaults: 5, 1, 1): greedy for 1, as CTranslate2, else
    CTranslate2's beam search."""
    check_int("beam_size", beam_size)
    return samplers.GreedySampler() if beam_size == 1 else BeamSampler(beam_size, length_penalty, "length", patience)


def _check_ids(name, ids, vocabulary_size, allow_empty=True):
    ids = [int(i) for i in ids]
    if (not ids and not allow_empty) or any(not 0 <= i < vocabulary_size for i in ids):
        raise ValueError(f"`{name}` must be {'' if allow_empty else 'a non-empty list of '}ids in "
                         f"[0, vocabulary_size={vocabulary_size}). Received: {name}={ids!r}")
    return ids


def speech_decode_fn(model, max_new_tokens, prompt=WHISPER_PROMPT, suppress_ids=(), suppress_ids_begin=(),
                     end_id=WHISPER_END_ID, sampler=None):
    """The (untraced) decoding function `input_features (B, F, M) -> ids (B, max_new_tokens)` of a Whisper `model`.

    The `prompt` goes through the decoder in one step, then each step feeds the previous token; `suppress_ids` get
    -inf logits at every step, `suppress_ids_begin` at the first. `sampler`: a `Sampler` or what `samplers.get` takes
    (`whisper_sampler`: faster-whisper's). A row stops at `end_id`, which fills the slots after it."""
    vocabulary_size, limit = model.config.vocabulary_size, model.config.max_sequence_length
    prompt = _check_ids("prompt", prompt, vocabulary_size, allow_empty=False)
    check_int("max_new_tokens", max_new_tokens)
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(f"The prompt ({len(prompt)} ids) plus `max_new_tokens` must be at most "
                         f"max_sequence_length={limit}. Received: max_new_tokens={max_new_tokens}")
    check_int("end_id", end_id, minimum=0, maximum=vocabulary_size - 1, numpy=True,
              expected=f"an id in [0, vocabulary_size={vocabulary_size})")
    end_id, sampler, prompt_length = int(end_id), samplers.get(sampler), len(prompt)
    every_step = np.zeros([vocabulary_size], np.float32)  # (V,), added to the logits
    every_step[_check_ids("suppress_ids", suppress_ids, vocabulary_size)] = -np.inf
    first_step = every_step.copy()
    first_step[_check_ids("suppress_ids_begin", suppress_ids_begin, vocabulary_size)] = -np.inf
    beams = sampler.beams

    def run(input_features):
        batch = tf.shape(input_features)[0]
        encoder_outputs, encoder_mask = model.encode(input_features)  # (B, S, D)
        cross = tuple(tf.unstack(model.cross_attention_caches(encoder_outputs)))  # L x (B, 2, K, S, H)
        if beams > 1:  # each row's beams adjacent, (B*beams, ...)
            cross = tuple(tf.repeat(layer, beams, axis=0) for layer in cross)
            encoder_mask = None if encoder_mask is None else tf.repeat(encoder_mask, beams, axis=0)
        # Per-layer caches (a tuple): decode_step then returns them without re-stacking.
        cache = tuple(tf.unstack(model.empty_cache(batch * beams, prompt_length + max_new_tokens, cross[0].dtype)))
        prompt_ids = tf.tile(tf.constant([prompt], tf.int32), [batch * beams, 1])  # (B*beams, P)
        logits, cache = model.decode_step(prompt_ids, cache, 0, cross, encoder_mask)  # (B*beams, P, V)
        # Column c of the output is position P + c: the prompt's logits pick column 0, and the step at cache
        # index P + c feeds it. `tokens` holds one row per input, `(B, N)`, also for beam search.
        return sampler.run(decode_next(model, cross, encoder_mask, bias=every_step),
                           tf.fill([batch, max_new_tokens], end_id), cache, prompt_length, end_id, max_new_tokens,
                           column=0, logits=logits[:, -1, :] + first_step, fill=end_id)

    return run


def transcribe_ids(model, input_features, max_new_tokens=None, prompt=WHISPER_PROMPT, suppress_ids=(),
                   suppress_ids_begin=(), end_id=WHISPER_END_ID, sampler=None, jit_compile=False):
    """`speech_decode_fn`'s ids `(B, max_new_tokens)` int32 numpy for log-mel features `(B, F, M)`, compiled once
    per set of options; `max_new_tokens` defaults to what fits the decoder after the prompt."""
    if max_new_tokens is None:
        max_new_tokens = model.config.max_sequence_length - len(prompt)
    sampler = samplers.get(sampler)
    key = ("speech", max_new_tokens, tuple(prompt), tuple(suppress_ids), tuple(suppress_ids_begin), end_id,
           sampler.key(), bool(jit_compile))

    def make():
        run = speech_decode_fn(model, max_new_tokens, prompt, suppress_ids, suppress_ids_begin, end_id, sampler)
        spec = tf.TensorSpec([None, None, model.config.num_mel_bins], tf.float32)
        return tf.function(run, input_signature=[spec], jit_compile=bool(jit_compile))

    features = tf.convert_to_tensor(input_features, tf.float32)
    if features.shape.rank != 3 or features.shape[-1] != model.config.num_mel_bins:
        raise ValueError(f"`input_features` must be (batch, frames, num_mel_bins={model.config.num_mel_bins}). "
                         f"Received: shape={tuple(features.shape)}")
    return cached_function(model, key, make)(features).numpy()
