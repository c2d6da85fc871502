"""Decoding for speech encoder-decoders (Whisper): a prompt of special tokens and token suppression.

`generate_ids` starts every sequence from one start id and never masks a token; Whisper starts from a prompt
(`<|startoftranscript|>` `<|notimestamps|>` for tiny.en) and, as faster-whisper/CTranslate2 decode it,
suppresses `suppress_ids` at every step and `suppress_ids_begin` (blank, end of text) at the first: the set-up
prefills the prompt, and the `next` callback of the sampler's loop (`Sampler.run`, `BeamSampler.run`) adds the
suppression to each step's logits. `whisper_sampler` picks faster-whisper's search for a beam size: greedy for
1, else CTranslate2's beam search (finished hypotheses set aside, `patience`, scores divided by
`length ** length_penalty`).
"""

import numpy as np
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.generation.decode import cached_function
from tfformer.generation.beam import BeamSampler
from tfformer.generation import samplers

# Whisper's <|endoftext|>, and the prompt of the English-only models without timestamps.
WHISPER_END_ID = 50256
WHISPER_PROMPT = (50257, 50362)


def whisper_sampler(beam_size=1, length_penalty=1.0, patience=1.0):
    """faster-whisper's search for `beam_size` (its `transcribe(beam_size=5, length_penalty=1, patience=1)`):
    `GreedySampler()` for 1 (CTranslate2 decodes greedily then), else `BeamSampler(beam_size, length_penalty,
    normalization="length", patience=patience)`."""
    check_int("beam_size", beam_size)
    if beam_size == 1:
        return samplers.GreedySampler()
    return BeamSampler(beam_size, length_penalty, normalization="length", patience=patience)


def _check_ids(name, ids, vocabulary_size, allow_empty=True):
    ids = [int(i) for i in ids]
    if (not ids and not allow_empty) or any(not 0 <= i < vocabulary_size for i in ids):
        raise ValueError(f"`{name}` must be {'' if allow_empty else 'a non-empty list of '}ids in "
                         f"[0, vocabulary_size={vocabulary_size}). Received: {name}={ids!r}")
    return ids


def _suppression(ids, vocabulary_size):
    """`(V,)` float32: -inf at `ids`, 0 elsewhere, added to the logits."""
    bias = np.zeros([vocabulary_size], np.float32)
    bias[ids] = -np.inf
    return tf.constant(bias)


def speech_decode_fn(model, max_new_tokens, prompt=WHISPER_PROMPT, suppress_ids=(), suppress_ids_begin=(),
                     end_id=WHISPER_END_ID, sampler=None):
    """The (untraced) decoding function `input_features (B, F, M) -> ids (B, max_new_tokens)` of `model`.

    `model` has Whisper's decode path (`tfformer.models.WhisperModel`): `encode`, `cross_attention_caches`,
    `empty_cache` and `decode_step`. The prompt goes through the decoder in one step; then each step feeds the
    previous token. Before the sampler (greedy by default; a `BeamSampler` searches over `beam_size` copies of
    each row's caches) picks a token, `suppress_ids` get -inf logits at every step and `suppress_ids_begin` at
    the first. Each row stops at `end_id`; slots after it (and the `end_id` itself) hold `end_id`.

    Args:
        model: a Whisper-style encoder-decoder.
        max_new_tokens: int >= 1. Tokens after the prompt; the prompt plus these must fit the decoder's
            `max_sequence_length` positions.
        prompt: the ids every sequence starts with.
        suppress_ids: ids never produced.
        suppress_ids_begin: ids not produced as the first token.
        end_id: int. The end-of-text id.
        sampler: a `generation.Sampler` (`BeamSampler` included; `whisper_sampler` gives faster-whisper's) or
            None (greedy).
    """
    config = model.config
    vocabulary_size = config.vocabulary_size
    prompt = _check_ids("prompt", prompt, vocabulary_size, allow_empty=False)
    check_int("max_new_tokens", max_new_tokens)
    if len(prompt) + max_new_tokens > config.max_sequence_length:
        raise ValueError(f"The prompt ({len(prompt)} ids) plus `max_new_tokens` must be at most "
                         f"max_sequence_length={config.max_sequence_length}. Received: max_new_tokens={max_new_tokens}")
    check_int("end_id", end_id, minimum=0, maximum=vocabulary_size - 1, numpy=True,
              expected=f"an id in [0, vocabulary_size={vocabulary_size})")
    end_id = int(end_id)
    every_step = _suppression(_check_ids("suppress_ids", suppress_ids, vocabulary_size), vocabulary_size)
    first_step = every_step + _suppression(
        _check_ids("suppress_ids_begin", suppress_ids_begin, vocabulary_size), vocabulary_size)
    sampler = samplers.get(sampler)
    beams = sampler.beams
    prompt_length = len(prompt)

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

        def next(ids, cache, index, plan=None):
            logits, cache = model.decode_step(ids, cache, index, cross, encoder_mask, plan=plan)  # (B*beams, 1, V)
            return logits[:, -1, :] + every_step, None, cache  # (B*beams, V)

        # Column c of the output is position P + c: the prompt's logits pick column 0, and the step at cache
        # index P + c feeds it. `tokens` holds one row per input, `(B, N)`, also for beam search.
        return sampler.run(next, tf.fill([batch, max_new_tokens], end_id), cache, prompt_length, end_id,
                           max_new_tokens, column=0, logits=logits[:, -1, :] + first_step, fill=end_id)

    return run


def transcribe_ids(model, input_features, max_new_tokens=None, prompt=WHISPER_PROMPT, suppress_ids=(),
                   suppress_ids_begin=(), end_id=WHISPER_END_ID, sampler=None, jit_compile=False):
    """Generated ids `(B, max_new_tokens)` int32 numpy for log-mel features `(B, F, M)`, after the prompt,
    `end_id`-filled after each row's end (see `speech_decode_fn`; `sampler` as there). The compiled function is
    kept on the model per set of options; `max_new_tokens` defaults to what fits the decoder after the prompt."""
    if max_new_tokens is None:
        max_new_tokens = model.config.max_sequence_length - len(prompt)
    sampler = samplers.get(sampler)
    key = ("speech", max_new_tokens, tuple(prompt), tuple(suppress_ids), tuple(suppress_ids_begin), end_id,
           sampler.key(), bool(jit_compile))

    def make():
        run = speech_decode_fn(model, max_new_tokens, prompt, suppress_ids, suppress_ids_begin, end_id, sampler)
        spec = tf.TensorSpec([None, None, model.config.num_mel_bins], tf.float32)
        return tf.function(run, input_signature=[spec], jit_compile=bool(jit_compile))

    compiled = cached_function(model, key, make)
    features = tf.convert_to_tensor(input_features, tf.float32)
    if features.shape.rank != 3 or features.shape[-1] != model.config.num_mel_bins:
        raise ValueError(f"`input_features` must be (batch, frames, num_mel_bins={model.config.num_mel_bins}). "
                         f"Received: shape={tuple(features.shape)}")
    return compiled(features).numpy()
