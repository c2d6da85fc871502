"""Decoding for speech encoder-decoders (Whisper) as faster-whisper/CTranslate2 decode them: from a prompt of special
tokens, with `suppress_ids` masked at every step and `suppress_ids_begin` (blank, end of text) at the first."""

import numpy as np
import tensorflow as tf

from tfformer import compat
from tfformer.checks import check_int
from tfformer.generation import samplers
from tfformer.generation.beam import BeamSampler
from tfformer.generation.decode import cached_function, decode_next
from tfformer.generation.plan import DecodePlan
from tfformer.timestamps import NONE, TIME_PRECISION, TimestampIds, first_step_bias  # noqa: F401 (re-exported)

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


def _suppression_biases(vocabulary_size, suppress_ids, suppress_ids_begin):
    """`(V,)` float32 biases added to the logits, checked ids at -inf: `suppress_ids` at every step, and also
    `suppress_ids_begin` at the first."""
    every_step = np.zeros([vocabulary_size], np.float32)  # (V,)
    every_step[_check_ids("suppress_ids", suppress_ids, vocabulary_size)] = -np.inf
    first_step = every_step.copy()
    first_step[_check_ids("suppress_ids_begin", suppress_ids_begin, vocabulary_size)] = -np.inf
    return every_step, first_step


