"""Timestamped transcripts (`WhisperModel.transcribe(..., timestamps=True)`, `segments`, `models.transcript`).

Against independent numbers: faster-whisper's segments recorded on the same weights by
tools/make_whisper_segments_fixture.py (tests/fixtures/speech/segments.json; `beam_size=1`,
`condition_on_previous_text=True`, no VAD) for every fixture clip and for a recording of more than three minutes
rebuilt here from the clips and the fixture's pauses (0.3 s to 3 s); the sentences espeak-ng spoke (word error
rate); and hand-worked token sequences for faster-whisper's cut of a window at its timestamps.
"""

import json
import time
import zlib

import numpy as np
import pytest

from tests.speech import SPEECH, needs_wheel
from tfformer.models import transcript
from tfformer.training.metrics import word_error_rate

BEGIN = 50363  # <|0.00|> of Whisper's English-only vocabulary


@pytest.fixture(scope="module")
def reference():
    return json.loads((SPEECH / "segments.json").read_text())


def recording(reference, waveforms, manifest):
    """The long recording as the tool built it: each clip after its pause of zeros; and the sentences spoken."""
    by_file = {clip["file"]: (waveform, clip["text"]) for clip, waveform in zip(manifest["clips"], waveforms)}
    pieces, texts = [], []
    for name, pause in reference["recording"]["pieces"]:
        pieces += [np.zeros(pause, np.float32), by_file[name][0]]
        texts.append(by_file[name][1])
    return np.concatenate(pieces), " ".join(texts)


def agreement(found, expected, tolerance=0.5):
    """The share of `expected` segments `[start, end, ...]` with a found segment whose start and end are both within
    `tolerance` seconds of theirs."""
    hits = sum(any(abs(s.start - e[0]) <= tolerance and abs(s.end - e[1]) <= tolerance for s in found)
               for e in expected)
    return hits / len(expected)


def test_split_by_timestamps_cuts_at_pairs_and_seeks_to_the_last_complete_segment():
    t = lambda seconds: BEGIN + int(round(seconds / 0.02))  # noqa: E731
    # Two complete segments, then an unfinished one: the next window starts at the second one's end (2.5 s = 250
    # frames after seek 1000, i.e. 10 s).
    tokens = [t(0.0), 1, 2, t(1.0), t(1.2), 3, t(2.5), t(2.6), 4]
    pieces, seek = transcript.split_by_timestamps(tokens, BEGIN, 1000, 3000)
    assert [(start, end, piece) for start, end, piece in pieces] == [
        (10.0, 11.0, [t(0.0), 1, 2, t(1.0)]), (11.2, 12.5, [t(1.2), 3, t(2.5)])]
    assert seek == 1000 + 250
    # A lone timestamp at the end: nothing more was said, the next window starts after this one.
    pieces, seek = transcript.split_by_timestamps([t(0.0), 1, t(1.0), t(1.4), 2, t(2.0)], BEGIN, 0, 2800)
    assert [(round(a, 6), round(b, 6)) for a, b, _ in pieces] == [(0.0, 1.0), (1.4, 2.0)] and seek == 2800
    # No pair: one segment to the last timestamp, and the next window after this one.
    pieces, seek = transcript.split_by_timestamps([t(0.4), 1, 2, t(3.0)], BEGIN, 500, 3000)
    assert pieces == [(5.0, 8.0, [t(0.4), 1, 2, t(3.0)])] and seek == 3500
    pieces, seek = transcript.split_by_timestamps([t(0.0), 1, 2], BEGIN, 0, 1200)
    assert pieces == [(0.0, 12.0, [t(0.0), 1, 2])] and seek == 1200


def test_compression_ratio_is_zlibs():
    text = "the cat sat on the mat " * 20
    assert transcript.compression_ratio(text) == len(text) / len(zlib.compress(text.encode()))
    assert transcript.compression_ratio(text) > 2.4 > transcript.compression_ratio("The quick brown fox.")


