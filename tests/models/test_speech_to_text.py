"""The speech-to-text task: `from_preset("whisper-tiny-en").transcribe(...)` from WAV files and waveforms to text.

Against independent numbers: the fixture manifest's transcripts and word error rate, recorded from
faster-whisper/CTranslate2 (tools/make_whisper_fixture.py), greedy and with faster-whisper's default beam search
(5 beams, length_penalty 1, patience 1), and the sentences espeak-ng spoke. Long audio: a
clip over 30 s made of fixture clips and 0.5 s silences is cut in a silence (checked on the samples), its
text is the texts of its two windows, and its word errors against the spoken sentences are no more than
CTranslate2's clip by clip (a dropped or repeated window would add a sentence's worth). Resampling: the clips are
low-passed at 3.5 kHz first, so that an 8 kHz copy holds the whole signal; at 8 kHz and 44.1 kHz they then
transcribe exactly as at 16 kHz.
"""

import json
import pathlib
import warnings

import numpy as np
import pytest
import soundfile

from tests.speech import SPEECH, needs_wheel
from tfformer.training.metrics import normalize_transcript, word_error_rate

pytestmark = needs_wheel


def test_preset_carries_tokenizer_and_decoding_fields(asr, manifest):
    from tfformer import models
    from tfformer.convert import whisper
    from tfformer.data import BytePairTokenizer

    model_dir = pathlib.Path(whisper.whisper_tiny_en_path())
    generation = json.loads((model_dir / "config.json").read_text())
    special = {token["content"]: token["id"] for token in
               json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]}
    assert isinstance(asr, models.WhisperModel) and isinstance(asr.preprocessor, BytePairTokenizer)
    assert list(asr.prompt) == manifest["reference"]["prompt"] == [special["<|startoftranscript|>"],
                                                                     special["<|notimestamps|>"]]
    assert list(asr.suppress_ids) == generation["suppress_ids"] and len(asr.suppress_ids) == 90
    assert list(asr.suppress_ids_begin) == generation["suppress_ids_begin"] == [220, special["<|endoftext|>"]]
    assert asr.end_id == special["<|endoftext|>"] and asr.preprocessor.end_ids == [asr.end_id]


def test_transcribe_every_clip_gives_ctranslate2s_texts_and_wer(asr, manifest):
    paths = [str(SPEECH / clip["file"]) for clip in manifest["clips"]]
    texts = asr.transcribe(paths)
    assert texts == [clip["transcript"] for clip in manifest["clips"]]
    spoken = [clip["text"] for clip in manifest["clips"]]
    assert word_error_rate(spoken, texts) == pytest.approx(manifest["reference"]["wer"], abs=1e-9)


def test_beam_search_gives_ctranslate2s_beam_ids_on_every_clip(asr, manifest, waveforms):
    """faster-whisper's default beam search: CTranslate2's ids on every clip, its word error rate, no worse than
    greedy decoding's; `transcribe(beam_size=5)` gives the texts, `beam_size=1` greedy decoding's."""
    from tfformer.data import audio
    from tfformer.models import whisper_decode as speech

    assert manifest["reference"]["beam_generate_options"] == {
        "beam_size": 5, "max_length": 448, "suppress_blank": True, "suppress_tokens": [-1], "patience": 1,
        "length_penalty": 1}
    sampler = speech.whisper_sampler(5, length_penalty=1.0, patience=1.0)
    found = []
    for first in range(0, len(waveforms), 4):  # 4 clips x 5 beams per call
        part = waveforms[first:first + 4]
        batch = np.zeros((len(part), max(len(w) for w in part)), np.float32)  # (B, S), right-padded
        for row, waveform in zip(batch, part):
            row[:len(waveform)] = waveform
        features, _ = audio.log_mel_spectrogram(batch, [len(w) for w in part])  # (B, 3000, 80)
        ids = speech.transcribe_ids(asr, features, prompt=asr.prompt, suppress_ids=asr.suppress_ids,
                                    suppress_ids_begin=asr.suppress_ids_begin, end_id=asr.end_id, sampler=sampler)
        for row in ids.tolist():
            found.append(row[:row.index(asr.end_id)] if asr.end_id in row else row)
    clips = manifest["clips"]
    assert found == [clip["beam_token_ids"] for clip in clips]
    assert any(clip["beam_token_ids"] != clip["token_ids"] for clip in clips)  # the search changes some clips
    spoken = [clip["text"] for clip in clips]
    texts = asr.ids_to_text(np.array([ids + [asr.end_id] * (128 - len(ids)) for ids in found]))
    assert texts == [clip["beam_transcript"] for clip in clips]
    beam_wer = word_error_rate(spoken, texts)
    assert beam_wer == pytest.approx(manifest["reference"]["beam_wer"], abs=1e-9)
    assert beam_wer <= word_error_rate(spoken, [clip["transcript"] for clip in clips])  # greedy's, as ours
    paths = [str(SPEECH / clips[i]["file"]) for i in (0, 3)]
    assert asr.transcribe(paths, beam_size=5) == [clips[i]["beam_transcript"] for i in (0, 3)]
    assert asr.transcribe(paths, beam_size=1) == [clips[i]["transcript"] for i in (0, 3)]


