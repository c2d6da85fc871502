"""Whisper (Radford et al., 2022): the encoder-decoder Transformer over log-mel frames."""

import math

import keras
import numpy as np
from keras import ops

from tfformer import layers
from tfformer.layers.layer_utils import check_positive_int
from tfformer.models import base
from tfformer.models.seq2seq import Seq2SeqTransformer


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
        check_positive_int("max_sequence_length", max_sequence_length)
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
    `decode_step(token_ids, cache, cache_index, cross_caches, None)`; `tfformer.generation.speech` runs the
    greedy loop with Whisper's token suppression.
    """

    def _build(self, config):
        if config.num_mel_bins is None or config.max_source_positions is None:
            raise ValueError(
                "A Whisper model needs `num_mel_bins` and `max_source_positions`. Received: "
                f"num_mel_bins={config.num_mel_bins}, max_source_positions={config.max_source_positions}"
            )
        init = base.kernel_initializer(config)
        conv = lambda strides, name: keras.layers.Conv1D(  # noqa: E731
            config.hidden_dim, 3, strides=strides, padding="valid", activation="gelu", kernel_initializer=init,
            name=name,
        )
        # Padding 1 on both sides: "same" would pad the stride-2 convolution on the right only.
        conv1_padding = keras.layers.ZeroPadding1D(1, name="conv1_padding")
        conv1 = conv(1, "conv1")
        conv2_padding = keras.layers.ZeroPadding1D(1, name="conv2_padding")
        conv2 = conv(2, "conv2")
        encoder_position = WhisperPositionTable(config.max_source_positions, name="encoder_position")
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, name="token_embedding"
        )
        output_projection = None
        if not config.tie_embeddings:
            output_projection = keras.layers.Dense(
                config.vocabulary_size, kernel_initializer=init, dtype="float32", name="output_projection"
            )
        decoder_position = base.position_layer(config, "decoder_position")
        encoder_dropout = layers.Dropout(config.dropout, name="encoder_embedding_dropout")
        decoder_dropout = layers.Dropout(config.dropout, name="decoder_embedding_dropout")
        encoder_blocks = base.encoder_blocks(config)
        decoder_blocks = base.decoder_blocks(config)
        encoder_norm = base.final_norm(config, "encoder_norm")
        decoder_norm = base.final_norm(config, "decoder_norm")

        # === Functional model ===
        features = keras.Input(shape=(None, config.num_mel_bins), dtype="float32", name="input_features")
        decoder_ids = base.token_ids_input("decoder_token_ids")

        x = conv2(conv2_padding(conv1(conv1_padding(features))))  # (B, F / 2, D)
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
            stem=[conv1_padding, conv1, conv2_padding, conv2],
            token_embedding=token_embedding,
            decoder_token_embedding=token_embedding,
            output_projection=output_projection,
            encoder_position=encoder_position,
            decoder_position=decoder_position,
            encoder_blocks=encoder_blocks,
            decoder_blocks=decoder_blocks,
            encoder_norm=encoder_norm,
            decoder_norm=decoder_norm,
            projection_inputs=y if output_projection is None else None,  # (B, T, D)
        )
        return inputs, logits, sublayers

    # === Incremental decoding ===
    def encode(self, input_features):
        """Encoder outputs `(B, F / 2, D)` of log-mel frames `(B, F, num_mel_bins)` (inference mode), and
        `None`: no encoder padding mask (the decode loops pass it on to `decode_step`)."""
        x = input_features
        if x.shape[-1] != self.config.num_mel_bins:
            raise ValueError(f"`input_features` must be (batch, frames, num_mel_bins={self.config.num_mel_bins}). "
                             f"Received: shape={tuple(x.shape)}")
        for layer in self.stem:
            x = layer(x)  # (B, F / 2, D) after the stride-2 convolution
        x = x + self.encoder_position(x)
        for block in self.encoder_blocks:
            x = block(x)
        return (self.encoder_norm(x) if self.encoder_norm else x), None


def build_whisper(config):
    """Build a Whisper encoder-decoder from a `TransformerConfig` (or dict) with `num_mel_bins` and
    `max_source_positions`."""
    config = base.as_config(config)
    if config.architecture != "speech_seq2seq":
        config = config.replace(architecture="speech_seq2seq")
    return WhisperModel(config)
