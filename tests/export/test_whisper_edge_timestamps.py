"""Timestamped transcripts on device: `tfformer.edge.Transcriber(...).transcribe(audio, timestamps=True)` and
`segments`, the host loop with `tfformer.timestamps`' numpy rules around a float32 Whisper tiny.en TFLite file of the
default 448 cache positions (faster-whisper's limits: 223 previous tokens, 224 new ones per window), converted once.

Against independent numbers: the graph's timestamped decoding of one window (`models.whisper_decode.
transcribe_timestamp_ids`: tokens, log-probability sum, <|nospeech|> probability) on the same features; the Keras
path's segments (`WhisperModel.transcribe(..., timestamps=True)` at temperature 0: the edge loop has no temperature
fallback) on fixture clips and on a 44-second recording of 12 clips with pauses (two windows, the second conditioned
on the first's text); and faster-whisper's segments recorded by tools/make_whisper_segments_fixture.py
(tests/fixtures/speech/segments.json) for the clips and the 186-second recording.
"""

import json
import time

import numpy as np
import pytest

from tests.harness import ONE_AT_A_TIME
from tests.models.test_transcript import agreement, recording
from tests.speech import SPEECH, needs_wheel
from tfformer.tokens import cut_at_end
from tfformer.training.metrics import word_error_rate

pytestmark = [needs_wheel, ONE_AT_A_TIME]
CLIPS = (1, 6, 11, 16, 21)  # fixture clips, one window each
SHORT_PIECES = 12  # the first pieces of the long recording: 44 s, two windows


@pytest.fixture(scope="module")
def transcriber(asr, tmp_path_factory):
    from tfformer import edge, export

    path = export.tflite_decoder(asr, str(tmp_path_factory.mktemp("whisper_timestamps") / "float32.tflite"))
    return edge.Transcriber(path, tokenizer=asr.preprocessor)  # float32, 448 cache positions


@pytest.fixture(scope="module")
def reference():
    return json.loads((SPEECH / "segments.json").read_text())


def test_window_decoding_equals_the_graphs(asr, transcriber, manifest, waveforms):
    """One window from <|startoftranscript|>, one after <|startofprev|> and another clip's text, one of silence, and
    one cut by `max_new_tokens`: the host loop's tokens, log-probability sum (the end's included, the last token's
    not when the budget runs out) and <|nospeech|> probability are the graph's on the same features."""
    from tfformer.models import whisper_decode as speech
    from tfformer.models import transcript

    ids = transcript.timestamp_ids(asr)
    sot, previous = asr.prompt[0], asr.preprocessor.token_to_id["<|startofprev|>"]
    cases = [(waveforms[4], [sot], 224), (waveforms[9], [previous, *manifest["clips"][2]["token_ids"], sot], 224),
             (np.zeros(16000, np.float32), [sot], 224), (waveforms[4], [sot], 6)]
    for waveform, prompt, budget in cases:
        features = transcriber.features(waveform)  # (1, 3000, 80)
        tokens, total, no_speech = transcriber.transcribe_timestamp_ids(features, prompt, ids, budget)
        expected, sums, probabilities = speech.transcribe_timestamp_ids(
            asr, features, np.array([prompt], np.int32), ids, budget, suppress_ids=asr.suppress_ids,
            suppress_ids_begin=asr.suppress_ids_begin, end_id=asr.end_id)
        assert tokens == cut_at_end(expected[0].tolist(), asr.end_id), (len(prompt), budget)
        assert ids.timestamp_begin <= tokens[0] <= ids.timestamp_begin + 50  # a first timestamp of at most 1 s
        assert total == pytest.approx(float(sums[0]), abs=2e-3) and total < 0
        assert no_speech == pytest.approx(float(probabilities[0]), abs=1e-4)
    assert len(tokens) == 6  # the last case ran out of budget


def test_clip_segments_equal_the_keras_paths_and_match_faster_whispers(asr, transcriber, manifest, reference):
    paths = [str(SPEECH / manifest["clips"][i]["file"]) for i in CLIPS]
    found = [transcriber.transcribe(path, timestamps=True) for path in paths]
    assert found == asr.transcribe(paths, timestamps=True, temperature=0.0)
    expected = [reference["clips"][manifest["clips"][i]["file"]]["segments"] for i in CLIPS]
    share = agreement([s for f in found for s in f], [e for x in expected for e in x])
    print(f"\nclips {CLIPS}: {sum(map(len, found))} segments, within 0.5 s of faster-whisper's: {share:.0%}")
    assert share >= 0.9
    assert [[s.text for s in f] for f in found] == [[e[2] for e in x] for x in expected]
    # The plain call stays a string.
    assert transcriber.transcribe(paths[0]) == manifest["clips"][CLIPS[0]]["transcript"]


