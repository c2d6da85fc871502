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
    layouts = []  # the greedy passes' kernels: laid out once for the recording, not once a window
    lay_out = transcript.speech.timestamp_kernels
    monkeypatch.setattr(transcript.speech, "timestamp_kernels", lambda *a: layouts.append(a[1:]) or lay_out(*a))
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
    assert layouts == [(1,)]
    assert all(a.end <= b.start + 1e-6 for a, b in zip(found, found[1:]))  # in order, not overlapping


@needs_wheel
def test_windows_seek_condition_on_the_text_reset_and_skip_silence(asr, monkeypatch):
    """The long-form loop on canned window decodings (the model's decoding replaced): where each window starts,
    the prompt it gets (the previous windows' tokens after <|startofprev|>, none after a window decoded above
    `prompt_reset_on_temperature`), and a window skipped as silence."""
    t = lambda seconds: BEGIN + int(round(seconds / 0.02))  # noqa: E731
    sot, prev = asr.prompt[0], asr.preprocessor.token_to_id["<|startofprev|>"]
    the, quick = 383, 2068  # "The", " quick"
    canned = [  # (tokens, avg_logprob, temperature, no_speech_prob) per window
        ([t(0.0), the, t(2.0), t(3.0), quick, t(4.0)], -0.3, 0.0, 0.01),  # ends with a lone timestamp: next at 30 s
        ([t(0.0), the, t(1.0)], -0.9, 0.8, 0.01),  # no pair: next window after this one; decoded hot: reset
        ([t(0.0), quick, t(1.0)], -2.0, 0.0, 0.9),  # silence: skipped
    ]
    calls = []

    def fake(model, features, prompt, ids, options, held=None):
        assert features.shape == (1, 3000, 80)
        calls.append(list(prompt))
        tokens, avg, temperature, no_speech = canned[len(calls) - 1]
        return transcript.Decoded(tokens, avg, temperature, 1.0, no_speech)

    monkeypatch.setattr(transcript, "decode_with_fallback", fake)
    found = list(asr.segments(np.zeros(70 * 16000, np.float32), sample_rate=16000))
    assert found == [transcript.Segment(0.0, 2.0, "The"), transcript.Segment(3.0, 4.0, "quick"),
                     transcript.Segment(30.0, 31.0, "The")]
    assert calls == [[sot], [prev, *canned[0][0], sot], [sot]]
    # Without conditioning, every window starts from <|startoftranscript|> alone.
    calls.clear()
    list(asr.segments(np.zeros(70 * 16000, np.float32), sample_rate=16000, condition_on_previous_text=False))
    assert calls == [[sot], [sot], [sot]]


@needs_wheel
def test_fallback_tries_temperatures_until_the_thresholds_pass(asr, monkeypatch):
    """faster-whisper's fallback on canned decodings: the first temperature that passes wins; when none does, the
    best mean log-probability among those under the compression threshold, reported at the last temperature."""
    results = {0.0: (-1.5, 1.2), 0.2: (-0.8, 2.9), 0.4: (-1.2, 1.1), 0.6: (-0.5, 1.3)}  # avg_logprob, compression
    tried = []

    def fake(model, features, prompt, ids, options, temperature, held=None):
        tried.append(temperature)
        avg, ratio = results[temperature]
        return transcript.Decoded([BEGIN], avg, temperature, ratio, 0.01)

    monkeypatch.setattr(transcript, "_decode_once", fake)
    options = transcript.TranscriptOptions(temperature=(0.0, 0.2, 0.4, 0.6))
    best = transcript.decode_with_fallback(asr, None, [0], None, options)
    assert tried == [0.0, 0.2, 0.4, 0.6] and best.temperature == 0.6 and best.avg_logprob == -0.5
    tried.clear()
    options = transcript.TranscriptOptions(temperature=(0.0, 0.2, 0.4))  # none passes
    best = transcript.decode_with_fallback(asr, None, [0], None, options)
    # 0.2 has the best mean log-probability but repeats itself (2.9 > 2.4): 0.4's result, at the last temperature.
    assert tried == [0.0, 0.2, 0.4] and best.avg_logprob == -1.2 and best.temperature == 0.4
    tried.clear()
    best = transcript.decode_with_fallback(asr, None, [0], None, transcript.TranscriptOptions(log_prob_threshold=None))
    assert tried == [0.0] and best.avg_logprob == -1.5


@needs_wheel
def test_sampled_decoding_keeps_the_timestamp_rules(asr, waveforms):
    """A window decoded at temperature 1.0 (best of 2 draws, in-graph): whatever is drawn obeys Whisper's rules:
    it starts with a timestamp of at most 1 s, timestamps never decrease, and no three come in a row."""
    from tfformer.data import audio

    features, _ = audio.log_mel_spectrogram(waveforms[3][None, :])  # (1, 3000, 80)
    ids = transcript.timestamp_ids(asr)
    for seed in (0,):
        options = transcript.TranscriptOptions(temperature=1.0, seed=seed, best_of=2)
        result = transcript._decode_once(asr, features.numpy(), [asr.prompt[0]], ids, options, 1.0)
        tokens = result.tokens
        stamps = [token for token in tokens if token >= ids.timestamp_begin]
        assert tokens and ids.timestamp_begin <= tokens[0] <= ids.timestamp_begin + 50
        assert stamps == sorted(stamps) and ids.no_timestamps not in tokens
        assert not any(all(token >= ids.timestamp_begin for token in tokens[i:i + 3]) for i in range(len(tokens) - 2))
        assert result.temperature == 1.0 and result.avg_logprob < 0


def word_agreement(found, expected, tolerance=0.3):
    """The share of faster-whisper's words `[word, start, end, probability]` with a found `Word` of the same text
    whose start and end are both within `tolerance` seconds of theirs."""
    words = [w for s in found for w in (s.words or ())]
    hits = sum(any(w.word.strip() == e[0].strip() and abs(w.start - e[1]) <= tolerance
                   and abs(w.end - e[2]) <= tolerance for w in words) for s in expected for e in s["words"])
    return hits / sum(len(s["words"]) for s in expected)


@needs_wheel
def test_word_timestamps_match_faster_whispers(asr, manifest, waveforms, reference):
    """`word_timestamps=True` on the long recording: words within 0.3 s of faster-whisper's on at least 90%, the
    segments (moved to their words, windows ended at the last word) within 0.5 s on at least 90%; one clip's
    words exactly as faster-whisper's texts."""
    audio, _ = recording(reference, waveforms, manifest)
    start = time.perf_counter()
    found = list(asr.segments(audio, sample_rate=16000, word_timestamps=True))
    seconds = time.perf_counter() - start
    expected = reference["long"]["word_segments"]
    words, share = word_agreement(found, expected), agreement(found, [[s["start"], s["end"]] for s in expected])
    print(f"\n{sum(len(s.words) for s in found)} words in {len(found)} segments, {seconds:.1f} s; words within 0.3 s: "
          f"{words:.1%}; segments within 0.5 s: {share:.1%}")
    assert words >= 0.9 and share >= 0.9
    assert all(s.start <= w.start <= w.end <= s.end + 1e-6 for s in found for w in s.words)
    clip = asr.transcribe(str(SPEECH / "clip_05.wav"), timestamps=True, word_timestamps=True)
    assert [w.word for s in clip for w in s.words] == [e[0] for s in reference["clips"]["clip_05.wav"][
        "word_segments"] for e in s["words"]]
