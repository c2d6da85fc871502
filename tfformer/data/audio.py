"""Speech input: WAV files and waveforms to 16 kHz mono, and Whisper's log-mel front end in-graph.

`log_mel_spectrogram` is plain TensorFlow (`tf.signal`), so it runs inside `tf.function` and a SavedModel;
with `use_fft=False` it also converts to TFLite builtin ops. It reproduces faster-whisper's numpy feature
extractor as its `transcribe()` feeds the encoder: reflect-padded STFT (n_fft 400, hop 160, periodic Hann
window) of the waveform followed by 160 zeros, power spectrum, 80 Slaney mel filters, `log10(max(x, 1e-10))`,
clamp to (maximum - 8), `(x + 4) / 4`, the extractor's last frame dropped, zero frames after the audio.

`read_wav` and `prepare_waveform` run in numpy before the graph: they validate the audio, mix it down to mono
and resample it to 16 kHz (`soundfile` reads, `soxr` resamples). `split_windows` cuts long audio into pieces of
at most 30 seconds at pauses.
"""

import math
import os
import warnings

import numpy as np
import tensorflow as tf

from tfformer.checks import check_int

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
NUM_MEL_BINS = 80
CHUNK_SECONDS = 30
NUM_FRAMES = CHUNK_SECONDS * SAMPLE_RATE // HOP_LENGTH  # 3000 frames = one 30-second window
WINDOW_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # one window of long audio, the encoder's 30 seconds
# File formats libsndfile reports for RIFF/WAVE files (plain, WAVE_FORMAT_EXTENSIBLE, 64-bit RF64).
WAV_FORMATS = ("WAV", "WAVEX", "RF64")


def mel_filters(sample_rate=SAMPLE_RATE, n_fft=N_FFT, num_mel_bins=NUM_MEL_BINS):
    """Slaney-style mel filterbank as librosa (`htk=False, norm="slaney"`) and Whisper build it.

    Returns:
        float32 array `(num_mel_bins, n_fft // 2 + 1)`: triangles on the Slaney mel scale (linear below
        1 kHz, logarithmic above), each scaled by 2 / its width in Hz for constant energy per channel.
    """
    f_sp = 200.0 / 3  # Hz per mel in the linear part
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp

    def hz_to_mel(hz):
        return hz / f_sp if hz < min_log_hz else min_log_mel + math.log(hz / min_log_hz) / logstep

    mels = np.linspace(0.0, hz_to_mel(sample_rate / 2), num_mel_bins + 2)
    hz = np.where(mels < min_log_mel, f_sp * mels, min_log_hz * np.exp(logstep * (mels - min_log_mel)))
    fft_hz = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    ramps = hz[:, None] - fft_hz[None, :]  # (num_mel_bins + 2, n_fft // 2 + 1)
    widths = np.diff(hz)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (hz[2:] - hz[:-2]))[:, None]
    return weights.astype(np.float32)