def test_short_recording_segments_equal_the_keras_paths(asr, transcriber, manifest, waveforms, reference,
                                                        monkeypatch):
    """12 clips with pauses (44 s): the window moved by the last complete segment, the second window conditioned on
    the first's text; segments stream out window by window and are the Keras path's."""
    pieces = reference["recording"]["pieces"][:SHORT_PIECES]
    short = dict(reference, recording=dict(reference["recording"], pieces=pieces))
    audio, _ = recording(short, waveforms, manifest)
    assert 40 * 16000 < len(audio) < 60 * 16000
    prompts = []
    decode = transcriber.transcribe_timestamp_ids
    monkeypatch.setattr(transcriber, "transcribe_timestamp_ids", lambda *a: prompts.append(a[1]) or decode(*a))
    stream = transcriber.segments(audio, sample_rate=16000)
    first = next(stream)
    assert len(prompts) == 1 and first.end <= 30.0  # the first window's segments come before the second is decoded
    found = [first, *stream]
    expected = list(asr.segments(audio, sample_rate=16000, temperature=0.0))
    print(f"\n{len(found)} segments in {len(prompts)} windows (prompts of {[len(p) for p in prompts]} ids); Keras: "
          f"{len(expected)}")
    assert found == expected
    assert len(prompts) >= 2 and len(prompts[1]) > 20  # the second window's prompt holds the first's text
    assert all(a.end <= b.start + 1e-6 for a, b in zip(found, found[1:]))


def test_long_recording_segments_match_faster_whispers(transcriber, manifest, waveforms, reference):
    """The 186-second recording: segment boundaries within 0.5 s of faster-whisper's on at least 90% of its
    segments, and a word error rate no worse than its."""
    audio, spoken = recording(reference, waveforms, manifest)
    start = time.perf_counter()
    found = transcriber.transcribe(audio, sample_rate=16000, timestamps=True)
    seconds = time.perf_counter() - start
    expected = reference["long"]["segments"]
    share = agreement(found, expected)
    ours = word_error_rate([spoken], [" ".join(s.text for s in found)])
    theirs = word_error_rate([spoken], [" ".join(e[2] for e in expected)])
    print(f"\n{len(found)} segments ({len(expected)} faster-whisper's) in {seconds:.1f} s (faster-whisper "
          f"{reference['long']['seconds']} s); within 0.5 s: {share:.1%}; WER {ours:.4f} (faster-whisper {theirs:.4f})")
    assert share >= 0.9 and ours <= theirs
    assert all(a.end <= b.start + 1e-6 for a, b in zip(found, found[1:]))


def test_timestamp_bad_input(asr, transcriber, waveforms, monkeypatch):
    from tfformer.models import transcript

    clip = str(SPEECH / "clip_00.wav")
    for value in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"`timestamps` must be True or False"):
            transcriber.transcribe(clip, timestamps=value)
    with pytest.raises(ValueError, match="`condition_on_previous_text` must be True or False"):
        transcriber.segments(clip, condition_on_previous_text="no")
    with pytest.raises(ValueError, match="`max_new_tokens`"):
        transcriber.transcribe(clip, max_new_tokens=0, timestamps=True)
    with pytest.raises(ValueError, match="`sample_rate` is required"):
        transcriber.transcribe(waveforms[0], timestamps=True)
    ids = transcript.timestamp_ids(asr)
    features = transcriber.features(waveforms[0])
    with pytest.raises(ValueError, match="`prompt_ids` must be a non-empty list of ids"):
        transcriber.transcribe_timestamp_ids(features, [], ids, 10)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be an integer in \[1, 448\]"):
        transcriber.transcribe_timestamp_ids(features, [asr.prompt[0]], ids, 449)

    class NoTimestamps:  # a tokenizer without Whisper's special tokens
        detokenize = asr.preprocessor.detokenize
        token_to_id = {"<|notimestamps|>": 50362}

    monkeypatch.setattr(transcriber, "tokenizer", NoTimestamps())
    with pytest.raises(ValueError, match="Timestamps need a Whisper tokenizer"):
        transcriber.transcribe(clip, timestamps=True)
    monkeypatch.setattr(transcriber, "tokenizer", None)
    with pytest.raises(ValueError, match="Timestamps need the host tokenizer: pass `tokenizer=`"):
        transcriber.transcribe(clip, timestamps=True)
