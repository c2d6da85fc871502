"""Whisper's timestamp rules (`models.whisper_decode.timestamp_rules`, `first_step_bias`) against a per-row numpy
transcription of CTranslate2's `ApplyTimestampRules` (what faster-whisper decodes with), on random logits and token
histories over a small vocabulary: text ids below `END`, special ids up to `NO_TIMESTAMPS`, timestamps from `BEGIN`
to the last id."""

import numpy as np
import pytest
import tensorflow as tf

from tfformer import timestamps
from tfformer.models import whisper_decode as speech

VOCAB, END, NO_TIMESTAMPS = 40, 12, 19
IDS = speech.TimestampIds(no_timestamps=NO_TIMESTAMPS, timestamp_begin=NO_TIMESTAMPS + 1, no_speech=18)
BEGIN = IDS.timestamp_begin


def reference_rules(logits, sampled):
    """CTranslate2's rules for one row after `sampled` (>= 1 generated tokens), written loop by loop as
    src/models/whisper.cc has them since its commit bd563b5f ("Prevent generating segments with zero duration",
    CTranslate2 3.12; faster-whisper 1.2.1 runs 4.x)."""
    logits = logits.astype(np.float64).copy()
    disabled = {NO_TIMESTAMPS}
    check = False
    last = sampled[-1]
    if last >= BEGIN:
        penultimate = sampled[-2] if len(sampled) > 1 else last
        if penultimate >= BEGIN:
            disabled |= set(range(BEGIN, VOCAB))  # after a pair: text (or the end)
        else:
            disabled |= set(range(0, END))  # after a lone timestamp: a timestamp or the end,
            disabled |= set(range(BEGIN, last))  # not below it
            check = True
    else:
        check = True
        for token in reversed(sampled):  # after text: past the latest timestamp (no segment of zero length)
            if token >= BEGIN:
                disabled |= set(range(BEGIN, token + 1))
                break
    logits[sorted(disabled)] = -np.inf
    if check:
        shifted = logits - logits[np.isfinite(logits)].max()
        log_probs = shifted - np.log(np.exp(shifted).sum())
        with np.errstate(divide="ignore"):
            timestamp = np.log(np.exp(log_probs[BEGIN:]).sum())
        if timestamp > log_probs[:BEGIN].max():
            logits[:BEGIN] = -np.inf
    return logits


def _histories(rng, count):
    """Token histories mixing text, the end-free specials and non-decreasing timestamps, 1 to 6 tokens long."""
    histories = []
    for _ in range(count):
        length, history, stamp = rng.integers(1, 7), [], BEGIN
        for _ in range(length):
            if rng.random() < 0.5:
                stamp = int(rng.integers(stamp, VOCAB))
                history.append(stamp)
            else:
                history.append(int(rng.integers(0, END)))
        histories.append(history)
    return histories


def _state(history):
    last = history[-1]
    penultimate = history[-2] if len(history) > 1 else last
    stamps = [t for t in history if t >= BEGIN]
    return last, penultimate, stamps[-1] if stamps else -1


# The rules twice: in TensorFlow for the graph (`models.whisper_decode`), in numpy for the edge's host loop
# (`tfformer.timestamps`); each is held to the same per-row transcription of CTranslate2's.
RULES = {"tensorflow": lambda logits, *state: speech.timestamp_rules(tf.constant(logits), *state).numpy(),
         "numpy": timestamps.timestamp_rules}


@pytest.mark.parametrize("implementation", sorted(RULES))
def test_timestamp_rules_match_ctranslate2s_rules_row_by_row(implementation):
    rng = np.random.default_rng(0)
    histories = _histories(rng, 400)
    logits = rng.normal(0.0, 3.0, (len(histories), VOCAB)).astype(np.float32)
    # Rows where the timestamps' mass wins: their logits raised.
    logits[::3, BEGIN:] += 4.0
    last, penultimate, last_timestamp = (np.array(column, np.int32) for column in zip(*map(_state, histories)))
    got = RULES[implementation](logits, last, penultimate, last_timestamp, END, IDS)
    expected = np.stack([reference_rules(row, history) for row, history in zip(logits, histories)])
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=1e-6)
    # The cases all occur: text forced out (the timestamps' mass won), timestamps forced out (after a pair).
    assert np.isinf(got[:, :END]).all(axis=1).sum() > 40
    assert np.isinf(got[:, BEGIN:]).all(axis=1).sum() > 40
    assert np.isinf(got[:, NO_TIMESTAMPS]).all()


def test_first_step_allows_only_timestamps_up_to_max_initial_timestamp():
    bias = speech.first_step_bias(VOCAB, IDS, max_initial_timestamp=0.1)  # 0.1 s = 5 steps of 0.02 s
    assert np.isfinite(bias).nonzero()[0].tolist() == list(range(BEGIN, BEGIN + 6))
    whisper = speech.TimestampIds(50362, 50363, 50361)
    assert np.isfinite(speech.first_step_bias(51864, whisper)).nonzero()[0].tolist() == list(range(50363, 50414))
    with pytest.raises(ValueError, match="max_initial_timestamp"):
        speech.first_step_bias(VOCAB, IDS, max_initial_timestamp=-1)