def _windowed_dft_matrix(window):
    """`(N_FFT, 2 * (N_FFT // 2 + 1))`: window * [cos | -sin] of the one-sided DFT, built in float64."""
    angles = 2 * np.pi * np.outer(np.arange(N_FFT), np.arange(N_FFT // 2 + 1)) / N_FFT  # (N_FFT, N_FFT // 2 + 1)
    return (window.astype(np.float64)[:, None] * np.concatenate([np.cos(angles), -np.sin(angles)], axis=1)).astype(
        np.float32)


def log_mel_spectrogram(waveforms, lengths=None, num_frames=NUM_FRAMES, use_fft=True):
    """Whisper's log-mel features of a batch of 16 kHz mono waveforms.

    Each example is normalised on its own: the clamp at (maximum - 8) uses the maximum over that example's
    frames only, so padding in the batch changes nothing. Frames past an example's audio are zeros (as
    faster-whisper pads the features of a short clip). An example of length 0 gives zeros and frame length 0;
    `prepare_waveform` rejects empty audio before it gets here.

    Args:
        waveforms: float32 tensor `(B, S)`, samples in [-1, 1] at 16 kHz; entries past `lengths` are ignored.
        lengths: optional int tensor `(B,)`: number of valid samples per example (clipped to [0, S]).
            Defaults to `S` for every example.
        num_frames: int or None. Frames to return: `3000` (one 30-second window, Whisper's encoder input)
            pads or cuts to that many; None returns `S // 160` frames, e.g. to cut long audio into
            30-second windows afterwards (the normalisation then spans the whole recording, as in
            faster-whisper).
        use_fft: bool. True computes the spectrum with `tf.signal.rfft`. False computes the same DFT as one
            matmul with a `(400, 402)` cos/sin matrix: for TFLite, whose RFFT2D kernel takes only power-of-two
            lengths and so cannot run n_fft 400. Defaults to `True`.

    Returns:
        `(features, frame_lengths)`: float32 `(B, num_frames, 80)` (frames, mel bins: channels last) and
        int32 `(B,)`, the number of frames that carry audio, `min(length // 160, num_frames)`.
    """
    waveforms = tf.convert_to_tensor(waveforms)
    if waveforms.dtype != tf.float32:
        raise ValueError(f"`waveforms` must be float32 samples in [-1, 1]. Received: dtype={waveforms.dtype.name}")
    if waveforms.shape.rank != 2:
        raise ValueError(f"`waveforms` must have shape (batch, samples). Received: shape={waveforms.shape}")
    if num_frames is not None and (not isinstance(num_frames, int) or num_frames <= 0):
        raise ValueError(f"`num_frames` must be a positive int or None. Received: num_frames={num_frames!r}")
    batch_size, num_samples = tf.shape(waveforms)[0], tf.shape(waveforms)[1]
    if lengths is None:
        lengths = tf.fill([batch_size], num_samples)
    lengths = tf.clip_by_value(tf.cast(lengths, tf.int32), 0, num_samples)  # (B,)

    # faster-whisper appends HOP_LENGTH zeros, then reflect-pads N_FFT // 2 on both sides (np.pad "reflect").
    total_frames = num_samples // HOP_LENGTH + 1
    padded_length = (total_frames - 1) * HOP_LENGTH + N_FFT
    extended = lengths[:, None] + HOP_LENGTH  # (B, 1) length after the appended zeros
    period = 2 * (extended - 1)
    positions = tf.range(padded_length)[None, :] - N_FFT // 2  # (1, P)
    positions = tf.math.floormod(positions, period)  # (B, P) reflection is periodic in 2 * (length - 1)
    positions = tf.where(positions >= extended, period - positions, positions)
    valid = positions < lengths[:, None]
    # One extra zero sample keeps every gather index valid, even for an empty batch (S = 0).
    gathered = tf.gather(tf.pad(waveforms, [[0, 0], [0, 1]]), tf.minimum(positions, num_samples), batch_dims=1)
    signal = tf.where(valid, gathered, tf.zeros_like(gathered))

    frames = tf.signal.frame(signal, N_FFT, HOP_LENGTH)  # (B, total_frames, N_FFT)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)  # periodic Hann
    if use_fft:
        spectrum = tf.signal.rfft(frames * window, fft_length=[N_FFT])  # (B, total_frames, N_FFT // 2 + 1)
        power = tf.math.square(tf.math.real(spectrum)) + tf.math.square(tf.math.imag(spectrum))
    else:
        parts = tf.matmul(frames, _windowed_dft_matrix(window))  # (B, total_frames, 2 * (N_FFT // 2 + 1))
        real, imag = tf.split(parts, 2, axis=-1)  # (B, total_frames, N_FFT // 2 + 1) each
        power = tf.math.square(real) + tf.math.square(imag)
    mel = tf.matmul(power, mel_filters().T)  # (B, total_frames, NUM_MEL_BINS)
    log_mel = tf.math.log(tf.maximum(mel, 1e-10)) / math.log(10.0)

    # The maximum spans the extractor's frames (length // 160 + 1), including the one transcribe() drops.
    frame_index = tf.range(total_frames)[None, :]  # (1, total_frames)
    in_audio = frame_index <= (lengths // HOP_LENGTH)[:, None]  # (B, total_frames)
    peak = tf.reduce_max(tf.where(in_audio[:, :, None], log_mel, -np.inf), axis=[1, 2], keepdims=True)  # (B, 1, 1)
    features = (tf.maximum(log_mel, peak - 8.0) + 4.0) / 4.0
    frame_lengths = lengths // HOP_LENGTH
    features = tf.where((frame_index < frame_lengths[:, None])[:, :, None], features, 0.0)

    if num_frames is None:
        return features[:, : total_frames - 1], frame_lengths
    features = tf.pad(features[:, :num_frames], [[0, 0], [0, tf.maximum(num_frames - total_frames, 0)], [0, 0]])
    features = tf.ensure_shape(features, [None, num_frames, NUM_MEL_BINS])
    return features, tf.minimum(frame_lengths, num_frames)


def window_log_mel(waveforms, lengths):
    """`log_mel_spectrogram(waveforms, lengths)[0]` of windows of at most 30 s: float32 `(B, S)` and `B` int lengths
    -> `(B, 3000, 80)`, from one function traced for any batch and length (`window_log_mel.function`): about half
    the time of the eager call (one window: 14 against 28 ms on an Intel Xeon with AMX, 2 threads). `transcribe`
    and the long-form loop call it for each batch of windows."""
    waveforms, lengths = tf.convert_to_tensor(waveforms), tf.convert_to_tensor(lengths)
    if waveforms.dtype != tf.float32 or waveforms.shape.rank != 2:
        raise ValueError("`waveforms` must be float32 samples in [-1, 1], shape (batch, samples). Received: "
                         f"dtype={waveforms.dtype.name}, shape={waveforms.shape}")
    if not lengths.dtype.is_integer or lengths.shape.rank != 1 or lengths.shape[0] != waveforms.shape[0]:
        raise ValueError(f"`lengths` must be {waveforms.shape[0]} ints, one per waveform. Received: "
                         f"dtype={lengths.dtype.name}, shape={lengths.shape}")
    return _traced_window_log_mel(waveforms, tf.cast(lengths, tf.int32))


@tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.int32)])
def _traced_window_log_mel(waveforms, lengths):
    features, _ = log_mel_spectrogram(waveforms, lengths)  # (B, 3000, NUM_MEL_BINS)
    return features


