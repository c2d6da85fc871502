"""The Whisper SavedModel's `segments` signature: timestamped segments of one 30-second window per row, in the graph.

Each row is decoded greedily with Whisper's timestamp rules (`models.whisper_decode.timestamp_decode_fn`, from the start
sequence alone: no previous text) and its ids are cut at the timestamps as `models.transcript.split_by_timestamps`
cuts a window (faster-whisper's cut), in tensor ops (`split_window`). A window that is silence by faster-whisper's
test (`<|nospeech|>` probability above `no_speech_threshold` and mean log-probability not above
`log_prob_threshold`, `TranscriptOptions`' defaults) gives no segments.
"""

import tensorflow as tf

from tfformer.data import audio
from tfformer.export import signatures as sig
from tfformer import timestamps
from tfformer.models import transcript
from tfformer.models.whisper_decode import TIME_PRECISION, timestamp_decode_fn


def _seconds(ids, timestamp_begin):
    """Float32 seconds of timestamp ids (`<|0.00|>` is `timestamp_begin`)."""
    return tf.cast(ids - timestamp_begin, tf.float32) * TIME_PRECISION


def _at(values, index):
    """`values[b, index[b]]` for `(B, N)` values and `(B,)` indices (negative ones read column 0)."""
    return tf.gather(values, tf.maximum(index, 0), batch_dims=1)


def tokens_before_end(ids, end_id):
    """Int32 `(B,)`: the ids of each row before its first `end_id` (all of them when it has none)."""
    before = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, end_id), tf.int32), axis=1), 0)  # (B, N)
    return tf.reduce_sum(tf.cast(before, tf.int32), axis=1)


def _text_ids(ids, valid, slot, num_slots, end_id):
    """The text ids (below `end_id`) of each piece slot, `(num_slots, None)` ragged, slots in row-major order."""
    text = valid & (ids < end_id)  # (B, N)
    values, rows = tf.boolean_mask(ids, text), tf.boolean_mask(slot, text)  # row-major: `rows` never decreases
    return tf.RaggedTensor.from_value_rowids(values, tf.cast(rows, tf.int64), nrows=tf.cast(num_slots, tf.int64))


def split_window(ids, frames, timestamp_begin, end_id):
    """The pieces of each row's timestamped ids, as `split_by_timestamps` cuts a window that starts the recording.

    A piece ends at each pair of consecutive timestamps; its times are its first and last ids'. When the ids end
    with a lone timestamp, the piece after the last pair ends there too. Without a pair, the whole window is one
    piece from 0 s to its last timestamp (to the window's end when there is none or it is `<|0.00|>`). Unlike
    `split_by_timestamps`, which drops an unfinished piece after the last pair (the next window decodes it again),
    that piece is kept here, ending at the window's end, unless it starts at or after it. Piece `k` of a row goes
    in slot `k`: a row of `N` ids has at most `N` pieces (a pair needs two ids).

    Args:
        ids: int32 `(B, N)`: each row's generated ids; the first `end_id` and what follows are ignored.
        frames: int32 `(B,)`: 10-ms log-mel frames of audio in each row's window; the window's end is
            `frames * 0.01` s.
        timestamp_begin: int. The id of `<|0.00|>`; every id from it on is a timestamp.
        end_id: int. `<|endoftext|>`; ids at or above it are not text.

    Returns:
        `(start, end, exists, text_ids)`: float32 `(B, N)` seconds of each slot's piece; bool `(B, N)`, the slot
        holds a piece with `start != end` (`transcript.segments` drops the others, and those without text: the
        caller checks the text); each slot's text ids, ragged `(B * N, None)` int32 in row-major order.
    """
    batch, width = tf.shape(ids)[0], tf.shape(ids)[1]
    positions = tf.broadcast_to(tf.range(width)[None, :], tf.shape(ids))  # (B, N)
    count = tokens_before_end(ids, end_id)  # (B,)
    valid = positions < count[:, None]  # (B, N)
    is_timestamp = valid & (ids >= timestamp_begin)
    pair = is_timestamp & tf.pad(is_timestamp[:, :-1], [[0, 0], [1, 0]])  # (B, N): the second of a pair opens a piece
    piece = tf.cumsum(tf.cast(pair, tf.int32), axis=1)  # (B, N): the piece of each id
    pairs = piece[:, -1]  # (B,)
    num_slots = batch * width
    slot = tf.where(valid, tf.range(batch)[:, None] * width + piece, num_slots)  # (B, N); ids past the end: spare

    def per_slot(reduce):  # the first or last position of each slot's piece; an empty slot reads a clipped one
        values = reduce(positions, slot, num_slots + 1)[:-1]  # (B * N,): the spare slot dropped
        return tf.reshape(tf.clip_by_value(values, 0, width - 1), [batch, width])  # (B, N)

    first, last = per_slot(tf.math.unsorted_segment_min), per_slot(tf.math.unsorted_segment_max)
    start = _seconds(tf.gather(ids, first, batch_dims=1), timestamp_begin)  # (B, N)
    end = _seconds(tf.gather(ids, last, batch_dims=1), timestamp_begin)
    duration = (tf.cast(frames, tf.float32) * transcript.SECONDS_PER_FRAME)[:, None]  # (B, 1)
    single_ending = ((count >= 2) & _at(is_timestamp, count - 1) & ~_at(is_timestamp, count - 2))[:, None]
    # Without a pair: from 0 s to the last timestamp, or to the window's end.
    last_stamp = _at(ids, tf.reduce_max(tf.where(is_timestamp, positions, -1), axis=1))  # (B,)
    has_stamp = tf.reduce_any(is_timestamp, axis=1) & tf.not_equal(last_stamp, timestamp_begin)
    whole_end = tf.where(has_stamp, _seconds(last_stamp, timestamp_begin), duration[:, 0])[:, None]  # (B, 1)
    slots = tf.range(width)[None, :]  # (1, N)
    no_pair = tf.equal(pairs, 0)[:, None]  # (B, 1)
    unfinished = tf.equal(slots, pairs[:, None]) & ~no_pair & ~single_ending  # (B, N): after the last pair
    start = tf.where(no_pair, 0.0, start)
    end = tf.where(no_pair, whole_end, tf.where(unfinished, duration, end))
    exists = (slots <= pairs[:, None]) & ~(unfinished & (start >= duration))
    exists &= tf.not_equal(start, end)
    return start, end, exists, _text_ids(ids, valid, slot, num_slots, end_id)


