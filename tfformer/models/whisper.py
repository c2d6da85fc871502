"""Whisper (Radford et al., 2022): the encoder-decoder Transformer over log-mel frames."""

import math
import os

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfformer import layers
from tfformer.checks import check_int, is_int
from tfformer.data import audio as audio_io
from tfformer.models import whisper_decode as speech
from tfformer.models import base, transcript
from tfformer.models.seq2seq import Seq2SeqTransformer
from tfformer.tokens import cut_at_end

# The encoder's self-attention over Whisper's 1,500 frames, 250 queries at a time (`layer_utils.in_query_chunks`):
# whisper-tiny's scores, 9 MB a layer instead of 54, come from malloc's heap instead of fresh pages faulted in at every
# window. AMD EPYC Zen 3, 2 threads: a window 0.49 s against 0.64 in the graph runtime, 0.47 against 0.51 under XLA
# (medians of 4 rounds); the same encoder outputs within 6e-6; TFLite files unchanged in speed (8 clips 3.5 s).
ENCODER_QUERY_CHUNK = 250


def whisper_sinusoids(length, channels):
    """Whisper's encoder positions `(length, channels)`: `[sin | cos]` halves with timescales
    `10000 ** (-k / (channels / 2 - 1))` (its own formula, not the paper's interleaving)."""
    if channels % 2:
        raise ValueError(f"Whisper's sinusoids need an even width. Received: channels={channels}")
    increment = math.log(10000) / (channels // 2 - 1)
    inv_timescales = np.exp(-increment * np.arange(channels // 2))  # (channels / 2,)
    angles = np.arange(length)[:, None] * inv_timescales[None, :]  # (length, channels / 2)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


@keras.saving.register_keras_serializable(package="tfformer")
class WhisperPositionTable(keras.layers.Layer):
    """Whisper's fixed sinusoidal encoder positions as a non-trainable table.

    A weight rather than a constant so that a checkpoint's stored table (CTranslate2 keeps it in float16)
    loads into it and the model computes with exactly the values the reference engine uses. Returns the
    positions of the input's timesteps (it does not add them).

    Args:
        max_sequence_length: int. Number of positions (Whisper: 1500, i.e. 30 s after the stride-2 stem).
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: `(B, T, D)`; only its shape is read. `T` must be at most `max_sequence_length`.

    Returns:
        `(B, T, D)`.
    """

    def __init__(self, max_sequence_length, **kwargs):
        check_int("max_sequence_length", max_sequence_length)
        super().__init__(**kwargs)
        self.max_sequence_length = max_sequence_length

    def build(self, inputs_shape):
        table = whisper_sinusoids(self.max_sequence_length, inputs_shape[-1])
        self.embeddings = self.add_weight(
            name="embeddings", shape=table.shape, initializer=lambda shape, dtype=None: table, trainable=False
        )
        self.built = True

    def call(self, inputs):
        shape = ops.shape(inputs)
        length = shape[-2]
        if isinstance(length, int) and length > self.max_sequence_length:
            raise ValueError(
                f"The encoder input has {length} positions after the stem; at most "
                f"max_source_positions={self.max_sequence_length} (twice as many frames) are supported."
            )
        table = ops.convert_to_tensor(self.embeddings)
        positions = ops.slice(table, (0, 0), (length, table.shape[-1]))  # (T, D)
        return ops.broadcast_to(ops.cast(positions, self.compute_dtype), shape)

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update({"max_sequence_length": self.max_sequence_length})
        return config


def _stem(config, dtype):
    """Whisper's convolution stem over the log-mel frames: two GELU convolutions of width 3, the second with
    stride 2, each after a padding of 1 on both sides ("same" would pad the stride-2 convolution on the right
    only). Returns `[conv1_padding, conv1, conv2_padding, conv2]`."""
    def conv(strides, name):
        return keras.layers.Conv1D(config.hidden_dim, 3, strides=strides, padding="valid", activation="gelu",
                                   kernel_initializer=base.kernel_initializer(config), dtype=dtype, name=name)

    return [keras.layers.ZeroPadding1D(1, dtype=dtype, name="conv1_padding"), conv(1, "conv1"),
            keras.layers.ZeroPadding1D(1, dtype=dtype, name="conv2_padding"), conv(2, "conv2")]


@keras.saving.register_keras_serializable(package="tfformer")
class WhisperModel(Seq2SeqTransformer):
    """Whisper's encoder-decoder: a convolutional stem on log-mel frames, pre-LN blocks, a tied output.

    Encoder: two `Conv1D` (kernel 3, padding 1; the second with stride 2, halving the frames), each followed
    by exact GELU, plus Whisper's fixed sinusoidal positions (`WhisperPositionTable`), then pre-LN encoder
    blocks and a final LayerNorm. Decoder: token embeddings (not scaled by sqrt(d) when
    `scale_embeddings=False`, as in Whisper) plus learned positions, pre-LN causal blocks with
    cross-attention, a final LayerNorm, and the token embedding as the output projection. Whisper's key
    projections have no bias; here they have one, loaded as zeros (the same function).

    Inputs: `{"input_features": (B, F, num_mel_bins) float32, "decoder_token_ids": (B, T) int32}`, `F` at most
    `2 * max_source_positions` frames (Whisper: 3000 frames, 30 s of `tfformer.data.audio.log_mel_spectrogram`).
    Output: logits `(B, T, V)` float32; position `t` depends only on decoder tokens `<= t`. There is no
    padding id (Whisper's id 0 is "!"): the decoder is causal only, so right-padding never changes the logits
    of real positions; mask padded labels in the loss. The encoder attends over every frame (Whisper pads audio
    with zero features, not with a mask).

    Decoding (as `Seq2SeqTransformer`): `encode(features)`, `cross_attention_caches`, `empty_cache`,
    `decode_step(token_ids, cache, cache_index, cross_caches, None)`; `tfformer.models.whisper_decode` runs the
    greedy or beam search loop with Whisper's token suppression. `transcribe(audio)` goes from WAV files or
    waveforms to text with the decoding fields below and the tokenizer in `preprocessor`;
    `tfformer.models.from_preset("whisper-tiny-en")` sets both.

    Args:
        config: `TransformerConfig` (or dict) with `num_mel_bins` and `max_source_positions`.
        prompt: list of int. The ids every transcript starts from (defaults to English-only Whisper's
            `<|startoftranscript|>` `<|notimestamps|>`).
        suppress_ids: list of int. Ids never produced (a checkpoint's `suppress_ids`).
        suppress_ids_begin: list of int. Ids not produced first (blank, end of text).
        alignment_heads: list of (layer, head). The cross-attention heads word timestamps align with (a
            checkpoint's `alignment_heads`).
        end_id: int. The end-of-text id; ids at or above it are Whisper's special tokens, not text.
        **kwargs: `keras.Model` arguments (`name`).

    Example:
    ```python
    asr = tfformer.models.from_preset("whisper-tiny-en")
    asr.transcribe("clip.wav")                          # "The quick brown fox ..."
    asr.transcribe(samples, sample_rate=44100)          # a float waveform, resampled to 16 kHz
    asr.transcribe("clip.wav", beam_size=5)             # faster-whisper's default beam search
    ```
    """

    def __init__(self, config, prompt=speech.WHISPER_PROMPT, suppress_ids=(), suppress_ids_begin=(),
                 end_id=speech.WHISPER_END_ID, alignment_heads=(), **kwargs):
        super().__init__(config, **kwargs)
        # Checked against the vocabulary when a decoding function is built (`models.whisper_decode.speech_decode_fn`).
        self.prompt = _int_list("prompt", prompt)
        self.suppress_ids = _int_list("suppress_ids", suppress_ids)
        self.suppress_ids_begin = _int_list("suppress_ids_begin", suppress_ids_begin)
        check_int("end_id", end_id, minimum=None, numpy=True, expected="an int")
        self.end_id = int(end_id)
        pairs = [tuple(pair) for pair in alignment_heads] if isinstance(alignment_heads, (list, tuple)) else None
        if pairs is None or not all(len(p) == 2 and all(is_int(i, numpy=True) for i in p) for p in pairs):
            raise ValueError("`alignment_heads` must be a list of (layer, head) int pairs. Received: "
                             f"alignment_heads={alignment_heads!r}")
        self.alignment_heads = tuple((int(layer), int(head)) for layer, head in pairs)

    def get_config(self):
        config = super().get_config()
        config.update(prompt=list(self.prompt), suppress_ids=list(self.suppress_ids),
                      suppress_ids_begin=list(self.suppress_ids_begin), end_id=self.end_id,
                      alignment_heads=[list(pair) for pair in self.alignment_heads])
        return config

    def _build(self, config, dtype):
        if config.num_mel_bins is None or config.max_source_positions is None:
            raise ValueError(
                "A Whisper model needs `num_mel_bins` and `max_source_positions`. Received: "
                f"num_mel_bins={config.num_mel_bins}, max_source_positions={config.max_source_positions}"
            )
        init = base.kernel_initializer(config)
        stem = _stem(config, dtype)  # [pad, conv1, pad, conv2]
        encoder_position = WhisperPositionTable(config.max_source_positions, dtype=dtype, name="encoder_position")
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, dtype=dtype,
            name="token_embedding",
        )
        output_projection = None
        if not config.tie_embeddings:
            output_projection = keras.layers.Dense(
                config.vocabulary_size, kernel_initializer=init, dtype="float32", name="output_projection"
            )
        decoder_position = base.position_layer(config, "decoder_position", dtype)
        (encoder_dropout, decoder_dropout, encoder_blocks, decoder_blocks, encoder_norm,
         decoder_norm) = base.encoder_decoder_stacks(config, dtype)

        # === Functional model ===
        features = keras.Input(shape=(None, config.num_mel_bins), dtype="float32", name="input_features")
        decoder_ids = base.token_ids_input("decoder_token_ids")

        x = features
        for layer in stem:
            x = layer(x)  # (B, F + 2, n_mels), (B, F, D), (B, F + 2, D), (B, F / 2, D)
        x = encoder_dropout(x + encoder_position(x))
        for block in encoder_blocks:
            x = block(x)
        encoder_outputs = encoder_norm(x) if encoder_norm else x

        y = decoder_dropout(base.embed_tokens(token_embedding, decoder_position, decoder_ids))  # (B, T, D)
        for block in decoder_blocks:
            y = block(y, encoder_outputs)
        if decoder_norm:
            y = decoder_norm(y)
        logits = token_embedding(y, reverse=True) if output_projection is None else output_projection(y)  # (B, T, V)

        inputs = {"input_features": features, "decoder_token_ids": decoder_ids}
        sublayers = dict(
            stem=stem,
            token_embedding=token_embedding,
            decoder_token_embedding=token_embedding,
            output_projection=output_projection,
            encoder_position=encoder_position,
            decoder_position=decoder_position,
            encoder_blocks=encoder_blocks,
            decoder_blocks=decoder_blocks,
            encoder_norm=encoder_norm,
            decoder_norm=decoder_norm,
            hidden_states=y,  # (B, T, D)
            projection_inputs=y if output_projection is None else None,  # (B, T, D)
        )
        return inputs, logits, sublayers

    # === Speech in, text out ===
    def transcribe(self, audio, sample_rate=None, max_new_tokens=None, batch_size=8, beam_size=1,
                   length_penalty=1.0, patience=1.0, jit_compile=None, timestamps=False, **options):
        """Transcribe WAV files or waveforms, greedily or with beam search; with `timestamps`, into `Segment`s.

        `timestamps=True` returns, per input, the list of `segments(...)`: faster-whisper's long-form
        transcription (windows moved by the last timestamp, conditioned on the previous text, with its fallback;
        greedy, `beam_size=1`), `options` as `segments`'. Without it, the plain transcription below.

        Audio longer than 30 seconds is cut into windows of at most 30 seconds by
        `tfformer.data.audio.split_windows`, each cut in the quietest stretch of the window's last 5 seconds
        (a pause, when there is one), so that a word is cut only when a window's last 5 seconds hold no
        pause. Each window is transcribed on its own (no text of the previous window is given as a prompt,
        unlike faster-whisper) and the window texts are joined with a space. Each window's log-mel features
        are normalised over that window (faster-whisper normalises over the whole recording).

        `beam_size` 1 decodes greedily; a larger one runs CTranslate2's beam search as faster-whisper calls it
        (`tfformer.models.whisper_decode.whisper_sampler`; faster-whisper's own default is `beam_size=5`,
        `length_penalty=1`, `patience=1`): `beam_size` hypotheses search on, those that end are set aside, the
        search stops after `round(beam_size * patience)` have ended, and the best by `score / length **
        length_penalty` wins (with 1: the mean log-probability of its tokens).

        Args:
            audio: a path to a WAV file (str or `os.PathLike`; any sample rate, mixed down to mono with a
                warning when it has several channels), a waveform array `(samples,)` (or `(samples,
                channels)`, mixed down the same way) of float samples in [-1, 1] or integer PCM, or a list of
                these.
            sample_rate: int. Sample rate of the waveform arrays in Hz, resampled to 16 kHz with soxr.
                Required when `audio` holds an array; not allowed for paths only (a WAV file has its own).
            max_new_tokens: int or None. Tokens per 30-second window; None allows what fits the decoder
                after the prompt.
            batch_size: int. Windows per decoding call (each holds `num_heads * 1500 ** 2` encoder
                attention weights, and `beam_size` copies of its cross-attention keys and values).
            beam_size: int >= 1. Hypotheses searched per window; 1 is greedy.
            length_penalty: float. Exponent of the length in the beam score's normalization.
            patience: float > 0. Beam search stops after `round(beam_size * patience)` hypotheses ended.
            jit_compile: bool or None. Decode with XLA. None: with `timestamps`, True (`TranscriptOptions`'
                default: the loop compiles once per batch size); without, False.
            timestamps: bool. Return segments with start and end times instead of strings.
            **options: with `timestamps`, `tfformer.models.transcript.TranscriptOptions` by name.

        Returns:
            str for a single path or array, list of str for a list; with `timestamps`, a list of `Segment` for a
            single input, a list of such lists for a list.

        Raises:
            FileNotFoundError: a path that is not a file.
            ValueError: not a WAV file, an empty waveform, NaN or infinite samples, a missing or
                non-positive `sample_rate`, `audio` of another type, an empty list, no preprocessor.
        """
        if self.preprocessor is None:
            raise ValueError("`transcribe` turns ids into text with the tokenizer, and this WhisperModel has no "
                             "preprocessor. Set `model.preprocessor = tokenizer` or load it with "
                             "`tfformer.models.from_preset`.")
        check_int("batch_size", batch_size)
        sampler = speech.whisper_sampler(beam_size, length_penalty, patience)
        if timestamps is not False or options:
            if jit_compile is not None:
                options["jit_compile"] = jit_compile
            return self._transcribe_segments(audio, sample_rate, max_new_tokens, beam_size, timestamps, options)
        waveforms, single = _as_waveforms(audio, sample_rate)
        windows = [(index, waveform[start:end]) for index, waveform in enumerate(waveforms)
                   for start, end in audio_io.split_windows(waveform)]
        texts = [[] for _ in waveforms]
        for first in range(0, len(windows), batch_size):
            part = windows[first:first + batch_size]
            lengths = [len(piece) for _, piece in part]
            batch = np.zeros((len(part), max(lengths)), np.float32)  # (B, S)
            for row, (_, piece) in zip(batch, part):
                row[:len(piece)] = piece
            features = audio_io.window_log_mel(batch, lengths)  # (B, 3000, num_mel_bins)
            ids = speech.transcribe_ids(self, features, max_new_tokens=max_new_tokens, prompt=self.prompt,
                                        suppress_ids=self.suppress_ids, suppress_ids_begin=self.suppress_ids_begin,
                                        end_id=self.end_id, sampler=sampler, jit_compile=bool(jit_compile))  # (B, N)
            for (index, _), text in zip(part, self.ids_to_text(ids)):
                texts[index].append(text)
        results = [" ".join(text for text in parts if text) for parts in texts]
        return results[0] if single else results

    def _transcribe_segments(self, audio, sample_rate, max_new_tokens, beam_size, timestamps, options):
        """`transcribe(..., timestamps=True, **options)`: each input's `segments` as a list."""
        if options.get("word_timestamps") and timestamps is not True:
            raise ValueError("`word_timestamps=True` needs `timestamps=True`: word times belong to timestamped "
                             f"segments. Received: timestamps={timestamps!r}")
        if timestamps is not True:
            raise ValueError("`timestamps` must be True or False; the options "
                             f"{sorted(options)} apply with timestamps=True. Received: timestamps={timestamps!r}")
        if beam_size != 1:
            raise ValueError(f"Timestamped transcription decodes greedily: `beam_size` must be 1. Received: "
                             f"beam_size={beam_size!r}")
        options = transcript.TranscriptOptions.from_kwargs(max_new_tokens=max_new_tokens, **options)
        sources, single = _sources(audio, sample_rate)
        results = [list(transcript.segments(self, source, options)) for source in sources]
        return results[0] if single else results

    def segments(self, audio, sample_rate=None, **options):
        """Yield the timestamped `Segment(start, end, text)`s of one recording as each 30-second window is decoded
        (faster-whisper's `transcribe` with `beam_size=1`, no VAD; `tfformer.models.transcript`).

        Args:
            audio: a WAV path or a waveform array, as `transcribe`'s (one recording).
            sample_rate: int. The waveform's rate (required with an array, as `transcribe`'s).
            **options: `tfformer.models.transcript.TranscriptOptions` by name: `condition_on_previous_text`
                (True), `temperature` ((0.0, 0.2, ..., 1.0)), `compression_ratio_threshold` (2.4),
                `log_prob_threshold` (-1.0), `no_speech_threshold` (0.6), `prompt_reset_on_temperature` (0.5),
                `max_initial_timestamp` (1.0), `best_of` (5), `max_new_tokens`, `seed`, `word_timestamps` (False),
                `jit_compile` (True).
        """
        if isinstance(audio, (list, tuple)):
            raise ValueError("`audio` must be one WAV path or waveform array for `segments`; call it per recording "
                             f"or use transcribe(..., timestamps=True). Received: a {type(audio).__name__}")
        options = transcript.TranscriptOptions.from_kwargs(**options)
        sources, _ = _sources(audio, sample_rate)
        yield from transcript.segments(self, sources[0], options)

    def generate(self, inputs, **kwargs):
        """`transcribe(inputs, **kwargs)`: Whisper generates text from audio, not from source texts."""
        return self.transcribe(inputs, **kwargs)

    def ids_to_text(self, ids):
        """str per row of generated ids `(B, N)`: the ids before the first `end_id`, without special tokens
        (ids at or above `end_id`, as Whisper's tokenizer decodes), stripped of surrounding spaces."""
        rows = []
        for row in np.asarray(ids).tolist():
            rows.append([i for i in cut_at_end(row, self.end_id) if i < self.end_id])
        ragged = tf.ragged.constant(rows, dtype=tf.int32, ragged_rank=1)  # (B, None)
        return [text.decode("utf-8").strip() for text in self.preprocessor.detokenize(ragged).numpy()]

    # === Incremental decoding ===
    def encode(self, input_features, query_chunk_size=ENCODER_QUERY_CHUNK):
        """Encoder outputs `(B, F / 2, D)` of log-mel frames `(B, F, num_mel_bins)` (inference mode), and
        `None`: no encoder padding mask (the decode loops pass it on to `decode_step`). `query_chunk_size`: the
        self-attention's queries this many at a time (`EncoderBlock`'s; None: all 1,500 at once)."""
        x = input_features
        if x.shape[-1] != self.config.num_mel_bins:
            raise ValueError(f"`input_features` must be (batch, frames, num_mel_bins={self.config.num_mel_bins}). "
                             f"Received: shape={tuple(x.shape)}")
        for layer in self.stem:
            x = layer(x)  # (B, F / 2, D) after the stride-2 convolution
        x = x + self.encoder_position(x)
        for block in self.encoder_blocks:
            x = block(x, query_chunk_size=query_chunk_size)
        return (self.encoder_norm(x) if self.encoder_norm else x), None


def _int_list(name, ids):
    if isinstance(ids, (str, bytes)) or not all(is_int(i, numpy=True) for i in ids):
        raise ValueError(f"`{name}` must be a list of int ids. Received: {name}={ids!r}")
    return tuple(int(i) for i in ids)


def _as_waveforms(audio, sample_rate):
    """`(list of 16 kHz float32 waveforms, single)` for `WhisperModel.transcribe`'s `audio`."""
    single = isinstance(audio, (str, os.PathLike, np.ndarray)) or tf.is_tensor(audio)
    items = [audio] if single else audio
    if not isinstance(items, (list, tuple)):
        raise ValueError("`audio` must be a path to a WAV file, a waveform array, or a list of them. Received: "
                         f"{type(audio).__name__}")
    if not items:
        raise ValueError("`audio` is an empty list; pass at least one WAV path or waveform array.")
    kinds = []
    for i, item in enumerate(items):
        if isinstance(item, (str, os.PathLike)):
            kinds.append("path")
        elif isinstance(item, np.ndarray) or tf.is_tensor(item):
            kinds.append("array")
        else:
            raise ValueError(f"`audio[{i}]` must be a path to a WAV file or a waveform array. Received: "
                             f"{type(item).__name__}")
    if "array" in kinds and sample_rate is None:
        raise ValueError("`sample_rate` is required with a waveform array: pass the rate the samples were "
                         "recorded at in Hz (e.g. sample_rate=16000).")
    if "array" not in kinds and sample_rate is not None:
        raise ValueError(f"`sample_rate` applies to waveform arrays; a WAV file carries its own rate. Received: "
                         f"sample_rate={sample_rate!r} with file paths only.")
    waveforms = []
    for i, (item, kind) in enumerate(zip(items, kinds)):
        name = "`audio`" if single else f"`audio[{i}]`"
        if kind == "path":
            path = os.fspath(item)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name} is not a file. Received: {path!r}")
            waveforms.append(audio_io.read_wav(path))
            continue
        array = np.asarray(item)
        if array.ndim == 2 and array.shape[1] > array.shape[0]:
            raise ValueError(f"{name} must have shape (samples,) or (samples, channels); shape {array.shape} has "
                             "more channels than samples. Pass a batch of waveforms as a list of 1-D arrays.")
        waveforms.append(audio_io.prepare_waveform(array, sample_rate, name=name))
    return waveforms, single


def _sources(audio, sample_rate):
    """`_as_waveforms`' inputs, with WAV files only opened (`audio_io.open_wav`: a 16 kHz file is read a window at a
    time, so memory stays flat with a recording's length); every file is checked before any is decoded."""
    single = isinstance(audio, (str, os.PathLike))
    items = [audio] if single else audio
    if not (isinstance(items, (list, tuple)) and items and sample_rate is None
            and all(isinstance(item, (str, os.PathLike)) for item in items)):
        return _as_waveforms(audio, sample_rate)
    for i, item in enumerate(items):
        if not os.path.isfile(os.fspath(item)):
            name = "`audio`" if single else f"`audio[{i}]`"
            raise FileNotFoundError(f"{name} is not a file. Received: {os.fspath(item)!r}")
    return [audio_io.open_wav(os.fspath(item)) for item in items], single


def build_whisper(config, dtype=None):
    """Build a Whisper encoder-decoder from a `TransformerConfig` (or dict) with `num_mel_bins` and
    `max_source_positions`. `dtype`: the
    dtype policy of every layer (`TransformerModel`'s `dtype`; None: the global one)."""
    config = base.as_config(config)
    if config.architecture != "speech_seq2seq":
        config = config.replace(architecture="speech_seq2seq")
    return WhisperModel(config, dtype=dtype)