def test_single_inputs_return_a_str(asr, manifest, waveforms):
    first = manifest["clips"][0]
    assert asr.transcribe(SPEECH / first["file"]) == first["transcript"]  # an os.PathLike
    assert asr.transcribe(waveforms[0], sample_rate=16000) == first["transcript"]
    # Integer PCM, as the WAV file stores it, is scaled to [-1, 1).
    pcm = np.round(waveforms[0] * 32768).astype(np.int16)
    assert asr.generate(pcm, sample_rate=16000) == first["transcript"]
    # A mixed list; max_new_tokens cuts each text: the reference ids 383, 2068, 7586 are " The quick brown".
    assert first["token_ids"][:3] == [383, 2068, 7586]
    assert asr.transcribe([str(SPEECH / first["file"]), waveforms[0]], sample_rate=16000, max_new_tokens=3) == [
        "The quick brown"] * 2


def test_long_audio_is_cut_in_a_silence_and_its_windows_joined(asr, manifest, waveforms):
    from tfformer.data import audio

    chosen = range(13)  # 13 clips and 12 silences of 0.5 s: about 33 s
    pieces = []
    for i in chosen:
        pieces += [waveforms[i], np.zeros(8000, np.float32)]
    long = np.concatenate(pieces[:-1])
    assert 30 * 16000 < len(long) < 60 * 16000
    bounds = audio.split_windows(long)
    assert len(bounds) == 2
    cut = bounds[0][1]
    assert not np.any(long[cut - 1600:cut + 1600])  # 0.1 s of silence on each side of the cut: no word is cut

    text = asr.transcribe(long, sample_rate=16000)
    assert text == " ".join(asr.transcribe([long[:cut], long[cut:]], sample_rate=16000))
    spoken = " ".join(manifest["clips"][i]["text"] for i in chosen)
    reference = " ".join(manifest["clips"][i]["transcript"] for i in chosen)
    # Whisper reads a window's sentences in context, so words differ from the clip-by-clip transcripts; the
    # windows together must do no worse than those against what was spoken.
    assert word_error_rate([spoken], [text]) <= word_error_rate([spoken], [reference])  # same reference: edits
    assert len(normalize_transcript(text).split()) >= len(normalize_transcript(spoken).split()) - 3


@pytest.mark.parametrize("sample_rate", [8000, 44100])
def test_other_sample_rates_are_resampled(asr, waveforms, sample_rate):
    import soxr

    clips = [waveforms[i] for i in (0, 3, 10)]
    band_limited = []
    for clip in clips:
        spectrum = np.fft.rfft(clip)
        spectrum[np.fft.rfftfreq(len(clip), 1 / 16000) > 3500] = 0  # below 8 kHz's Nyquist frequency
        band_limited.append(np.fft.irfft(spectrum, len(clip)).astype(np.float32))
    expected = asr.transcribe(band_limited, sample_rate=16000)
    resampled = [soxr.resample(clip, 16000, sample_rate, quality="VHQ") for clip in band_limited]
    assert abs(len(resampled[0]) - len(clips[0]) * sample_rate / 16000) <= 1
    assert asr.transcribe(resampled, sample_rate=sample_rate) == expected
    assert all(expected)


def test_stereo_is_mixed_down_with_a_warning(asr, manifest, waveforms, tmp_path):
    clip = manifest["clips"][3]
    stereo = np.stack([waveforms[3], waveforms[3]], axis=1)  # (samples, 2): the mix is the clip itself
    path = tmp_path / "stereo.wav"
    soundfile.write(path, stereo, 16000, subtype="PCM_16")
    with pytest.warns(UserWarning, match="stereo.wav has 2 channels; mixing down to mono"):
        assert asr.transcribe(str(path)) == clip["transcript"]
    with pytest.warns(UserWarning, match="`audio` has 2 channels; mixing down to mono"):
        assert asr.transcribe(stereo, sample_rate=16000) == clip["transcript"]


