"""`tfformer.timestamps`, Whisper's timestamp pieces without TensorFlow: its numpy `timestamp_rules` against the
graph's (`models.whisper_decode.timestamp_rules`) on random logits and random states (its row-by-row check against
CTranslate2's `ApplyTimestampRules` is tests/models/test_whisper_decode_timestamps.py's, for both forms); its
`log_softmax` against TensorFlow's; the silence test and the window prompt on hand-worked cases."""

import numpy as np
import pytest
import tensorflow as tf

from tests.models.test_whisper_decode_timestamps import END, IDS, VOCAB
from tfformer import timestamps
from tfformer.data import audio
from tfformer.models import whisper_decode as speech
from tfformer.models import transcript

BEGIN = IDS.timestamp_begin


def _random_states(rng, rows, vocabulary_size, begin):
    """`(last, penultimate, last_timestamp)` `(rows,)` int32 drawn with no regard to any history: text, specials and
    timestamps for the tokens, none (-1) or any timestamp for the latest timestamp."""
    last = rng.integers(0, vocabulary_size, rows)
    penultimate = np.where(rng.random(rows) < 0.2, last, rng.integers(0, vocabulary_size, rows))
    last_timestamp = np.where(rng.random(rows) < 0.3, timestamps.NONE, rng.integers(begin, vocabulary_size, rows))
    # Half the rows' tokens are timestamps, so that pairs and lone timestamps both come up often.
    stamps = rng.random((2, rows)) < 0.5
    last = np.where(stamps[0], rng.integers(begin, vocabulary_size, rows), last)
    penultimate = np.where(stamps[1], rng.integers(begin, vocabulary_size, rows), penultimate)
    return last.astype(np.int32), penultimate.astype(np.int32), last_timestamp.astype(np.int32)


def _assert_same_masked_logits(got, expected, rtol=0.0):
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("vocabulary_size, ids, end_id", [
    (VOCAB, IDS, END),
    (51864, speech.TimestampIds(50362, 50363, 50361), 50256),  # Whisper tiny.en's ids
])
def test_numpy_rules_equal_the_graph_rules_on_random_states(vocabulary_size, ids, end_id):
    rng = np.random.default_rng(53)
    rows = 600 if vocabulary_size == VOCAB else 48
    logits = rng.normal(0.0, 3.0, (rows, vocabulary_size)).astype(np.float32)
    logits[::3, ids.timestamp_begin:] += 4.0 if vocabulary_size == VOCAB else 12.0  # the timestamps' mass wins
    logits[1::7, :end_id] = -np.inf  # rows whose text is already suppressed
    last, penultimate, last_timestamp = _random_states(rng, rows, vocabulary_size, ids.timestamp_begin)
    got = timestamps.timestamp_rules(logits, last, penultimate, last_timestamp, end_id, ids)
    expected = speech.timestamp_rules(tf.constant(logits), last, penultimate, last_timestamp, end_id, ids).numpy()
    _assert_same_masked_logits(got, expected)
    assert got.dtype == np.float32 and not np.shares_memory(got, logits)
    # The rules' cases all occur: text forced out (timestamps' mass won, or after a lone timestamp), timestamps
    # forced out (after a pair), timestamps cut below the latest one.
    begin = ids.timestamp_begin
    text_out = np.isinf(got[:, :end_id]).all(axis=1) & np.isfinite(logits[:, :end_id]).any(axis=1)
    assert text_out.sum() > rows // 10
    assert np.isinf(got[:, begin:]).all(axis=1).sum() > rows // 10
    assert (np.isinf(got[:, begin]) & np.isfinite(got[:, begin:]).any(axis=1)).sum() > rows // 10


def test_log_softmax_equals_tensorflows():
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 5.0, (6, 300)).astype(np.float32)
    logits[:, ::4] = -np.inf
    # float32 rounding: values up to ~40 in magnitude, a few ulps apart
    _assert_same_masked_logits(timestamps.log_softmax(logits), tf.nn.log_softmax(logits).numpy(), rtol=1e-6)


def test_the_keras_path_takes_its_pieces_from_here():
    """One home: the graph's decoding and the long-form loop use these constants and functions (the names stay
    reachable where they were), and the frame length is the audio front end's."""
    assert speech.TimestampIds is timestamps.TimestampIds and speech.first_step_bias is timestamps.first_step_bias
    assert speech.TIME_PRECISION == timestamps.TIME_PRECISION == 0.02
    assert transcript.Segment is timestamps.Segment
    assert transcript.split_by_timestamps is timestamps.split_by_timestamps
    assert timestamps.SECONDS_PER_FRAME == audio.HOP_LENGTH / audio.SAMPLE_RATE


def test_silence_prompt_and_ids():
    # faster-whisper: silence when <|nospeech|> is likely and the text is not confidently decoded.
    assert timestamps.is_silence(0.7, -1.5) and timestamps.is_silence(0.7, -1.0)
    assert not timestamps.is_silence(0.7, -0.5) and not timestamps.is_silence(0.6, -3.0)
    assert timestamps.is_silence(0.7, -0.5, log_prob_threshold=None)
    assert not timestamps.is_silence(0.99, -5.0, no_speech_threshold=None)
    whisper = timestamps.TimestampIds(50362, 50363, 50361)
    assert timestamps.start_sequence((50257, 50362), whisper) == [50257]
    assert timestamps.start_sequence([50258, 50259, 50359, 50363 - 1], whisper) == [50258, 50259, 50359]
    assert timestamps.window_prompt([50257], [], 50360) == [50257]
    assert timestamps.window_prompt([50257], (383, 2068), 50360) == [50360, 383, 2068, 50257]
    vocabulary = {"<|notimestamps|>": 50362, "<|startofprev|>": 50360, "<|startoftranscript|>": 50257,
                  "<|nocaptions|>": 50361}
    assert timestamps.timestamp_ids(vocabulary) == whisper
    for missing in ("<|startofprev|>", "<|nocaptions|>"):
        with pytest.raises(ValueError, match="Timestamps need a Whisper tokenizer"):
            timestamps.timestamp_ids({k: v for k, v in vocabulary.items() if k != missing})
    with pytest.raises(ValueError, match="Timestamps need a Whisper tokenizer"):
        timestamps.timestamp_ids(None)