def segments_endpoint(model, tokenizer, max_new_tokens, checks):
    """`(fn, input_signature)` of the `segments` signature: `waveform`, `lengths` as `serving_default`'s ->
    `segment_text`, `segment_start`, `segment_end` `(B, S)`, `num_segments`, `avg_logprob`, `no_speech_prob` `(B,)`.

    `checks(waveform, lengths)`: the input checks of `serving_default`. A window decodes at most `max_new_tokens`
    (and at most half the decoder's positions, CTranslate2's limit, as `transcript.segments`).
    """
    ids, options = transcript.timestamp_ids(model), transcript.TranscriptOptions()
    new_tokens = min(model.config.max_sequence_length // 2, max_new_tokens)
    decode = timestamp_decode_fn(model, new_tokens, ids, model.suppress_ids, model.suppress_ids_begin, model.end_id,
                                 max_initial_timestamp=options.max_initial_timestamp)
    start_ids = timestamps.start_sequence(model.prompt, ids)  # <|startoftranscript|> ...
    num_frames = 2 * model.config.max_source_positions  # the encoder's window: 3000 frames, 30 s

    def segments(waveform, lengths):
        with tf.control_dependencies(checks(waveform, lengths)):
            # Whole 10-ms frames of the row's first 30 s, as `transcript.segments` cuts a window's samples.
            frames = tf.minimum(lengths // audio.HOP_LENGTH, audio.NUM_FRAMES)  # (B,)
        window = waveform[:, :audio.WINDOW_SAMPLES]  # (B, min(N, 480000))
        features, _ = audio.log_mel_spectrogram(window, frames * audio.HOP_LENGTH, num_frames=num_frames)
        prompt = tf.tile(tf.constant([start_ids], tf.int32), [tf.shape(waveform)[0], 1])  # (B, P)
        tokens, sum_logprobs, no_speech = decode(features, prompt)  # (B, N), (B,), (B,)
        count = tf.cast(tokens_before_end(tokens, model.end_id), tf.float32)  # (B,)
        avg_logprob = sum_logprobs / (count + 1.0)  # faster-whisper's mean counts the end token
        silence = (no_speech > options.no_speech_threshold) & ~(avg_logprob > options.log_prob_threshold)
        start, end, exists, text_ids = split_window(tokens, frames, ids.timestamp_begin, model.end_id)
        texts = tf.reshape(tf.strings.strip(tokenizer.detokenize(text_ids)), tf.shape(start))  # (B, N)
        keep = exists & tf.not_equal(texts, "") & (~silence & (frames > 0))[:, None]  # (B, N)
        kept = tf.ragged.boolean_mask(texts, keep)  # (B, None)
        return {
            sig.SEGMENT_TEXT: kept.to_tensor(default_value=""),  # (B, S)
            sig.SEGMENT_START: tf.ragged.boolean_mask(start, keep).to_tensor(default_value=0.0),
            sig.SEGMENT_END: tf.ragged.boolean_mask(end, keep).to_tensor(default_value=0.0),
            sig.NUM_SEGMENTS: tf.cast(kept.row_lengths(), tf.int32),
            sig.AVG_LOGPROB: avg_logprob,
            sig.NO_SPEECH_PROB: no_speech,
        }

    return segments, [sig.waveform_spec(), sig.count_spec(sig.LENGTHS)]