def test_bad_input_errors(asr, waveforms, tmp_path):
    clip = waveforms[0]
    cases = [
        (dict(audio=np.zeros(0, np.float32), sample_rate=16000), ValueError, r"`audio` is empty"),
        (dict(audio=[clip, np.zeros(0, np.float32)], sample_rate=16000), ValueError, r"`audio\[1\]` is empty"),
        (dict(audio=np.array([0.1, np.nan, 0.2], np.float32), sample_rate=16000), ValueError,
         r"`audio` has 1 NaN or infinite samples \(the first at flat index 1\)"),
        (dict(audio=[clip, np.array([0.0, np.inf])], sample_rate=16000), ValueError,
         r"`audio\[1\]` has 1 NaN or infinite samples"),
        (dict(audio=clip), ValueError, r"`sample_rate` is required with a waveform array"),
        (dict(audio=str(SPEECH / "clip_00.wav"), sample_rate=16000), ValueError,
         r"`sample_rate` applies to waveform arrays; a WAV file carries its own rate"),
        (dict(audio=str(tmp_path / "missing.wav")), FileNotFoundError, r"`audio` is not a file.*missing.wav"),
        (dict(audio=[]), ValueError, r"`audio` is an empty list"),
        (dict(audio=3), ValueError, r"`audio` must be a path to a WAV file, a waveform array, or a list of them"),
        (dict(audio=[0.1, 0.2], sample_rate=16000), ValueError,
         r"`audio\[0\]` must be a path to a WAV file or a waveform array. Received: float"),
        (dict(audio=np.zeros((2, 16000), np.float32), sample_rate=16000), ValueError,
         r"`audio` must have shape \(samples,\) or \(samples, channels\); shape \(2, 16000\) has more channels"),
        (dict(audio=clip, sample_rate=16000, batch_size=0), ValueError, r"`batch_size` must be a positive integer"),
        (dict(audio=clip, sample_rate=16000, max_new_tokens=0), ValueError, r"`max_new_tokens` must be a positive"),
        (dict(audio=clip, sample_rate=16000, beam_size=0), ValueError,
         r"`beam_size` must be a positive integer. Received: beam_size=0"),
        (dict(audio=clip, sample_rate=16000, beam_size=2, patience=0), ValueError,
         r"`patience` must be a number > 0 or None. Received: patience=0"),
    ]
    for rate in (0, -16000, 16000.5, True):
        cases.append((dict(audio=clip, sample_rate=rate), ValueError,
                      rf"`sample_rate` must be a positive int \(Hz\). Received: sample_rate={rate!r}"))
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            asr.transcribe(**kwargs)

    flac = tmp_path / "speech.flac"
    soundfile.write(flac, clip, 16000)
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    empty = tmp_path / "empty.wav"
    soundfile.write(empty, np.zeros(0), 16000)
    for path, message in ((flac, r"speech.flac is a FLAC file .*only WAV files are supported"),
                          (text, r"notes.wav is not a readable WAV file"), (empty, r"empty.wav is empty")):
        with pytest.raises(ValueError, match=message):
            asr.transcribe([str(SPEECH / "clip_00.wav"), str(path)])


def test_transcribe_needs_the_tokenizer(asr):
    tokenizer = asr.preprocessor
    asr.preprocessor = None
    try:
        with pytest.raises(ValueError, match="this WhisperModel has no preprocessor"):
            asr.transcribe(str(SPEECH / "clip_00.wav"))
    finally:
        asr.preprocessor = tokenizer


def test_preset_directory_round_trip(asr, manifest, tmp_path):
    from tfformer import models

    directory = asr.save_to_preset(str(tmp_path / "whisper"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean load: no unknown-argument warnings
        reloaded = models.from_preset(directory)
    assert isinstance(reloaded, models.WhisperModel)
    assert (reloaded.prompt, reloaded.suppress_ids, reloaded.suppress_ids_begin, reloaded.end_id) == (
        asr.prompt, asr.suppress_ids, asr.suppress_ids_begin, asr.end_id)
    assert reloaded.preprocessor.end_ids == [asr.end_id]
    clip = manifest["clips"][5]
    assert reloaded.transcribe(str(SPEECH / clip["file"])) == clip["transcript"]