window_log_mel.function = _traced_window_log_mel


def prepare_waveform(waveform, sample_rate, name="waveform"):
    """A waveform array checked, mixed down to mono and resampled to 16 kHz.

    Args:
        waveform: array `(samples,)` or `(samples, channels)`; float samples in [-1, 1], or integer PCM
            (scaled by its type's range).
        sample_rate: int. Sample rate of `waveform` in Hz.
        name: str. What to call the input in error messages (a file name, for `read_wav`).

    Returns:
        float32 array `(samples,)` at 16 kHz. More than one channel is averaged to mono, with a warning.
    """
    waveform = np.asarray(waveform)
    check_int("sample_rate", sample_rate, numpy=True, expected="a positive int (Hz)")
    if waveform.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape (samples,) or (samples, channels). Received: shape={waveform.shape}")
    if waveform.size == 0:
        raise ValueError(f"{name} is empty (shape {waveform.shape}): there is no audio to transcribe.")
    if np.issubdtype(waveform.dtype, np.integer):
        waveform = waveform.astype(np.float32) / float(np.iinfo(waveform.dtype).max + 1)
    elif not np.issubdtype(waveform.dtype, np.floating):
        raise ValueError(f"{name} must hold float or integer samples. Received: dtype={waveform.dtype}")
    waveform = waveform.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(waveform.reshape(-1)))
    if bad.size:
        raise ValueError(f"{name} has {bad.size} NaN or infinite samples (the first at flat index {bad[0]}); "
                         "samples must be finite floats in [-1, 1].")
    if waveform.ndim == 2:
        if waveform.shape[1] > 1:
            warnings.warn(f"{name} has {waveform.shape[1]} channels; mixing down to mono by averaging them.",
                          stacklevel=2)
        waveform = waveform.mean(axis=1, dtype=np.float32)
    if sample_rate != SAMPLE_RATE:
        import soxr  # only needed off the 16 kHz path

        waveform = soxr.resample(waveform, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return waveform


def _wav_info(path):
    """`soundfile.info` of `path`, checked: a file, readable, a WAV (a ValueError naming the file otherwise)."""
    import soundfile  # keeps `tfformer.data` importable without libsndfile

    if not os.path.isfile(path):
        raise FileNotFoundError(f"`path` is not a file. Received: path={path!r}")
    try:
        info = soundfile.info(path)
    except (RuntimeError, TypeError) as error:  # soundfile.LibsndfileError is a RuntimeError
        raise ValueError(f"{path} is not a readable WAV file: {error}") from None
    if info.format not in WAV_FORMATS:
        raise ValueError(f"{path} is a {info.format} file ({info.format_info}); only WAV files are supported.")
    return info


def read_wav(path):
    """A WAV file as a 16 kHz mono float32 waveform.

    Args:
        path: str. A RIFF/WAVE file (PCM or float, any sample rate, any number of channels).

    Returns:
        float32 array `(samples,)` at 16 kHz, samples in [-1, 1]. Stereo and multichannel files are mixed
        down to mono by averaging the channels, with a warning; other sample rates are resampled.
    """
    import soundfile  # keeps `tfformer.data` importable without libsndfile

    _wav_info(path)
    waveform, sample_rate = soundfile.read(path, dtype="float32", always_2d=True)  # (samples, channels)
    return prepare_waveform(waveform, sample_rate, name=str(path))


def split_windows(waveform, window_samples=WINDOW_SAMPLES, search_samples=5 * SAMPLE_RATE, frame_samples=320,
                  smoothing_frames=10):
    """Sample bounds that cut a long waveform into windows of at most `window_samples`, each cut in a pause.

    A waveform that fits one window is one window. Otherwise each cut falls in the last `search_samples` of
    the window that starts at the previous cut: at the middle of the quietest stretch there, so that a pause
    rather than a word is cut. Quietness is the mean power of `frame_samples`-sample frames averaged over
    `smoothing_frames` frames (a pause outlasts the silent closure of a stop consonant); when several
    stretches are equally quiet (digital silence), the longest one wins. Speech without any pause in the
    searched span is still cut there, at its quietest point.

    Args:
        waveform: float array `(samples,)`.
        window_samples: int. The longest window (default: 30 s at 16 kHz, Whisper's encoder input).
        search_samples: int. Where to look for a pause before each window's end (default: 5 s).
        frame_samples: int. Frame of the power measure (default: 20 ms).
        smoothing_frames: int. Frames averaged per quietness value (default: 10, i.e. 200 ms).

    Returns:
        list of `(start, end)` ints: consecutive, without gaps or overlap, covering `[0, len(waveform))`,
        each `end - start <= window_samples`.
    """
    waveform = np.asarray(waveform)
    if waveform.ndim != 1:
        raise ValueError(f"`waveform` must have shape (samples,). Received: shape={waveform.shape}")
    for name, value in (("window_samples", window_samples), ("search_samples", search_samples),
                        ("frame_samples", frame_samples), ("smoothing_frames", smoothing_frames)):
        check_int(name, value, numpy=True, expected="a positive int")
    if search_samples > window_samples or smoothing_frames * frame_samples > search_samples:
        raise ValueError(
            "Need smoothing_frames * frame_samples <= search_samples <= window_samples. Received: "
            f"window_samples={window_samples}, search_samples={search_samples}, frame_samples={frame_samples}, "
            f"smoothing_frames={smoothing_frames}")
    bounds, start, total = [], 0, len(waveform)
    while total - start > window_samples:
        low = start + window_samples - search_samples
        num_frames = search_samples // frame_samples
        frames = waveform[low:low + num_frames * frame_samples].astype(np.float64)
        frames = frames.reshape(num_frames, frame_samples)  # (F, frame_samples)
        power = np.mean(frames ** 2, axis=1)  # (F,)
        kernel = np.ones(smoothing_frames) / smoothing_frames
        quiet = np.convolve(power, kernel, mode="valid")  # (F - smoothing_frames + 1,)
        # Equal within rounding: a stretch of digital silence averages to (almost) exactly the minimum.
        is_min = quiet <= quiet.min() + 1e-12
        edges = np.flatnonzero(np.diff(np.concatenate([[0], is_min.astype(np.int8), [0]])))  # run starts, ends
        run_starts, run_ends = edges[::2], edges[1::2]
        longest = int(np.argmax(run_ends - run_starts))
        # The run's middle, shifted by half the smoothing span: value j averages frames j onwards.
        middle = (run_starts[longest] + run_ends[longest] - 1) / 2 + smoothing_frames / 2
        cut = low + int(round(middle * frame_samples))
        bounds.append((start, cut))
        start = cut
    bounds.append((start, total))
    return bounds


class WavWindows:
    """A 16 kHz mono WAV file read a window at a time, so that memory stays flat with the recording's length.

    `len(windows)` is its number of samples; `windows[start:stop]` reads those samples as float32 (channels
    averaged, with the warning `read_wav` gives; NaN or infinite samples are a ValueError naming the file). Files at
    other sample rates cannot be sliced before resampling: use `read_wav` for them (`open_wav` chooses).
    """

    def __init__(self, path, info):
        self.path, self.info = path, info
        if info.channels > 1:
            warnings.warn(f"{path} has {info.channels} channels; mixing down to mono by averaging them.", stacklevel=3)

    def __len__(self):
        return self.info.frames

    def __getitem__(self, window):
        import soundfile  # keeps `tfformer.data` importable without libsndfile

        if not isinstance(window, slice) or window.step not in (None, 1):
            raise ValueError(f"WavWindows take a slice [start:stop]. Received: {window!r}")
        start, stop, _ = window.indices(len(self))
        with soundfile.SoundFile(self.path) as f:
            f.seek(start)
            samples = f.read(max(stop - start, 0), dtype="float32", always_2d=True)  # (samples, channels)
        if not np.isfinite(samples).all():
            raise ValueError(f"{self.path} has NaN or infinite samples; samples must be finite floats in [-1, 1].")
        return samples.mean(axis=1, dtype=np.float32)


def open_wav(path):
    """A WAV file as something `len()` and `[start:stop]` read at 16 kHz mono: `WavWindows` for a 16 kHz file (read
    window by window), else `read_wav`'s resampled waveform. A file that is not a readable WAV is a ValueError naming
    it, before any audio is read."""
    info = _wav_info(path)
    if info.frames == 0:
        raise ValueError(f"{path} is empty: there is no audio to transcribe.")
    return WavWindows(path, info) if info.samplerate == SAMPLE_RATE else read_wav(path)
