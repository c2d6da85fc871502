"""`tfformer.timestamps`, Whisper's timestamp pieces without TensorFlow: its numpy `timestamp_rules` against the
graph's (`models.whisper_decode.timestamp_rules`) on random logits and random states (its row-by-row check against
CTranslate2's `ApplyTimestampRules` is tests/models/test_whisper_decode_timestamps.py's, for both forms); its
`log_softmax` against TensorFlow's; the silence test and the window prompt on hand-worked cases; and both long-form
loops (the Keras path's and the edge's) on canned window decodings whose last segment ends at the window's start."""

import types

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
    assert transcript.Segment is timestamps.Segment and transcript.Decoded is timestamps.Decoded
    assert transcript.split_by_timestamps is timestamps.split_by_timestamps
    assert timestamps.SECONDS_PER_FRAME == audio.HOP_LENGTH / audio.SAMPLE_RATE
    assert timestamps.SAMPLES_PER_FRAME == audio.HOP_LENGTH and timestamps.WINDOW_FRAMES == audio.NUM_FRAMES


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


# === A window that cannot move `seek` (both loops, on canned decodings: no model) ===
WHISPER = timestamps.TimestampIds(50362, 50363, 50361)  # Whisper tiny.en's ids
SOT, PREV, WHISPER_END = 50257, 50360, 50256
WORDS = {383: " The", 2068: " quick"}
VOCABULARY = {"<|notimestamps|>": 50362, "<|startofprev|>": PREV, "<|startoftranscript|>": SOT,
              "<|nocaptions|>": 50361}


def _t(seconds):
    return WHISPER.timestamp_begin + int(round(seconds / 0.02))


# The decodings of the windows of a 70-second recording, by the window's start `seek` (frames of 10 ms); the end is
# left out. The windows at 0 s and 30 s end their last complete segment at <|0.00|>, the window's start (tokens the
# rules forbid now: a segment's end is past its start): the cut proposes the same `seek` again, and the window is
# moved past as a whole. The last window (60 s to 70 s) has a pair at 1 s and ends with a lone timestamp.
CANNED = {0: [_t(0.0), _t(0.0)], 3000: [_t(0.0), 383, _t(0.0), _t(0.0), 2068],
          6000: [_t(0.0), 383, _t(1.0), _t(1.0), 2068, _t(2.0)]}
EXPECTED = [timestamps.Segment(60.0, 61.0, "The"), timestamps.Segment(61.0, 62.0, "quick")]
RECORDING = 70 * 16000
STEP_LIMIT = 6  # windows a loop may decode before the test calls it stuck (it needs 3)


def _ramp():
    """The recording's samples: each one's index over the length, so that a window's first sample tells its
    `seek` (the features are replaced by the samples)."""
    return (np.arange(RECORDING) / RECORDING).astype(np.float32)


def _canned_window(windows, features, prompt):
    """The canned decoding of the window whose samples are `features` `(1, samples)`; a loop that decodes more than
    `STEP_LIMIT` windows is stuck."""
    seek = int(round(float(features[0, 0]) * RECORDING / audio.HOP_LENGTH))
    windows.append((seek, list(prompt)))
    assert len(windows) <= STEP_LIMIT, f"the long-form loop decodes the same windows again and again: {windows}"
    return CANNED[seek]


def _detokenize(ids):
    return " ".join(WORDS[i].strip() for i in np.asarray(ids).reshape(-1).tolist())


def test_a_window_that_does_not_move_seek_is_moved_past(monkeypatch):
    # The cut: the last complete segment ends at the window's start, so the next window starts after this one.
    assert timestamps.split_by_timestamps(CANNED[0], WHISPER.timestamp_begin, 500, 3000) == (
        [(5.0, 5.0, [_t(0.0)])], 3500)
    assert timestamps.split_by_timestamps(CANNED[3000], WHISPER.timestamp_begin, 0, 1200)[1] == 1200
    assert timestamps.split_by_timestamps([_t(0.0), 383, _t(0.5), _t(0.5), 2068], WHISPER.timestamp_begin, 0,
                                          3000)[1] == 50
    assert timestamps.next_seek(100, 100, 3000) == 3100 and timestamps.next_seek(100, 99, 80) == 180
    assert timestamps.next_seek(100, 101, 3000) == 101
    # With word timestamps the next window starts at the last word's end: one within half a frame of the window's
    # start (1.0 s at seek 100) would start the same window again.
    tokens = [_t(0.0), 383, _t(0.5), _t(0.5), 2068]
    for word_end, expected in ((1.004, 3100), (1.5, 150)):
        words = (transcript.Word(1.0, word_end, " The"),)
        monkeypatch.setattr(transcript, "add_word_timestamps", lambda *a: ([(1.0, 1.5, tokens[:3], words)], 0.0))
        _, seek, last_speech = transcript._words_and_seek(None, None, [], 3000, 100, 125, tokens,
                                                          WHISPER.timestamp_begin, 0.0)
        assert (seek, last_speech) == (expected, word_end)


def test_the_keras_loop_moves_past_a_window_that_does_not_move_seek(monkeypatch):
    """`models.transcript.segments` with its features replaced by the samples and its window decoding by the canned
    decodings: windows at 0 s, 30 s and 60 s, each from <|startoftranscript|> alone (nothing said before the last)."""
    preprocessor = types.SimpleNamespace(
        token_to_id=VOCABULARY,
        detokenize=lambda ragged: tf.constant([_detokenize(row).encode() for row in ragged.to_list()]))  # (R,)
    model = types.SimpleNamespace(prompt=[SOT, WHISPER.no_timestamps], preprocessor=preprocessor,
                                  config=types.SimpleNamespace(max_sequence_length=448), alignment_heads=None,
                                  end_id=WHISPER_END)
    windows = []

    def decode(model, features, prompt, ids, options, held=None):
        assert ids == WHISPER
        return transcript.Decoded(_canned_window(windows, features, prompt), -0.2, 0.0, 1.0, 0.01)

    monkeypatch.setattr(audio, "window_log_mel", lambda samples, lengths: tf.constant(samples))  # (1, S)
    monkeypatch.setattr(transcript, "decode_with_fallback", decode)
    assert list(transcript.segments(model, _ramp(), transcript.TranscriptOptions())) == EXPECTED
    assert windows == [(0, [SOT]), (3000, [SOT]), (6000, [SOT])]


def test_the_edge_loop_moves_past_a_window_that_does_not_move_seek(monkeypatch):
    """`edge.Transcriber.segments` without a .tflite file, its features replaced by the samples and its window
    decoding by the canned decodings: the Keras loop's windows and segments."""
    from tfformer.edge import Transcriber

    edge = object.__new__(Transcriber)  # no interpreter: only what the host loop reads
    edge.input_shape, edge.max_length, edge.prompt, edge.end_id = (1, 3000, 80), 448, [SOT, 50362], WHISPER_END
    edge.tokenizer = types.SimpleNamespace(token_to_id=VOCABULARY, detokenize=_detokenize)
    edge._every_step = np.zeros(51864, np.float32)
    windows = []

    def decode(features, prompt, ids, max_new_tokens):
        assert ids == WHISPER and max_new_tokens == 224
        return _canned_window(windows, features, prompt), -0.5, 0.01  # (tokens, sum of log-probs, <|nospeech|>)

    monkeypatch.setattr(edge, "features", lambda samples: samples[None])
    monkeypatch.setattr(edge, "transcribe_timestamp_ids", decode)
    assert list(edge.segments(_ramp(), sample_rate=16000)) == EXPECTED
    assert windows == [(0, [SOT]), (3000, [SOT]), (6000, [SOT])]