def test_options_are_checked_by_name():
    assert transcript.TranscriptOptions().temperature == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert transcript.TranscriptOptions(temperature=0).temperature == (0.0,)
    for options, name in (({"temperature": -0.1}, "temperature"), ({"best_of": 0}, "best_of"),
                          ({"condition_on_previous_text": "yes"}, "condition_on_previous_text"),
                          ({"log_prob_threshold": "low"}, "log_prob_threshold"),
                          ({"max_initial_timestamp": -1}, "max_initial_timestamp"), ({"beam": 2}, "beam")):
        with pytest.raises(ValueError, match=name):
            transcript.TranscriptOptions.from_kwargs(**options)


@needs_wheel
def test_bad_timestamp_arguments_name_the_argument(asr):
    clip = str(SPEECH / "clip_00.wav")
    with pytest.raises(ValueError, match="beam_size"):
        asr.transcribe(clip, timestamps=True, beam_size=5)
    with pytest.raises(ValueError, match="timestamps=True"):
        asr.transcribe(clip, condition_on_previous_text=False)
    with pytest.raises(ValueError, match=r"`word_timestamps=True` needs `timestamps=True`"):
        asr.transcribe(clip, word_timestamps=True)
    with pytest.raises(ValueError, match="no_such_option"):
        asr.transcribe(clip, timestamps=True, no_such_option=1)
    with pytest.raises(ValueError, match="`audio`"):
        next(asr.segments([clip, clip]))


@needs_wheel
def test_clip_segments_match_faster_whispers(asr, manifest, reference):
    clips = manifest["clips"][::2]  # every other clip: each is a window of its own (about 2 s apiece)
    paths = [str(SPEECH / clip["file"]) for clip in clips]
    found = asr.transcribe(paths, timestamps=True)
    expected = [reference["clips"][clip["file"]]["segments"] for clip in clips]
    assert agreement([s for f in found for s in f], [e for x in expected for e in x]) >= 0.9
    same_text = sum([s.text for s in f] == [e[2] for e in x] for f, x in zip(found, expected))
    assert same_text >= 0.9 * len(paths)
    assert all(isinstance(s, transcript.Segment) and 0 <= s.start < s.end for f in found for s in f)
    # One clip alone: a list of segments, the same as in the batch.
    assert asr.transcribe(paths[0], timestamps=True) == found[0]


@needs_wheel
def test_long_recording_segments_stream_and_match_faster_whispers(asr, manifest, waveforms, reference, monkeypatch):
    """A recording of more than three minutes: windows moved by the last timestamp, each conditioned on the text
    before it. Segments stream out window by window; their boundaries agree with faster-whisper's within 0.5 s on at
    least 90% of its segments, and the word error rate is no worse than faster-whisper's."""
    audio, spoken = recording(reference, waveforms, manifest)
    assert len(audio) == reference["recording"]["num_samples"] and len(audio) > 180 * 16000
    windows = []
    decode = transcript.decode_with_fallback
    monkeypatch.setattr(transcript, "decode_with_fallback", lambda *a: windows.append(decode(*a)) or windows[-1])
    start = time.perf_counter()
    stream = asr.segments(audio, sample_rate=16000)
    first = next(stream)
    assert len(windows) == 1 and first.end <= 30.0  # the first window's segments come before the second is decoded
    found = [first, *stream]
    seconds = time.perf_counter() - start
    expected = reference["long"]["segments"]
    share = agreement(found, expected)
    ours = word_error_rate([spoken], [" ".join(s.text for s in found)])
    theirs = word_error_rate([spoken], [" ".join(e[2] for e in expected)])
    print(f"\n{len(found)} segments ({len(expected)} faster-whisper's) in {len(windows)} windows, {seconds:.1f} s; "
          f"boundaries within 0.5 s: {share:.1%}; WER {ours:.4f} (faster-whisper {theirs:.4f})")
    assert share >= 0.9
    assert ours <= theirs
    assert len(windows) >= 7  # 186 s in windows of at most 30 s
    assert all(a.end <= b.start + 1e-6 for a, b in zip(found, found[1:]))  # in order, not overlapping
