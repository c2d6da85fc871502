"""Speech to text on device: the host loop around a Whisper .tflite file written by `tfformer.export.tflite_decoder`.

The file holds the encoder (log-mel features in) and a KV-cached `decode_step`; the host computes the log-mel
features in numpy, adds Whisper's token suppression to each step's logits, picks the greedy token, and
detokenizes with the byte-level BPE (`tfformer.data.BytePairTokenizer`, whose ops are not TFLite ops). With
timestamps, the host applies Whisper's timestamp rules and moves its window with the Keras path's loop, from the
TensorFlow-free `tfformer.timestamps` (`long_form_segments`).
"""

import numpy as np

from tfformer.checks import check_int
from tfformer.edge.compiled import Signature, compiled_model, constants, next_logits, zero_caches
from tfformer.timestamps import (
    MAX_INITIAL_TIMESTAMP,
    NONE,
    Decoded,
    WindowLoop,
    first_step_bias,
    log_softmax,
    long_form_segments,
    start_sequence,
    timestamp_ids,
    timestamp_rules,
)
from tfformer.tokens import cut_at_end

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # the encoder's window


def log_mel_features(waveform, num_frames=3000, num_mel_bins=80):
    """Whisper's log-mel features `(num_frames, num_mel_bins)` float32 of one 16 kHz window, in numpy.

    The same computation as `tfformer.data.audio.log_mel_spectrogram` (faster-whisper's feature extractor):
    `HOP_LENGTH` zeros appended, reflect padding, periodic Hann STFT (n_fft 400, hop 160), power, Slaney mel
    filters, `log10(max(x, 1e-10))`, clamp to (maximum - 8), `(x + 4) / 4`, zero frames after the audio.
    Samples past `num_frames * HOP_LENGTH` are ignored.

    Args:
        waveform: float array `(samples,)`, at least one sample, in [-1, 1] at 16 kHz.
    """
    from tfformer.data.audio import mel_filters  # numpy only

    waveform = np.asarray(waveform, np.float32)[: num_frames * HOP_LENGTH]
    if waveform.ndim != 1 or waveform.size == 0:
        raise ValueError(f"`waveform` must be a non-empty 1-D array of samples. Received: shape={waveform.shape}")
    length = waveform.size
    signal = np.pad(np.concatenate([waveform, np.zeros(HOP_LENGTH, np.float32)]), N_FFT // 2, mode="reflect")
    count = length // HOP_LENGTH + 1  # the extractor's frames minus its last, which transcribe() drops
    index = np.arange(count)[:, None] * HOP_LENGTH + np.arange(N_FFT)[None, :]  # (count, N_FFT)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)  # periodic Hann
    spectrum = np.fft.rfft(signal[index] * window, axis=-1)  # (count, N_FFT // 2 + 1)
    power = (spectrum.real ** 2 + spectrum.imag ** 2).astype(np.float32)
    mel = power @ mel_filters(num_mel_bins=num_mel_bins).T  # (count, num_mel_bins)
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = (np.maximum(log_mel, log_mel.max() - 8.0) + 4.0) / 4.0
    features = np.zeros((num_frames, num_mel_bins), np.float32)
    valid = min(length // HOP_LENGTH, num_frames)  # frames that carry audio
    features[:valid] = log_mel[:valid]
    return features


class Transcriber:
    """Transcribes speech with a Whisper decoder file (`tfformer.export.tflite_decoder(whisper_model, path)`).

    Runs the file's `encode` signature once per 30-second window and its `decode_step` once per token (the
    prompt is fed one id per call: fixed shapes), with greedy choice after Whisper's suppression. The prompt,
    end id and suppressed ids are read from the file. `transcribe(audio, timestamps=True)` (or `segments`) gives
    timestamped `tfformer.timestamps.Segment`s: the file's `decode_step` takes any prompt, so the timestamp prompt
    (and the previous text) goes in as it is.

    The file's signatures run in LiteRT's `CompiledModel` (XNNPACK on CPU), each input and output a buffer that
    stays bound (`tfformer.edge.compiled.Signature`): `encode` writes each window's cross-attention keys/values
    into the buffers `decode_step` reads, and each layer's self-attention keys and values are one buffer that
    `decode_step` reads and writes (its output of the same name), so a step writes only its own slot. Per step only
    the token, the index and the logits cross between the host and the runtime.

    Args:
        path: the .tflite file (float32 or `quantize="dynamic"`).
        tokenizer: the Whisper `tfformer.data.BytePairTokenizer` (e.g. `models.from_preset("whisper-tiny-en")
            .preprocessor`), for text; without it only `transcribe_ids` works.
        num_threads: CPU threads of the runtime.

    Example:
    ```python
    asr = tfformer.models.from_preset("whisper-tiny-en")
    tfformer.export.tflite_decoder(asr, "whisper.tflite", quantize="dynamic")
    edge = tfformer.edge.Transcriber("whisper.tflite", tokenizer=asr.preprocessor)
    edge.transcribe("clip.wav")                      # "The quick brown fox ..."
    edge.transcribe("meeting.wav", timestamps=True)  # [Segment(start=0.0, end=3.0, text="The quick ..."), ...]
    ```
    """

    def __init__(self, path, tokenizer=None, num_threads=2):
        if tokenizer is not None and not callable(getattr(tokenizer, "detokenize", None)):
            raise ValueError("`tokenizer` must have `detokenize(ids)` (the Whisper BytePairTokenizer). "
                             f"Received: tokenizer={tokenizer!r}")
        check_int("num_threads", num_threads, numpy=True)
        self.tokenizer = tokenizer
        self.model = compiled_model(path, num_threads)
        signatures = self.model.get_signature_list()
        if "decode_step" not in signatures or "input_features" not in signatures.get("encode", {}).get("inputs", []):
            raise ValueError(f"`path` must be a Whisper decoder file (an `encode` signature on `input_features` and a "
                             f"`decode_step`), written by tfformer.export.tflite_decoder(whisper_model, path). "
                             f"Received: path={path!r} with signatures {signatures}")
        step_inputs = signatures["decode_step"]["inputs"]
        layers = sum(name.startswith("cache_keys_") for name in step_inputs)
        cross = {f"cross_{half}_{i}" for half in ("keys", "values") for i in range(layers)}
        caches = {f"cache_{half}_{i}" for half in ("keys", "values") for i in range(layers)}
        if ("options" not in signatures or not layers or not cross | caches <= set(step_inputs)
                or not cross <= set(signatures["encode"]["outputs"])):
            raise ValueError(f"`path` is a Whisper decoder file of an older layout (decode_step inputs "
                             f"{sorted(step_inputs)}; now per-layer `cache_keys_i` / `cache_values_i`, the "
                             "cross-attention keys/values from `encode`, an `options` signature): write it again "
                             f"with tfformer.export.tflite_decoder. Received: path={path!r}")
        self._encode = Signature(self.model, "encode")
        # encode's cross-attention keys (1, K, S_src, H) and values (1, K, H, S_src) are decode_step's inputs.
        self._step = Signature(self.model, "decode_step", inputs={name: self._encode.outputs[name] for name in cross})
        self._caches = {name: self._step.inputs[name] for name in sorted(caches)}  # bound in and out
        self.input_shape = self._encode.specs["input_features"][0]  # (1, F, M)
        self.max_length = self._step.specs["cache_keys_0"][0][1]  # each cache (K, S, H)
        vocabulary_size = self._step.specs["logits"][0][-1]
        options = constants(self.model, "options")
        self.prompt = [int(i) for i in options["prompt_ids"].reshape(-1)]
        self.end_id = int(options["end_id"])
        self.suppress_ids = [int(i) for i in options["suppress_ids"] if i >= 0]  # -1 pads the list in the file
        self.suppress_ids_begin = [int(i) for i in options["suppress_ids_begin"] if i >= 0]
        self._every_step = np.zeros(vocabulary_size, np.float32)
        self._every_step[self.suppress_ids] = -np.inf
        self._first_step = self._every_step.copy()
        self._first_step[self.suppress_ids_begin] = -np.inf

    def features(self, waveform):
        """Log-mel features `(1, 3000, 80)` of one 16 kHz window (`log_mel_features`)."""
        return log_mel_features(waveform, self.input_shape[1], self.input_shape[2])[None]

    def transcribe_ids(self, input_features, max_new_tokens=None):
        """Greedy ids after the prompt for one window of log-mel features `(1, 3000, 80)` (or `(3000, 80)`),
        ending with `end_id` unless `max_new_tokens` (default: what fits the cache after the prompt) ran out."""
        features = self._check_features(input_features)
        room = self.max_length - len(self.prompt)
        if max_new_tokens is None:
            max_new_tokens = room
        check_int("max_new_tokens", max_new_tokens, maximum=room, numpy=True,
                  expected=f"an integer in [1, {room}] (the file's cache of {self.max_length} positions after the "
                           "prompt)")
        self._start_window(features)
        for index, token in enumerate(self.prompt):  # prefill, one id per call
            logits = next_logits(self._step, token, index)
        new = []
        bias = self._first_step
        while True:
            token = int(np.argmax(logits + bias))
            new.append(token)
            if token == self.end_id or len(new) == max_new_tokens:
                return new
            logits = next_logits(self._step, token, len(self.prompt) + len(new) - 1)
            bias = self._every_step

    def _check_features(self, input_features):
        features = np.asarray(input_features, np.float32)
        if features.shape == self.input_shape[1:]:
            features = features[None]  # (1, F, M)
        if features.shape != self.input_shape:
            raise ValueError(f"`input_features` must have shape {self.input_shape} (one window). Received: "
                             f"shape={np.shape(input_features)}")
        return features

    def _start_window(self, features):
        """Encodes one window `(1, F, M)` (its cross-attention keys/values into `decode_step`'s input buffers) and
        zeroes the self-attention caches."""
        self._encode(input_features=features)
        zero_caches(self._step, self._caches)

    def transcribe_timestamp_ids(self, input_features, prompt_ids, ids, max_new_tokens,
                                 max_initial_timestamp=MAX_INITIAL_TIMESTAMP):
        """One window decoded greedily with Whisper's timestamp rules, as `models.whisper_decode.timestamp_decode_fn`
        decodes it in the graph: `(tokens, sum_logprobs, no_speech_prob)`.

        The `prompt_ids` (`<|startofprev|>` previous text ... the start sequence without `<|notimestamps|>`) are fed
        one id per call; the first step allows only timestamps up to `max_initial_timestamp` seconds (and the file's
        `suppress_ids_begin`), the next ones `tfformer.timestamps.timestamp_rules` (and `suppress_ids`). `tokens`:
        the ids chosen, without the end; `sum_logprobs`: the sum of their log-probabilities (of the masked logits),
        the end's included (not the last token's when `max_new_tokens` ran out); `no_speech_prob`: the probability
        of `ids.no_speech` after the prompt.
        """
        features = self._check_features(input_features)
        prompt, vocabulary_size = [int(token) for token in prompt_ids], len(self._every_step)
        if not prompt or not all(0 <= token < vocabulary_size for token in prompt):
            raise ValueError(f"`prompt_ids` must be a non-empty list of ids in [0, {vocabulary_size}). Received: "
                             f"prompt_ids={prompt_ids!r}")
        room = self.max_length + 1 - len(prompt)  # the last new token is never fed back
        check_int("max_new_tokens", max_new_tokens, maximum=room, numpy=True,
                  expected=f"an integer in [1, {room}] (the file's cache of {self.max_length} positions after the "
                           f"prompt of {len(prompt)} ids, plus one)")
        first = self._first_step + first_step_bias(vocabulary_size, ids, max_initial_timestamp)
        self._start_window(features)
        for index, token in enumerate(prompt):
            logits = next_logits(self._step, token, index)  # (V,) float32
        no_speech_prob = float(np.exp(log_softmax(logits)[ids.no_speech]))
        log_probs = log_softmax(logits + first)
        tokens, total, last, penultimate, last_timestamp = [], np.float32(0.0), NONE, NONE, NONE
        while True:
            token = int(np.argmax(log_probs))
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
            total += log_probs[token]
            if token == self.end_id:
                break
            penultimate = token if last == NONE else last
            last = token
            last_timestamp = token if token >= ids.timestamp_begin else last_timestamp
            logits = next_logits(self._step, token, len(prompt) + len(tokens) - 1) + self._every_step
            logits = timestamp_rules(logits[None], [last], [penultimate], [last_timestamp], self.end_id, ids)[0]
            log_probs = log_softmax(logits)
        return cut_at_end(tokens, self.end_id), float(total), no_speech_prob

    def ids_to_text(self, ids):
        """The text of generated ids: those before the first `end_id`, without special tokens (ids at or above
        `end_id`), stripped (as `WhisperModel.ids_to_text`)."""
        if self.tokenizer is None:
            raise ValueError("Text needs the host tokenizer: pass `tokenizer=` (the Whisper BytePairTokenizer) to "
                             "Transcriber.")
        ids = list(ids)
        ids = cut_at_end(ids, self.end_id)
        ids = [i for i in ids if i < self.end_id]
        if not ids:
            return ""
        value = self.tokenizer.detokenize(np.array(ids, np.int32))
        value = value.numpy() if hasattr(value, "numpy") else value
        value = value if isinstance(value, (str, bytes)) else np.asarray(value).reshape(-1)[0]
        return (value.decode("utf-8") if isinstance(value, bytes) else str(value)).strip()

    def transcribe(self, audio, sample_rate=None, max_new_tokens=None, timestamps=False):
        """The transcript of a WAV file or a waveform, as `WhisperModel.transcribe` gives it (greedy); with
        `timestamps=True`, its list of `Segment(start, end, text)` (`segments`).

        Audio longer than 30 seconds is cut at pauses (`tfformer.data.audio.split_windows`) and the window
        texts joined with a space (with `timestamps`, windows move by the last complete segment instead).

        Args:
            audio: a path to a WAV file (mixed down to mono, resampled), or a waveform array `(samples,)` of
                float samples in [-1, 1] or integer PCM.
            sample_rate: int. The waveform's rate in Hz (required for an array, resampled to 16 kHz).
            max_new_tokens: int or None. Tokens per window.
            timestamps: bool. Return the timestamped segments instead of a string.
        """
        if not isinstance(timestamps, bool):
            raise ValueError(f"`timestamps` must be True or False. Received: timestamps={timestamps!r}")
        if timestamps:
            return list(self.segments(audio, sample_rate, max_new_tokens=max_new_tokens))
        from tfformer.data import audio as audio_io

        waveform = self._waveform(audio, sample_rate)
        texts = [self.ids_to_text(self.transcribe_ids(self.features(waveform[start:end]), max_new_tokens))
                 for start, end in audio_io.split_windows(waveform)]
        return " ".join(text for text in texts if text)

    def segments(self, audio, sample_rate=None, max_new_tokens=None, condition_on_previous_text=True):
        """The timestamped `Segment(start, end, text)`s of one recording, yielded as each 30-second window is decoded:
        the long-form loop of `tfformer.models.transcript.segments` (`tfformer.timestamps.long_form_segments`) on
        the host, with a reduced window decoding.

        A window starts at `seek`; it is decoded greedily with Whisper's timestamp rules
        (`transcribe_timestamp_ids`), its complete segments are yielded, and the next window starts at the last
        complete segment's end (after the window when it ends with a lone timestamp). With
        `condition_on_previous_text`, each window's prompt holds `<|startofprev|>` and the last `max_length // 2 - 1`
        tokens so far. A window whose `<|nospeech|>` probability is above 0.6 and whose mean log-probability is not
        above -1.0 is skipped as silence. Only one window's features are held at a time.

        Reduced against the Keras path (`WhisperModel.segments`) and faster-whisper: greedy only, with no temperature
        fallback (a window whose text repeats itself or whose mean log-probability is low is kept, as the Keras
        path's `temperature=0` keeps it), no word timestamps. Per window, at most `max_length // 2` new tokens (the
        file's cache positions; faster-whisper's limits with a file of the default 448).

        Args:
            audio: a WAV path or a waveform array, as `transcribe`'s (one recording).
            sample_rate: int. The waveform's rate (required with an array).
            max_new_tokens: int or None. Tokens per window at most.
            condition_on_previous_text: bool. Prompt each window with the text so far.
        """
        ids, start_of_prev = self._timestamp_tokens()
        check_int("max_new_tokens", max_new_tokens, allow_none=True, numpy=True)
        if not isinstance(condition_on_previous_text, bool):
            raise ValueError("`condition_on_previous_text` must be True or False. Received: "
                             f"condition_on_previous_text={condition_on_previous_text!r}")
        waveform = self._waveform(audio, sample_rate)
        # The arguments are checked above, before the first window is decoded.
        return self._segments(waveform, ids, start_of_prev, max_new_tokens, condition_on_previous_text)

    def _segments(self, waveform, ids, start_of_prev, max_new_tokens, condition_on_previous_text):
        """`segments`' generator over a checked 16 kHz waveform: `tfformer.timestamps.long_form_segments` with
        greedy window decoding."""

        def decode(features, prompt):
            budget = min(self.max_length // 2, self.max_length + 1 - len(prompt), max_new_tokens or self.max_length)
            tokens, total, no_speech_prob = self.transcribe_timestamp_ids(features, prompt, ids, budget)
            # faster-whisper's mean counts the end too; greedy, no compression ratio (no fallback)
            return Decoded(tokens, total / (len(tokens) + 1), 0.0, None, no_speech_prob)

        loop = WindowLoop(
            features=lambda samples: self.features(samples), decode=decode,
            texts=lambda rows: [self.ids_to_text(row) for row in rows],
            start_ids=start_sequence(self.prompt, ids), start_of_prev=start_of_prev,
            timestamp_begin=ids.timestamp_begin, max_previous=max(self.max_length // 2 - 1, 0),
            window_frames=self.input_shape[1], condition_on_previous_text=condition_on_previous_text)
        yield from long_form_segments(waveform, loop)

    def _timestamp_tokens(self):
        """`(TimestampIds, <|startofprev|>)` from the tokenizer."""
        if self.tokenizer is None:
            raise ValueError("Timestamps need the host tokenizer: pass `tokenizer=` (the Whisper BytePairTokenizer) "
                             "to Transcriber.")
        vocabulary = getattr(self.tokenizer, "token_to_id", None)
        ids = timestamp_ids(vocabulary)
        if not self.end_id < ids.no_timestamps < ids.timestamp_begin < len(self._every_step):
            raise ValueError(f"The tokenizer's timestamp tokens {ids} do not fit the file's vocabulary of "
                             f"{len(self._every_step)} ids after end_id={self.end_id}: pass this file's tokenizer.")
        return ids, vocabulary["<|startofprev|>"]

    def _waveform(self, audio, sample_rate):
        """The 16 kHz mono float32 waveform of a WAV path or a waveform array, checked."""
        import os

        from tfformer.data import audio as audio_io

        if isinstance(audio, (str, os.PathLike)):
            if sample_rate is not None:
                raise ValueError(f"`sample_rate` applies to waveform arrays; a WAV file carries its own rate. "
                                 f"Received: sample_rate={sample_rate!r}")
            path = os.fspath(audio)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"`audio` is not a file. Received: {path!r}")
            return audio_io.read_wav(path)
        if isinstance(audio, np.ndarray):
            if sample_rate is None:
                raise ValueError("`sample_rate` is required with a waveform array: pass the rate in Hz "
                                 "(e.g. sample_rate=16000).")
            return audio_io.prepare_waveform(audio, sample_rate, name="`audio`")
        raise ValueError(f"`audio` must be a path to a WAV file or a waveform array. Received: "
                         f"{type(audio).__name__}")
