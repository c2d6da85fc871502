"""Whisper's log-mel front end (tf.signal) against faster-whisper's recorded features, and the WAV reader.

The recorded features come from faster-whisper's numpy extractor (tools/make_whisper_fixture.py). Cases the
fixture does not cover (long audio, waveforms shorter than the reflect padding) are checked against a numpy
transcription of that extractor written here with `np.pad(mode="reflect")` and `np.fft.rfft`.
"""

import json
import math
import pathlib
import wave

import numpy as np
import pytest
import soundfile
import tensorflow as tf

from tfformer.data import audio

SPEECH = pathlib.Path(__file__).parents[1] / "fixtures" / "speech"


@pytest.fixture(scope="module")
def manifest():
    return json.loads((SPEECH / "manifest.json").read_text())


@pytest.fixture(scope="module")
def recorded():
    with np.load(SPEECH / "mel_features.npz") as f:
        return {name: f[name] for name in f.files}  # (80, 3000) each, faster-whisper's layout


def _read_pcm16(path):
    """The fixture WAV through the standard library alone: 16-bit PCM -> float32 in [-1, 1)."""
    with wave.open(str(path)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 16000)
        return np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768.0


def _numpy_log_mel(waveform):
    """faster-whisper's FeatureExtractor.__call__ (padding=160) in plain numpy: (80, length // 160 + 1)."""
    x = np.pad(waveform.astype(np.float32), (0, 160))
    x = np.pad(x, (200, 200), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, 400)[::160]  # (T + 1, 400)
    window = np.hanning(401)[:-1]
    power = np.abs(np.fft.rfft(frames * window, axis=-1)[:-1]) ** 2  # last frame dropped, (T, 201)
    log_spec = np.log10(np.maximum(audio.mel_filters().astype(np.float64) @ power.T, 1e-10))
    return (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0


def test_mel_filters_are_slaney():
    filters = audio.mel_filters()
    assert filters.shape == (80, 201) and filters.dtype == np.float32
    # Slaney mel scale: 1000 Hz is mel 15, 8 kHz is 15 + log(8) / (log(6.4) / 27).
    edges_mel = np.linspace(0, 15 + math.log(8) / (math.log(6.4) / 27), 82)
    edges_hz = np.where(edges_mel < 15, edges_mel * 200 / 3, 1000 * np.exp((edges_mel - 15) * math.log(6.4) / 27))
    # Filter i is the triangle over mel edges i, i + 1, i + 2, of height 2 / its width in Hz, sampled every 40 Hz.
    fft_hz = np.arange(201) * 40.0
    for i in range(80):
        corners = edges_hz[i:i + 3]
        expected = np.interp(fft_hz, corners, [0.0, 2.0 / (corners[2] - corners[0]), 0.0], left=0.0, right=0.0)
        np.testing.assert_allclose(filters[i], expected, rtol=1e-5, atol=1e-9)


def test_equals_recorded_faster_whisper_features(recorded, manifest):
    clips = {c["file"][:-4]: c for c in manifest["clips"]}
    names = sorted(recorded)
    waveforms = [_read_pcm16(SPEECH / f"{name}.wav") for name in names]
    assert [len(w) for w in waveforms] == [clips[name]["num_samples"] for name in names]
    # Batched with different lengths and extra padding: each example must come out as if alone.
    batch = np.zeros((len(names), max(map(len, waveforms)) + 1000), np.float32)
    for i, w in enumerate(waveforms):
        batch[i, :len(w)] = w
    features, frame_lengths = audio.log_mel_spectrogram(batch, [len(w) for w in waveforms])
    assert features.shape == (len(names), 3000, 80)
    np.testing.assert_array_equal(frame_lengths, [len(w) // 160 for w in waveforms])
    for i, name in enumerate(names):
        np.testing.assert_allclose(features[i].numpy().T, recorded[name], atol=1e-4, rtol=0)
        single, _ = audio.log_mel_spectrogram(waveforms[i][None, :])
        np.testing.assert_allclose(single[0].numpy().T, recorded[name], atol=1e-4, rtol=0)
        assert np.all(features[i, frame_lengths[i]:].numpy() == 0.0)


def test_window_log_mel_equals_recorded_features_for_any_batch_and_length(recorded):
    # One traced function for batches of windows of every length (a recording's last window is short).
    names = sorted(recorded)[:3]
    waveforms = [_read_pcm16(SPEECH / f"{name}.wav") for name in names]
    batch = np.zeros((len(names), max(map(len, waveforms)) + 500), np.float32)  # (B, S), padded past each clip
    for row, waveform in zip(batch, waveforms):
        row[:len(waveform)] = waveform
    batched = audio.window_log_mel(batch, [len(w) for w in waveforms])
    assert batched.shape == (len(names), 3000, 80)
    for row, waveform, name in zip(batched.numpy(), waveforms, names):
        np.testing.assert_allclose(row.T, recorded[name], atol=1e-4, rtol=0)
        single = audio.window_log_mel(waveform[None, :], [len(waveform)])  # (1, 3000, 80)
        np.testing.assert_allclose(single[0].numpy().T, recorded[name], atol=1e-4, rtol=0)
    assert audio.window_log_mel.function.experimental_get_tracing_count() == 1
    for waveforms, lengths, name in [(batch.astype(np.float64), [1, 2, 3], "waveforms"), (batch[0], [1], "waveforms"),
                                     (batch, [1, 2], "lengths"), (batch, [1.0, 2.0, 3.0], "lengths")]:
        with pytest.raises(ValueError, match=f"`{name}` must be"):
            audio.window_log_mel(waveforms, lengths)


def test_long_audio_and_windows(recorded):
    # 35 s: longer than one window. num_frames=None returns every frame, normalised over the whole recording.
    rng = np.random.default_rng(0)
    waveform = np.concatenate([_read_pcm16(SPEECH / f"clip_{i:02d}.wav") for i in range(24)] * 2)[:35 * 16000]
    waveform = waveform + rng.normal(0, 1e-3, waveform.shape).astype(np.float32)
    expected = _numpy_log_mel(waveform)[:, :-1]  # (80, 3500): transcribe() drops the extractor's last frame
    features, frame_lengths = audio.log_mel_spectrogram(waveform[None, :], num_frames=None)
    assert features.shape == (1, 3500, 80) and int(frame_lengths[0]) == 3500
    np.testing.assert_allclose(features[0].numpy().T, expected, atol=1e-4, rtol=0)
    # The default cuts to the first 30-second window.
    window, frame_lengths = audio.log_mel_spectrogram(waveform[None, :])
    assert window.shape == (1, 3000, 80) and int(frame_lengths[0]) == 3000
    np.testing.assert_allclose(window[0].numpy().T, expected[:, :3000], atol=1e-4, rtol=0)


@pytest.mark.parametrize("length", [1, 37, 150, 161, 399, 1601])
def test_waveforms_shorter_than_the_padding(length):
    # Under 200 samples np.pad reflects more than once; under 160 there is no whole frame.
    rng = np.random.default_rng(length)
    waveform = rng.uniform(-0.5, 0.5, length).astype(np.float32)
    features, frame_lengths = audio.log_mel_spectrogram(waveform[None, :], num_frames=20)
    expected = _numpy_log_mel(waveform)[:, : length // 160]
    assert int(frame_lengths[0]) == length // 160
    np.testing.assert_allclose(features[0, : length // 160].numpy().T, expected, atol=1e-4, rtol=0)
    assert np.all(features[0, length // 160:].numpy() == 0.0)


def test_empty_examples_give_zero_features():
    features, frame_lengths = audio.log_mel_spectrogram(np.zeros((2, 0), np.float32))
    assert features.shape == (2, 3000, 80) and np.all(features.numpy() == 0.0)
    np.testing.assert_array_equal(frame_lengths, [0, 0])
    waveforms = np.random.default_rng(0).uniform(-0.5, 0.5, (2, 3200)).astype(np.float32)
    features, frame_lengths = audio.log_mel_spectrogram(waveforms, [0, 3200])
    np.testing.assert_array_equal(frame_lengths, [0, 20])
    assert np.all(features[0].numpy() == 0.0) and np.all(np.isfinite(features.numpy()))


def test_runs_in_a_graph_with_dynamic_shapes(recorded):
    waveform = _read_pcm16(SPEECH / "clip_03.wav")

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.int32)])
    def front_end(waveforms, lengths):
        return audio.log_mel_spectrogram(waveforms, lengths)

    features, frame_lengths = front_end(tf.constant(waveform[None, :]), tf.constant([len(waveform)]))
    assert features.shape == (1, 3000, 80) and int(frame_lengths[0]) == len(waveform) // 160
    np.testing.assert_allclose(features[0].numpy().T, recorded["clip_03"], atol=1e-4, rtol=0)


def test_matmul_dft_equals_recorded_features_and_converts_to_tflite(recorded, tmp_path):
    # use_fft=False is the TFLite path: the same features, and builtin ops only (RFFT2D rejects n_fft 400).
    from ai_edge_litert.interpreter import Interpreter

    waveforms = [_read_pcm16(SPEECH / f"{name}.wav") for name in ("clip_03", "clip_10")]
    batch = np.zeros((2, 16000 * 30), np.float32)
    for i, w in enumerate(waveforms):
        batch[i, :len(w)] = w
    lengths = np.array([len(w) for w in waveforms], np.int32)
    features, _ = audio.log_mel_spectrogram(batch, lengths, use_fft=False)
    for i, name in enumerate(("clip_03", "clip_10")):
        np.testing.assert_allclose(features[i].numpy().T, recorded[name], atol=1e-4, rtol=0)

    module = tf.Module()
    module.front_end = tf.function(
        lambda waveforms, lengths: dict(zip(("features", "frame_lengths"),
                                            audio.log_mel_spectrogram(waveforms, lengths, use_fft=False))),
        input_signature=[tf.TensorSpec([2, 16000 * 30], tf.float32), tf.TensorSpec([2], tf.int32)])
    tf.saved_model.save(module, str(tmp_path), signatures={"front_end": module.front_end.get_concrete_function()})
    converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    runner = Interpreter(model_content=converter.convert()).get_signature_runner("front_end")
    outputs = runner(waveforms=batch, lengths=lengths)
    np.testing.assert_array_equal(outputs["frame_lengths"], lengths // 160)
    for i, name in enumerate(("clip_03", "clip_10")):
        np.testing.assert_allclose(outputs["features"][i].T, recorded[name], atol=1e-4, rtol=0)


def test_log_mel_spectrogram_errors():
    with pytest.raises(ValueError, match="`waveforms` must be float32"):
        audio.log_mel_spectrogram(np.zeros((1, 400), np.int16))
    with pytest.raises(ValueError, match=r"`waveforms` must have shape \(batch, samples\)"):
        audio.log_mel_spectrogram(np.zeros((400,), np.float32))
    with pytest.raises(ValueError, match="`num_frames` must be a positive int or None"):
        audio.log_mel_spectrogram(np.zeros((1, 400), np.float32), num_frames=0)


# --- prepare_waveform / read_wav ------------------------------------------------------------------------

def test_read_wav_reads_the_fixture_exactly():
    path = SPEECH / "clip_00.wav"
    np.testing.assert_array_equal(audio.read_wav(str(path)), _read_pcm16(path))


def test_resampling_to_16khz(tmp_path):
    # A 440 Hz tone at 8 kHz and 44.1 kHz comes out as the same tone sampled at 16 kHz.
    for rate in (8000, 44100):
        t = np.arange(rate) / rate
        path = tmp_path / f"tone_{rate}.wav"
        soundfile.write(path, 0.5 * np.sin(2 * np.pi * 440 * t), rate, subtype="FLOAT")
        waveform = audio.read_wav(str(path))
        assert waveform.dtype == np.float32 and abs(len(waveform) - 16000) <= 1
        expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(len(waveform)) / 16000)
        np.testing.assert_allclose(waveform[800:-800], expected[800:-800], atol=2e-3)


def test_stereo_is_mixed_down_with_a_warning(tmp_path):
    left, right = np.full(1600, 0.25), np.full(1600, -0.75)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    with pytest.warns(UserWarning, match="2 channels; mixing down to mono"):
        waveform = audio.read_wav(str(path))
    np.testing.assert_allclose(waveform, np.full(1600, -0.25), atol=1e-7)


def test_integer_pcm_arrays_are_scaled():
    pcm = np.array([-32768, 0, 16384], np.int16)
    np.testing.assert_array_equal(audio.prepare_waveform(pcm, 16000), [-1.0, 0.0, 0.5])


def test_bad_audio_errors(tmp_path):
    empty = tmp_path / "empty.wav"
    soundfile.write(empty, np.zeros((0,)), 16000)
    with pytest.raises(ValueError, match="empty.wav is empty"):
        audio.read_wav(str(empty))
    nan = tmp_path / "nan.wav"
    soundfile.write(nan, np.array([0.0, np.nan, 0.1, np.nan]), 16000, subtype="FLOAT")
    with pytest.raises(ValueError, match=r"nan.wav has 2 NaN or infinite samples \(the first at flat index 1\)"):
        audio.read_wav(str(nan))
    flac = tmp_path / "speech.flac"
    soundfile.write(flac, np.zeros(160), 16000)
    with pytest.raises(ValueError, match=r"speech.flac is a FLAC file .*only WAV files are supported"):
        audio.read_wav(str(flac))
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    with pytest.raises(ValueError, match="notes.wav is not a readable WAV file"):
        audio.read_wav(str(text))
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        audio.read_wav(str(tmp_path / "missing.wav"))
    with pytest.raises(ValueError, match="waveform is empty"):
        audio.prepare_waveform(np.zeros((0, 2), np.float32), 16000)
    with pytest.raises(ValueError, match=r"waveform has 1 NaN or infinite samples"):
        audio.prepare_waveform(np.array([0.0, np.inf]), 16000)
    with pytest.raises(ValueError, match=r"waveform must have shape \(samples,\) or \(samples, channels\)"):
        audio.prepare_waveform(np.zeros((2, 2, 2)), 16000)
    with pytest.raises(ValueError, match="`sample_rate` must be a positive int"):
        audio.prepare_waveform(np.zeros(10), 0)
    for rate in (-16000, 16000.0, True, None):
        with pytest.raises(ValueError, match=r"`sample_rate` must be a positive int \(Hz\)"):
            audio.prepare_waveform(np.zeros(10), rate)


# --- split_windows ---------------------------------------------------------------------------------------

def _speech_like(rng, seconds):
    """Noise whose loudness changes every 50 ms between 0.05 and 0.5 (never quiet for long), at 16 kHz."""
    loudness = np.repeat(rng.uniform(0.05, 0.5, size=int(seconds * 20)), 800)  # (seconds * 16000,)
    return (rng.normal(size=loudness.size) * loudness).astype(np.float32)


def _check_cover(bounds, total, window):
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))  # no gap, no overlap
    assert all(0 < end - start <= window for start, end in bounds)


def test_split_windows_cuts_in_the_pauses(rng):
    # 70 s: speech with a 0.4 s pause of digital silence at 27.0 s and one of low noise at 55.2 s, i.e. in
    # the last 5 s of the first window and of the window that starts at the first cut.
    waveform = _speech_like(rng, 70.0)
    first, second = (27.0 * 16000, 27.4 * 16000), (55.2 * 16000, 55.6 * 16000)
    waveform[int(first[0]):int(first[1])] = 0.0
    waveform[int(second[0]):int(second[1])] *= 1e-3
    bounds = audio.split_windows(waveform)
    _check_cover(bounds, len(waveform), 480000)
    assert len(bounds) == 3
    (_, cut_1), (_, cut_2), _ = bounds
    # Each cut lies inside its pause, away from the speech on either side by more than 0.1 s.
    assert first[0] + 1600 <= cut_1 <= first[1] - 1600 and second[0] + 1600 <= cut_2 <= second[1] - 1600
    # The middle of the digital silence, to the 20 ms frame.
    assert abs(cut_1 - sum(first) / 2) <= 320


def test_split_windows_prefers_the_longest_silence(rng):
    waveform = _speech_like(rng, 40.0)
    waveform[26 * 16000:int(26.3 * 16000)] = 0.0  # a 0.3 s pause ...
    waveform[28 * 16000:int(28.8 * 16000)] = 0.0  # ... and a 0.8 s one: the cut goes into the longer
    (_, cut), _ = audio.split_windows(waveform)
    assert abs(cut - 28.4 * 16000) <= 320


def test_split_windows_short_audio_and_no_pause(rng):
    assert audio.split_windows(np.zeros(480000, np.float32)) == [(0, 480000)]
    assert audio.split_windows(np.zeros(17, np.float32)) == [(0, 17)]
    # Without a pause each cut still falls in the last 5 s of a full window: at most 30 s per window.
    waveform = _speech_like(rng, 95.0)
    bounds = audio.split_windows(waveform)
    _check_cover(bounds, len(waveform), 480000)
    assert len(bounds) == 4 and all(end - start >= 25 * 16000 for start, end in bounds[:-1])
    # Smaller windows (any unit): 1000 samples with a search span of 200 and 10-sample frames.
    bounds = audio.split_windows(waveform[:5000], window_samples=1000, search_samples=200, frame_samples=10,
                                 smoothing_frames=4)
    _check_cover(bounds, 5000, 1000)
    assert all(end - start >= 800 for start, end in bounds[:-1])


def test_split_windows_errors():
    with pytest.raises(ValueError, match=r"`waveform` must have shape \(samples,\)"):
        audio.split_windows(np.zeros((10, 2)))
    with pytest.raises(ValueError, match="`search_samples` must be a positive int. Received: search_samples=0"):
        audio.split_windows(np.zeros(10), search_samples=0)
    with pytest.raises(ValueError, match="search_samples <= window_samples"):
        audio.split_windows(np.zeros(10), window_samples=100, search_samples=200)


def test_open_wav_reads_windows_as_read_wav_and_checks_the_file(tmp_path):
    path = str(SPEECH / "clip_00.wav")
    windows, whole = audio.open_wav(path), audio.read_wav(path)
    assert isinstance(windows, audio.WavWindows) and len(windows) == len(whole)
    for start, stop in ((0, 16000), (12345, 30000), (40000, len(whole) + 500)):
        np.testing.assert_array_equal(windows[start:stop], whole[start:stop])
    stereo = tmp_path / "stereo.wav"
    soundfile.write(stereo, np.stack([np.full(800, 0.25), np.full(800, -0.75)], axis=1), 16000, subtype="FLOAT")
    with pytest.warns(UserWarning, match="2 channels"):
        np.testing.assert_allclose(audio.open_wav(str(stereo))[100:200], np.full(100, -0.25), atol=1e-7)
    tone = tmp_path / "tone_8k.wav"
    soundfile.write(tone, np.zeros(8000), 8000)
    assert isinstance(audio.open_wav(str(tone)), np.ndarray) and len(audio.open_wav(str(tone))) == 16000
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes((SPEECH / "clip_00.wav").read_bytes()[:30])  # cut inside the header
    with pytest.raises(ValueError, match="truncated.wav is not a readable WAV file"):
        audio.open_wav(str(truncated))
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        audio.open_wav(str(tmp_path / "missing.wav"))
