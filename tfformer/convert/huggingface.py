"""Hugging Face BERT checkpoints (`config.json` + `model.safetensors`) into `TransformerEncoder`.

Every tensor is mapped by name and checked for shape; anything missing,
unexpected or mis-shaped is a one-line ValueError that names the file and the
tensor. No torch: the weights are read with `safetensors.numpy`.
"""

import json
import os
import struct

import numpy as np
import safetensors.numpy

from tfformer.data.bert_tokenizer import read_vocabulary
from tfformer.models.config import TransformerConfig
from tfformer.models.encoder import build_encoder

# `hidden_act` values of transformers' BERT and the FeedForward activation that computes the same function:
# "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation.
HIDDEN_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_approximate", "gelu_pytorch_tanh": "gelu_approximate"}
# Buffers that PyTorch saves with the weights; they carry no parameters.
IGNORED_TENSORS = ("embeddings.position_ids",)
# safetensors dtypes we accept for weights (cast to float32).
FLOAT_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_config(path):
    """`config.json` of a BERT checkpoint dir, as a `TransformerConfig` for `build_encoder`."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{config_path} not found: `path` must be a Hugging Face checkpoint directory.")
    with open(config_path, encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_path} is not valid JSON: {error}") from None
    model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
    if model_type != "bert" or not architectures or not all(str(a).startswith("Bert") for a in architectures):
        raise ValueError(
            f"{config_path} describes model_type={model_type!r}, architectures={architectures!r}; "
            "only BERT checkpoints (model_type 'bert', architectures 'Bert*') can be converted."
        )
    checks = {
        "hidden_act": tuple(HIDDEN_ACTIVATIONS),
        "position_embedding_type": ("absolute",),
        "pad_token_id": (0,),  # tfformer encoders treat id 0 as padding
    }
    for key, allowed in checks.items():
        if key in hf and hf[key] not in allowed:
            raise ValueError(f"{config_path}: `{key}` must be one of {allowed}. Received: {key}={hf[key]!r}")
    for key in ("hidden_act", "vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                "num_hidden_layers", "max_position_embeddings", "type_vocab_size", "layer_norm_eps"):
        if key not in hf:
            raise ValueError(f"{config_path} is missing the field {key!r}.")
    try:
        return TransformerConfig(
            architecture="encoder",
            vocabulary_size=hf["vocab_size"],
            hidden_dim=hf["hidden_size"],
            num_heads=hf["num_attention_heads"],
            intermediate_dim=hf["intermediate_size"],
            num_encoder_layers=hf["num_hidden_layers"],
            num_decoder_layers=0,
            dropout=hf.get("hidden_dropout_prob", 0.1),
            max_sequence_length=hf["max_position_embeddings"],
            activation=HIDDEN_ACTIVATIONS[hf["hidden_act"]],
            norm_first=False,
            layer_norm_epsilon=hf["layer_norm_eps"],
            position="learned",
            scale_embeddings=False,
            num_segments=hf["type_vocab_size"],
            initializer_range=hf.get("initializer_range"),
        )
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None


def expected_shapes(config):
    """Hugging Face tensor name -> shape, for a BERT of `config` (pooler included)."""
    d, f, n = config.hidden_dim, config.intermediate_dim, config.num_encoder_layers
    shapes = {
        "embeddings.word_embeddings.weight": (config.vocabulary_size, d),
        "embeddings.position_embeddings.weight": (config.max_sequence_length, d),
        "embeddings.token_type_embeddings.weight": (config.num_segments, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
        "pooler.dense.weight": (d, d),
        "pooler.dense.bias": (d,),
    }
    for i in range(n):
        prefix = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes[prefix + name + ".weight"] = (d, d)
            shapes[prefix + name + ".bias"] = (d,)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[prefix + name + ".weight"] = (d,)
            shapes[prefix + name + ".bias"] = (d,)
        shapes[prefix + "intermediate.dense.weight"] = (f, d)
        shapes[prefix + "intermediate.dense.bias"] = (f,)
        shapes[prefix + "output.dense.weight"] = (d, f)
        shapes[prefix + "output.dense.bias"] = (d,)
    return shapes


def read_safetensors_header(weights_path):
    """The JSON header of a safetensors file, checked against the file size.

    Catches a truncated file before safetensors does, so the error can name
    the first tensor whose bytes are missing.
    """
    size = os.path.getsize(weights_path)
    with open(weights_path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{weights_path} is truncated: {size} bytes, not even the 8-byte header length.")
        (header_size,) = struct.unpack("<Q", prefix)
        if 8 + header_size > size:
            raise ValueError(
                f"{weights_path} is truncated: its header needs {header_size} bytes, "
                f"the file has {size - 8} after the length."
            )
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{weights_path} is not a safetensors file: bad header ({error}).") from None
    header.pop("__metadata__", None)
    available = size - 8 - header_size
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][1]):
        begin, end = info["data_offsets"]
        if end > available:
            raise ValueError(
                f"{weights_path} is truncated: tensor {name!r} needs bytes [{begin}, {end}) of the data section, "
                f"which has only {available}."
            )
        expected = int(np.prod(info["shape"], dtype=np.int64)) * _DTYPE_BYTES.get(info["dtype"], 0)
        if expected and end - begin != expected:
            raise ValueError(
                f"{weights_path}: tensor {name!r} has {end - begin} bytes for shape {info['shape']} {info['dtype']}."
            )
    return header


def read_weights(weights_path, config):
    """Hugging Face tensor name -> float32 array, every name and shape checked."""
    header = read_safetensors_header(weights_path)
    # BertFor* checkpoints nest the encoder under "bert.".
    prefix = "bert." if header and all(name.startswith("bert.") for name in header) else ""
    names = {name[len(prefix) :]: name for name in header}
    expected = expected_shapes(config)
    optional = {"pooler.dense.weight", "pooler.dense.bias"}
    unexpected = sorted(set(names) - set(expected) - set(IGNORED_TENSORS))
    if unexpected:
        raise ValueError(
            f"{weights_path}: unexpected tensor {names[unexpected[0]]!r} ({len(unexpected)} in all); "
            "a BERT of this config.json has no such weight."
        )
    for name, shape in expected.items():
        if name not in names:
            if name in optional:
                continue
            raise ValueError(f"{weights_path}: missing tensor {prefix + name!r} (expected shape {shape}).")
        info = header[names[name]]
        if tuple(info["shape"]) != shape:
            raise ValueError(
                f"{weights_path}: tensor {names[name]!r} has shape {tuple(info['shape'])}, "
                f"expected {shape} from config.json."
            )
        if info["dtype"] not in FLOAT_DTYPES:
            raise ValueError(
                f"{weights_path}: tensor {names[name]!r} has dtype {info['dtype']}; "
                f"expected one of {sorted(FLOAT_DTYPES)}."
            )
    if ("pooler.dense.weight" in names) != ("pooler.dense.bias" in names):
        missing = "pooler.dense.bias" if "pooler.dense.weight" in names else "pooler.dense.weight"
        raise ValueError(f"{weights_path}: missing tensor {prefix + missing!r} (the pooler has only half its weights).")
    try:
        tensors = safetensors.numpy.load_file(weights_path)
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(f"{weights_path} could not be read: {error}") from None
    return {name: tensors[full].astype("float32") for name, full in names.items() if name in expected}


def check_vocabulary(vocab_path, weights_path, vocabulary_size):
    """`vocab.txt` must have one line per row of the word embeddings."""
    lines = len(read_vocabulary(vocab_path))
    if lines != vocabulary_size:
        raise ValueError(
            f"{vocab_path} has {lines} lines but tensor 'embeddings.word_embeddings.weight' in {weights_path} "
            f"has {vocabulary_size} rows."
        )


def load_weights(model, weights):
    """Copy Hugging Face tensors (`read_weights`) into a `TransformerEncoder`.

    PyTorch `Linear` weights are `(out, in)`; Keras kernels are `(in, out)`,
    hence the transposes. Query, key and value become the fused `qkv_kernel`
    `(D, 3*D)`, columns `[q | k | v]`, heads contiguous within each.
    """
    model.token_embedding.embeddings.assign(weights["embeddings.word_embeddings.weight"])
    model.position.position_embeddings.assign(weights["embeddings.position_embeddings.weight"])
    model.segment_embedding.embeddings.assign(weights["embeddings.token_type_embeddings.weight"])
    _assign_norm(model.embedding_norm, weights, "embeddings.LayerNorm")
    for i, block in enumerate(model.encoder_blocks):
        prefix = f"encoder.layer.{i}."
        attention = block.self_attention
        qkv = [f"{prefix}attention.self.{name}" for name in ("query", "key", "value")]
        attention.qkv_kernel.assign(np.concatenate([weights[f"{n}.weight"].T for n in qkv], axis=1))  # (D, 3*D)
        attention.qkv_bias.assign(np.concatenate([weights[f"{n}.bias"] for n in qkv]))  # (3*D,)
        attention.output_kernel.assign(weights[f"{prefix}attention.output.dense.weight"].T)  # (D, D)
        attention.output_bias.assign(weights[f"{prefix}attention.output.dense.bias"])
        _assign_norm(block.self_attention_norm, weights, f"{prefix}attention.output.LayerNorm")
        _assign_dense(block.feedforward.intermediate_dense, weights, f"{prefix}intermediate.dense")
        _assign_dense(block.feedforward.output_dense, weights, f"{prefix}output.dense")
        _assign_norm(block.feedforward_norm, weights, f"{prefix}output.LayerNorm")
    if "pooler.dense.weight" in weights:
        _assign_dense(model.pooler, weights, "pooler.dense")


def _assign_dense(layer, weights, name):
    layer.kernel.assign(weights[f"{name}.weight"].T)  # (in, out)
    layer.bias.assign(weights[f"{name}.bias"])


def _assign_norm(layer, weights, name):
    layer.gamma.assign(weights[f"{name}.weight"])
    layer.beta.assign(weights[f"{name}.bias"])


def from_huggingface(path, dtype=None):
    """A `TransformerEncoder` with the weights of a local BERT checkpoint.

    `path` is a directory with `config.json` and `model.safetensors` (and
    optionally `vocab.txt`, whose line count must equal the vocabulary size).
    The pooler is loaded when the checkpoint has one, else it keeps its
    random initialisation.

    Example:
    ```python
    encoder = tfformer.convert.from_huggingface("all-MiniLM-L6-v2/")
    encoder({"token_ids": ids, "segment_ids": np.zeros_like(ids)})["sequence_output"]
    ```
    """
    path = os.fspath(path)
    config = read_config(path)
    weights_path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights_path):
        raise ValueError(f"{weights_path} not found: only safetensors checkpoints are supported.")
    weights = read_weights(weights_path, config)
    vocab_path = os.path.join(path, "vocab.txt")
    if os.path.isfile(vocab_path):
        check_vocabulary(vocab_path, weights_path, config.vocabulary_size)
    model = build_encoder(config, dtype)
    load_weights(model, weights)
    return model