def cross_attention_pairs(model, input_features):
    """The encoder's output for log-mel `input_features` `(B, F, M)` as per-layer cross-attention keys and values,
    L x `((B, K, S, H), (B, K, S, H))`: each half a buffer of its own, which every decode step reads in place. A half
    sliced from the stacked `(B, 2, K, S, H)` cache inside the loop is a copy at every step (without XLA, 40% of
    whisper-tiny's step)."""
    encoder_outputs, _ = model.encode(input_features)  # (B, S, D)
    return tuple((layer[:, 0], layer[:, 1]) for layer in tf.unstack(model.cross_attention_caches(encoder_outputs)))


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
    every_step, first_step = _suppression_biases(vocabulary_size, suppress_ids, suppress_ids_begin)
    beams = sampler.beams

    def run(input_features):
        batch = tf.shape(input_features)[0]
        cross = cross_attention_pairs(model, input_features)  # L x 2 x (B, K, S, H)
        if beams > 1:  # each row's beams adjacent, (B*beams, ...)
            cross = tf.nest.map_structure(lambda half: tf.repeat(half, beams, axis=0), cross)
        # Per-layer caches (a tuple): decode_step then returns them without re-stacking.
        cache = tuple(tf.unstack(model.empty_cache(batch * beams, prompt_length + max_new_tokens, cross[0][0].dtype)))
        prompt_ids = tf.tile(tf.constant([prompt], tf.int32), [batch * beams, 1])  # (B*beams, P)
        logits, cache = model.decode_step(prompt_ids, cache, 0, cross, None)  # (B*beams, P, V)
        # Column c of the output is position P + c: the prompt's logits pick column 0, and the step at cache
        # index P + c feeds it. `tokens` holds one row per input, `(B, N)`, also for beam search.
        return sampler.run(decode_next(model, cross, None, bias=every_step),
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


# === Timestamps (Whisper's rules, as CTranslate2's ApplyTimestampRules applies them for faster-whisper) ===
# TIME_PRECISION, TimestampIds, first_step_bias and the host loop's numpy rules live in tfformer.timestamps (no
# TensorFlow), shared with tfformer.edge; the names stay reachable here (models.whisper_decode.TimestampIds).


def timestamp_rules(logits, last, penultimate, last_timestamp, end_id, ids):
    """Whisper's timestamp rules after the first generated token, on `logits` `(B, V)` (suppressions applied).

    `last`, `penultimate` `(B,)`: the last two generated tokens (`penultimate` is `last` after one token);
    `last_timestamp` `(B,)`: the latest timestamp generated. `<|notimestamps|>` never comes; timestamps come in pairs
    (after a pair, text or the end; after a lone timestamp, a timestamp or the end), never decrease, and after text
    the next one is past the latest (no segment of zero length, as CTranslate2's); and when the timestamps' total
    probability beats every other token's, a timestamp must come. Returns the logits with what these rules forbid at
    -inf. `tfformer.timestamps.timestamp_rules` is the same in numpy, for a host loop.
    """
    vocab = tf.range(tf.shape(logits)[-1])[None, :]  # (1, V)
    is_timestamp = vocab >= ids.timestamp_begin
    last_ts = (last >= ids.timestamp_begin)[:, None]  # (B, 1)
    pair = last_ts & (penultimate >= ids.timestamp_begin)[:, None]
    forbid = tf.equal(vocab, ids.no_timestamps) | (pair & is_timestamp) | (last_ts & ~pair & (vocab < end_id))
    lowest = tf.where(last >= ids.timestamp_begin, last_timestamp, last_timestamp + 1)  # (B,): after text, past it
    forbid |= is_timestamp & (vocab < lowest[:, None])
    logits = tf.where(forbid, -np.inf, logits)
    log_probs = tf.nn.log_softmax(logits)  # (B, V)
    timestamp = tf.reduce_logsumexp(tf.where(is_timestamp, log_probs, -np.inf), axis=-1, keepdims=True)  # (B, 1)
    text = tf.reduce_max(tf.where(is_timestamp, -np.inf, log_probs), axis=-1, keepdims=True)  # (B, 1)
    return tf.where(~pair & (timestamp > text) & ~is_timestamp, -np.inf, logits)


def _timestamp_next(model, cross, bias, end_id, ids, step_plan=None):
    """`Sampler.run`'s `next` with the timestamp rules. The cache holds the layers' caches, then the rules' state:
    the last token, the one before, the latest timestamp, the previous step's log-probabilities `(B, V)`, the sum of
    the chosen tokens' log-probabilities and whether a row has ended `(B,)`. Returns log-probabilities as logits
    (the same choice and draws as the logits). `step_plan`: the (prepared) decode plan of every step."""
    layers = len(model.decoder_blocks)

    def next(token_ids, cache, index, plan=None):
        last, penultimate, last_timestamp, previous, score, ended = cache[layers:]
        token = token_ids[:, 0]  # (B,): the token just chosen
        score += tf.where(ended, 0.0, tf.gather(previous, token, batch_dims=1))
        ended |= tf.equal(token, end_id)
        penultimate = tf.where(tf.equal(last, NONE), token, last)
        last_timestamp = tf.where(token >= ids.timestamp_begin, token, last_timestamp)
        logits, layer_caches = model.decode_step(token_ids, cache[:layers], index, cross, None,
                                                  plan=step_plan or plan)
        logits = tf.cast(logits[:, -1, :], tf.float32)  # (B, V)
        if step_plan is not None and step_plan.kernels is not None:
            # Under XLA the vocabulary projection would be fused into each of the rules' reductions over V below and
            # computed again in each: whisper-tiny's step took 25 ms instead of 6.8 (AMD EPYC Zen 2).
            logits, = compat.optimization_barrier(logits)
        logits = timestamp_rules(logits + bias, token, penultimate, last_timestamp, end_id, ids)
        log_probs = tf.nn.log_softmax(logits)  # (B, V)
        return log_probs, None, (*layer_caches, token, penultimate, last_timestamp, log_probs, score, ended)

    return next


def _timestamp_biases(model, ids, suppress_ids, suppress_ids_begin, max_initial_timestamp):
    """`(every_step, first_step)` `(V,)` biases: the suppressions, and at the first step also the initial
    timestamp's limit (`first_step_bias`)."""
    vocabulary_size = model.config.vocabulary_size
    every_step, first_step = _suppression_biases(vocabulary_size, suppress_ids, suppress_ids_begin)
    return every_step, first_step + first_step_bias(vocabulary_size, ids, max_initial_timestamp)


def _timestamp_prompt(model, cross, prompt_ids, slots, first_step, ids, plan=None):
    """The prompt `(B, P)` through the decoder. Returns the per-layer caches (`slots` positions; split pairs when
    `plan` splits them), the first step's log-probabilities `(B, V)` and `<|nospeech|>`'s probability `(B,)` at the
    prompt's last token, `<|startoftranscript|>`."""
    cache = (plan or DecodePlan()).layer_caches(model, tf.shape(prompt_ids)[0], slots, cross[0][0].dtype)
    # The plain forms, on split caches too (a prompt pass reads no laid-out kernel).
    logits, cache = model.decode_step(prompt_ids, cache, 0, cross, None, plan=DecodePlan(), last_only=True)
    logits = tf.cast(logits[:, -1, :], tf.float32)  # (B, 1, V) -> (B, V) at <|startoftranscript|>
    return cache, tf.nn.log_softmax(logits + first_step), tf.nn.softmax(logits)[:, ids.no_speech]


def _timestamp_loop(model, sampler, cross, cache, log_probs, prompt_length, max_new_tokens, every_step, end_id, ids,
                    plan=None):
    """The steps after the prompt: `(ids (B, N), sum_logprobs (B,))`. `plan`: a `DecodePlan` for the steps, its
    kernels laid out (`with_kernels`), or None."""
    batch = tf.shape(log_probs)[0]
    none = tf.fill([batch], NONE)
    state = (none, none, none, log_probs, tf.zeros([batch]), tf.zeros([batch], tf.bool))
    tokens, final = sampler.run_with_cache(
        _timestamp_next(model, cross, every_step, end_id, ids, plan), tf.fill([batch, max_new_tokens], end_id),
        (*cache, *state), prompt_length, end_id, max_new_tokens, column=0, logits=log_probs, fill=end_id)
    return tokens, final[-2]


def timestamp_decode_fn(model, max_new_tokens, ids, suppress_ids=(), suppress_ids_begin=(), end_id=WHISPER_END_ID,
                        sampler=None, max_initial_timestamp=1.0):
    """The (untraced) timestamped decoding `(input_features (B, F, M), prompt_ids (B, P)) -> (ids (B, N), sum_logprobs
    (B,), no_speech_prob (B,))`, N = `max_new_tokens`, as CTranslate2 decodes for faster-whisper.

    The prompt (`<|startofprev|>` previous text ... `<|startoftranscript|>`, without `<|notimestamps|>`) goes through
    the decoder in one step; `suppress_ids` are masked at every step, `suppress_ids_begin` and every token but the
    timestamps up to `max_initial_timestamp` at the first, then `timestamp_rules`. `sum_logprobs` sums the chosen
    tokens' log-probabilities (of the masked logits), the end's included (not the last token's when a row fills all
    N). `no_speech_prob`: the probability of `ids.no_speech` at `<|startoftranscript|>`, the prompt's last token. A
    row stops at `end_id`, which fills the slots after it. `sampler`: greedy (None) or a temperature `Sampler`.
    """
    check_int("max_new_tokens", max_new_tokens)
    sampler = _timestamp_sampler(sampler)
    every_step, first_step = _timestamp_biases(model, ids, suppress_ids, suppress_ids_begin, max_initial_timestamp)

    def run(input_features, prompt_ids):
        prompt_length = tf.shape(prompt_ids)[1]
        cross = cross_attention_pairs(model, input_features)  # L x 2 x (B, K, S, H)
        cache, log_probs, no_speech = _timestamp_prompt(model, cross, prompt_ids, prompt_length + max_new_tokens,
                                                        first_step, ids)
        tokens, score = _timestamp_loop(model, sampler, cross, cache, log_probs, prompt_length, max_new_tokens,
                                        every_step, end_id, ids)
        return tokens, score, no_speech

    return run


def _timestamp_sampler(sampler):
    """`samplers.get(sampler)`, checked: one row per input (no beam search)."""
    sampler = samplers.get(sampler)
    if sampler.beams > 1:
        raise ValueError(f"Timestamped decoding takes beam_size=1 (greedy or sampled). Received: {sampler!r}")
    return sampler


def _timestamp_plan(batch):
    """The `DecodePlan` of `_compiled_timestamp_fns`' loop for `batch` rows."""
    if batch == 1:
        return DecodePlan("rows", in_place_cache_writes=True, cache_segments=1, transposed_embeddings=True)
    return DecodePlan("halves", in_place_cache_writes=True, cache_segments=1)


def timestamp_kernels(model, batch=1):
    """`model`'s kernels laid out for `transcribe_timestamp_ids(jit_compile=True, kernels=...)` on `batch` rows:
    `(batch, kernels)`. Laid out once for many windows, they save each window's loop the layout, inside XLA about
    40 ms a window (whisper-tiny on an Intel Xeon with AMX, 2 threads). They are a copy of the weights as they are
    now: lay them out again after the weights change. The layout runs in a function traced once per model and batch
    size that reads the weights at each call: 110 ms a call after the first, against 165 for the same ops eagerly."""
    check_int("batch", batch)
    return batch, _laid_out(model, batch)


def _laid_out(model, batch):
    """`timestamp_kernels(model, batch)[1]`, through the model's traced layout (`_kernel_layout`)."""
    return cached_function(model, ("timestamp_kernels", batch), lambda: _kernel_layout(model, batch))()


def _kernel_layout(model, batch):
    """`() -> _timestamp_plan(batch).prepared(model).kernels`, the tensors from a function traced once (its `function`
    attribute); the biases' ids, Python ints that a traced function would return as tensors, kept from the trace."""
    bias_ids = {}

    def parts():
        kernels = _timestamp_plan(batch).prepared(model).kernels
        bias_ids.update((key, bias) for key, (_, bias) in kernels.items())
        return {key: value for key, (value, _) in kernels.items()}

    function = tf.function(parts, autograph=False)

    def layout():
        return {key: (value, bias_ids[key]) for key, value in function().items()}

    layout.function = function
    return layout


def _compiled_timestamp_fns(model, max_new_tokens, ids, suppress_ids, suppress_ids_begin, end_id, sampler,
                            max_initial_timestamp, batch):
    """`timestamp_decode_fn` for a `batch` of rows as three traced functions: the loop under XLA, compiled once (fixed
    shapes, whatever the prompt's length); the encoder and the prompt pass in the graph runtime (the prompt's length
    changes from window to window, and under XLA each length would compile). The loop runs on a `DecodePlan`
    ("rows" kernels, the logits' table transposed and split caches for a batch of one, else "halves"; in-place cache
    writes) over caches of `max_sequence_length` slots. whisper-tiny, 2 threads: a step takes 5.6 ms under XLA (11
    in the graph runtime) on an AMD EPYC Zen 2. The encoder takes 0.34 s a window in the graph runtime (oneDNN)
    against 0.42 under XLA on an Intel Xeon with AMX, where the whole recording then transcribes 6% faster; on the
    Zen 2 host XLA's encoder was the faster one (0.34 against 0.41 s)."""
    every_step, first_step = _timestamp_biases(model, ids, suppress_ids, suppress_ids_begin, max_initial_timestamp)
    plan = _timestamp_plan(batch)
    slots = model.config.max_sequence_length
    encode = tf.function(lambda features: cross_attention_pairs(model, features))
    functions = {"encode": encode}

    def prompt(cross, prompt_ids):  # traced once, at the first call: any prompt length
        if "prompt" not in functions:
            spec = (tf.nest.map_structure(tf.TensorSpec.from_tensor, cross), tf.TensorSpec([batch, None], tf.int32))
            functions["prompt"] = tf.function(lambda cross, prompt_ids: _timestamp_prompt(
                model, cross, prompt_ids, slots, first_step, ids, plan), input_signature=spec)
        return functions["prompt"](cross, prompt_ids)

    @tf.function(jit_compile=True)
    def loop(cross, cache, log_probs, prompt_length, kernels):  # kernels: `{id: (parts, bias id)}`, laid out
        return _timestamp_loop(model, sampler, cross, cache, log_probs, prompt_length, max_new_tokens, every_step,
                               end_id, ids, plan.with_kernels(kernels))

    def run(input_features, prompt_ids, kernels=None):  # kernels: `timestamp_kernels(model, batch)[1]`, or None
        cross = encode(input_features)
        cache, log_probs, no_speech = prompt(cross, prompt_ids)
        kernels = _laid_out(model, batch) if kernels is None else kernels  # laid out for this call alone
        return (*loop(cross, cache, log_probs, tf.shape(prompt_ids)[1], kernels), no_speech)

    functions["loop"] = loop
    run.functions = functions  # the traced functions, for tests to inspect
    return run


def transcribe_timestamp_ids(model, input_features, prompt_ids, ids, max_new_tokens, suppress_ids=(),
                             suppress_ids_begin=(), end_id=WHISPER_END_ID, sampler=None, max_initial_timestamp=1.0,
                             jit_compile=False, kernels=None):
    """`timestamp_decode_fn`'s `(ids (B, N), sum_logprobs (B,), no_speech_prob (B,))` as numpy for log-mel features
    `(B, F, M)` and prompts `(B, P)`, compiled once per set of options. `jit_compile`: the loop under XLA, compiled
    once per batch size whatever the prompt's length (`_compiled_timestamp_fns`); the same tokens as
    without, up to the order of float sums. `kernels`: with `jit_compile`, `timestamp_kernels(model, batch)` for
    this batch size, laid out once for many calls (None: each call lays them out)."""
    check_int("max_new_tokens", max_new_tokens)  # also for XLA, which does not build `timestamp_decode_fn`
    sampler = _timestamp_sampler(sampler)
    prompt, limit = np.asarray(prompt_ids), model.config.max_sequence_length
    # The last new token is never fed back: a prompt of P ids and N new tokens use positions up to P + N - 2.
    if prompt.ndim != 2 or prompt.dtype.kind not in "iu" or prompt.shape[1] + max_new_tokens > limit + 1:
        raise ValueError(f"`prompt_ids` must be int ids (batch, length) with length + max_new_tokens <= "
                         f"max_sequence_length + 1 = {limit + 1}. Received: shape {prompt.shape}, dtype "
                         f"{prompt.dtype}, max_new_tokens={max_new_tokens}")
    _check_ids("prompt_ids", prompt.ravel(), model.config.vocabulary_size)
    if kernels is not None and (not jit_compile or not isinstance(kernels, tuple) or kernels[0] != prompt.shape[0]):
        raise ValueError(f"`kernels` must be `timestamp_kernels(model, batch={prompt.shape[0]})` (the batch of "
                         "`prompt_ids`), with jit_compile=True. Received: "
                         f"{'batch ' + str(kernels[0]) if isinstance(kernels, tuple) else type(kernels).__name__}, "
                         f"jit_compile={jit_compile}")
    options = (max_new_tokens, ids, suppress_ids, suppress_ids_begin, end_id, sampler, max_initial_timestamp)
    key = ("speech_timestamps", max_new_tokens, tuple(ids), tuple(suppress_ids), tuple(suppress_ids_begin), end_id,
           sampler.key(), float(max_initial_timestamp), bool(jit_compile) and prompt.shape[0])

    def make():
        if jit_compile:
            return _compiled_timestamp_fns(model, *options, batch=prompt.shape[0])
        spec = [tf.TensorSpec([None, None, model.config.num_mel_bins], tf.float32), tf.TensorSpec([None, None],
                                                                                                  tf.int32)]
        return tf.function(timestamp_decode_fn(model, *options), input_signature=spec)

    inputs = (tf.convert_to_tensor(input_features, tf.float32), tf.convert_to_tensor(prompt, tf.int32))
    held = {} if kernels is None else {"kernels": kernels[1]}
    outputs = cached_function(model, key, make)(*inputs, **held)
    return tuple(output.numpy() for output in outputs)
