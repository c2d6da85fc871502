"""`tfformer.export.exact_int8`: float32 weights that are GGUF Q8_0 / Q4_1 blocks stored exactly as integers.

The blocks are random raw GGUF bytes dequantized by `tfformer.convert.gguf` (a line-by-line translation of
llama.cpp's `dequantize_row_*`), so the decompositions are checked against the format itself; the rewritten
decoder file is checked against the float32 file it came from (its logits are checked against Keras in
test_tflite.py / test_smollm2_export.py).
"""

import os

import numpy as np
import pytest

from tfformer import edge, export, models
from tfformer.convert import gguf
from tfformer.export import exact_int8

# A Llama-architecture model (SmolLM2's flags) whose matrices' input sizes are multiples of the 32-weight block.
CONFIG = dict(architecture="causal_lm", vocabulary_size=512, hidden_dim=128, num_heads=4, num_key_value_heads=2,
              intermediate_dim=256, num_encoder_layers=0, num_decoder_layers=2, dropout=0.0, max_sequence_length=32,
              activation="swiglu", norm_first=True, position="rotary", scale_embeddings=False, tie_embeddings=True,
              normalization="rms", use_bias=False, rope_max_wavelength=500.0)
MAX_LENGTH = 24
# Both files compute the same sums in float32, grouped differently (Q4_1's `m` term, the norm scales applied to
# activations instead of folded into filters): differences of float32 rounding, relative to the logits' size.
LOGIT_RTOL = 1e-5
# (block_scales, q4_1_bits) of the rewritten files.
STORAGES = [("float16", 8), ("float16", 4), ("quantization", 8), ("quantization", 4)]


def _q8_0_bytes(rng, rows, columns):
    """Raw Q8_0 blocks of a `(rows, columns)` matrix, as llama.cpp's quantizer writes them: d fp16 > 0, q int8 in
    [-127, 127] with a +-127 in every block."""
    n = rows * columns // 32
    d = rng.uniform(0.002, 0.02, n).astype(np.float16)
    q = rng.integers(-127, 128, (n, 32)).astype(np.int8)
    q[np.arange(n), rng.integers(0, 32, n)] = rng.choice([-127, 127], n)
    blocks = np.empty((n, 34), np.uint8)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    blocks[:, 2:] = q.view(np.uint8)
    return blocks, d, q


def _q4_1_bytes(rng, rows, columns, scale=0.01):
    """Raw Q4_1 blocks: d, m fp16 (m the block minimum, q = 0 and q = 15 in every block, as llama.cpp's quantizer
    gives), nibbles low half first."""
    n = rows * columns // 32
    d = (scale * rng.uniform(0.5, 1.5, n)).astype(np.float16)
    m = (-7.5 * d.astype(np.float32) * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    q = rng.integers(0, 16, (n, 32)).astype(np.uint8)
    where = rng.permutation(32)[:2]
    q[:, where[0]], q[:, where[1]] = 0, 15
    blocks = np.empty((n, 20), np.uint8)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = m.view(np.uint8).reshape(n, 2)
    blocks[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return blocks, d, m, q


def _q4_1_matrix(rng, rows, columns):
    # Weights up to about 0.5: large enough that greedy decoding of the random model does not repeat one token.
    return gguf.dequantize(_q4_1_bytes(rng, rows, columns, scale=0.06)[0], gguf.Q4_1, (rows, columns))


def test_blocks_recover_the_gguf_values_exactly():
    rng = np.random.default_rng(0)
    raw, d, q = _q8_0_bytes(rng, 48, 64)
    values = gguf.dequantize(raw, gguf.Q8_0, (48, 64))
    got_q, got_d = exact_int8.q8_0_blocks(values)
    np.testing.assert_array_equal(got_q, q)
    np.testing.assert_array_equal(got_d, d.astype(np.float32))
    assert exact_int8.q4_1_blocks(values) is None  # 255 levels per block are not 16

    raw, d, m, q = _q4_1_bytes(rng, 48, 64)
    values = gguf.dequantize(raw, gguf.Q4_1, (48, 64))
    got_q, got_d, got_m = exact_int8.q4_1_blocks(values)
    np.testing.assert_array_equal(got_q, q)
    np.testing.assert_array_equal(got_d, d.astype(np.float32))
    np.testing.assert_array_equal(got_m, m.astype(np.float32))
    assert exact_int8.q8_0_blocks(values) is None
    # One float32 ulp off in one weight, or plain float weights: not blocks.
    nudged = values.copy()
    nudged[3, 5] = np.nextafter(nudged[3, 5], np.float32(1))
    assert exact_int8.q4_1_blocks(nudged) is None and exact_int8.q8_0_blocks(nudged) is None
    # Offsets large next to d: `15 d + m` rounds in float32 by several float16 steps of d; a float16 d found
    # among them rebuilds every block bit for bit (there may be several).
    raw, d, m, q = _q4_1_bytes(rng, 16, 64, scale=1e-4)
    raw[:, 2:4] = np.full(len(raw), -100.0, np.float16).view(np.uint8).reshape(-1, 2)
    values = gguf.dequantize(raw, gguf.Q4_1, (16, 64))
    got_q, got_d, got_m = exact_int8.q4_1_blocks(values)
    np.testing.assert_array_equal(got_q, q)
    assert np.all(got_m == -100.0) and np.all(got_d.astype(np.float16) == got_d)
    np.testing.assert_array_equal(got_q * got_d[:, None] + got_m[:, None], values.reshape(-1, 32))
    normal = rng.normal(size=(8, 64)).astype(np.float32)
    assert exact_int8.q4_1_blocks(normal) is None and exact_int8.q8_0_blocks(normal) is None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny LM with a Q8_0 embedding (tied output), Q4_1 matrices and one plain float32 matrix, as a float32
    decoder file and as its requantized forms (int8, and int4 for Q4_1; the per-block scales as float16 tensors,
    and as per-axis quantization parameters)."""
    rng = np.random.default_rng(41)
    config = models.TransformerConfig(**CONFIG)
    lm = models.build_causal_lm(config)
    v, dim = CONFIG["vocabulary_size"], CONFIG["hidden_dim"]
    lm.token_embedding.embeddings.assign(gguf.dequantize(_q8_0_bytes(rng, v, dim)[0], gguf.Q8_0, (v, dim)))
    for block in lm.decoder_blocks:
        for kernel in (block.self_attention.qkv_kernel, block.self_attention.output_kernel,
                       block.feedforward.gate_up_kernel, block.feedforward.down_kernel):
            columns, rows = kernel.shape  # a Keras kernel (in, out) is the GGUF matrix (out, in) transposed
            kernel.assign(_q4_1_matrix(rng, rows, columns).T)
        # The converter folds each RMSNorm scale into the filter after it (`float32(W * g)`: no blocks).
        for norm in (block.self_attention_norm, block.feedforward_norm):
            norm.scale.assign(rng.uniform(0.5, 1.5, dim).astype(np.float32))
    lm.final_norm.scale.assign(rng.uniform(0.5, 1.5, dim).astype(np.float32))
    plain = lm.decoder_blocks[1].feedforward.down_kernel
    plain.assign(rng.normal(0, 0.2, plain.shape).astype(np.float32))
    directory = tmp_path_factory.mktemp("exact_int8")
    f32 = export.tflite_decoder(lm, str(directory / "f32.tflite"), max_length=MAX_LENGTH)
    out = {"f32": f32}
    scales = [np.asarray(w) for w in lm.weights if len(w.shape) == 1]  # the norms' scales
    for storage, bits in STORAGES:
        path = str(directory / f"int{bits}_{storage}.tflite")
        out[storage, bits] = path, exact_int8.requantize_blocks(f32, path, q4_1_bits=bits, input_scales=scales,
                                                                block_scales=storage)
    path = str(directory / "default.tflite")
    out["default"] = path, exact_int8.requantize_blocks(f32, path, input_scales=scales)
    path = str(directory / "no_scales.tflite")
    out["no_scales"] = path, exact_int8.requantize_blocks(f32, path)
    out["option"] = export.tflite_decoder(lm, str(directory / "option.tflite"), max_length=MAX_LENGTH, quantize="gguf")
    out["lm"] = lm
    counts = {"embedding": v * dim, "plain": int(np.prod(plain.shape)),
              "all": sum(int(np.prod(w.shape)) for w in lm.weights if len(w.shape) == 2),
              "plain_values": np.asarray(plain).T}  # the FULLY_CONNECTED filter (out, in)
    return out, counts


def _tensors(path):
    from ai_edge_litert import schema_py_generated as schema

    with open(path, "rb") as handle:
        model = schema.ModelT.InitFromPackedBuf(handle.read(), 0)
    graph = model.subgraphs[0]

    def values(tensor):
        data = model.buffers[tensor.buffer].data
        return None if data is None else np.asarray(data, np.uint8)

    return {(t.name.decode() if isinstance(t.name, bytes) else t.name): (t, values(t)) for t in graph.tensors}, schema


def _weight(tensors, name, kind):
    """The float32 block weights `(N, 32)` stored in a rewritten file for weight `name`: q (INT8, or INT4 two per
    byte, low nibble first) minus its zero point, times its per-block scale (the quantization scale, or a scale of
    1 per tensor and the float16 tensor `(N, 1)` of d), plus Q4_1's float16 minimums."""
    tensor, data = tensors[f"{name}/{kind}"]
    if data.size == np.prod(tensor.shape):
        q = data.view(np.int8).astype(np.float32)
    else:
        nibbles = np.stack([data & 0x0F, data >> 4], axis=1).reshape(-1).astype(np.float32)
        q = np.where(nibbles > 7, nibbles - 16, nibbles)
    q = q.reshape(-1, 32) - np.asarray(tensor.quantization.zeroPoint, np.float32)[:, None]
    weight = q * np.asarray(tensor.quantization.scale, np.float32)[:, None]
    if f"{name}/{kind}_scale" in tensors:
        assert list(tensor.quantization.scale) == [1.0] and len(tensor.quantization.zeroPoint) == 1
        scale, data = tensors[f"{name}/{kind}_scale"]
        assert list(scale.shape) == [q.shape[0], 1]
        weight = weight * data.view(np.float16).astype(np.float32).reshape(-1, 1)
    if kind == "q4_1":
        weight += tensors[f"{name}/q4_1_min"][1].view(np.float16).astype(np.float32).reshape(-1)[:, None]
    return weight


@pytest.mark.parametrize("storage,bits", STORAGES)
def test_rewrite_summary_and_stored_values(files, storage, bits):
    out, counts = files
    path, summary = out[storage, bits]
    f32, _ = _tensors(out["f32"])
    new, schema = _tensors(path)
    size = {name: int(np.prod(f32[name][0].shape)) for name in f32}
    # The embedding table, read by GATHER, and the same table times the final norm's scale, the logits' filter.
    assert [size[name] for name in summary["q8_0"]] == [counts["embedding"]] * 2
    assert sum(size[name] for name in summary["q4_1"]) == counts["all"] - counts["embedding"] - counts["plain"]
    assert len(summary["unscaled"]) == 5  # the logits' filter; q,k,v and gate,up of both layers
    # The plain matrix (the only FULLY_CONNECTED / GATHER float constant that is no blocks) keeps its bytes.
    assert len(summary["kept"]) == 1
    kept = summary["kept"][0][0]
    assert np.array_equal(f32[kept][1].view(np.float32).reshape(f32[kept][0].shape), counts["plain_values"])
    assert new[kept][0].type == schema.TensorType.FLOAT32
    np.testing.assert_array_equal(new[kept][1], f32[kept][1])
    # Each rewritten weight is its integers times their per-block scales (plus Q4_1's minimums), times the input
    # scale put back before it when the converter had folded one in: the float32 file's weight, bit for bit.
    integer = {schema.TensorType.INT8: 8, schema.TensorType.INT4: 4}
    shared = 0
    for kind in ("q8_0", "q4_1"):
        for name in summary[kind]:
            assert new[name][1] is None  # the float32 constant is gone: RESHAPE computes it
            if f"{name}/{kind}" not in new:
                shared += 1  # the logits' filter, the embedding table once it is unscaled: one integer copy
                continue
            assert integer[new[f"{name}/{kind}"][0].type] == (bits if kind == "q4_1" else 8)
            quantization = new[f"{name}/{kind}"][0].quantization
            assert len(quantization.scale) == (1 if storage == "float16" else new[f"{name}/{kind}"][0].shape[0])
            assert (f"{name}/{kind}_scale" in new) == (storage == "float16")
            weight = _weight(new, name, kind)
            if name in summary["unscaled"]:
                scale = new[f"{name}/input_scale"][1].view(np.float32)
                weight = (weight.reshape(f32[name][0].shape) * scale).reshape(-1, 32)
            np.testing.assert_array_equal(weight, f32[name][1].view(np.float32).reshape(-1, 32))
    assert shared == 1
    # Without the norms' scales, the folded filters are left as float32.
    _, alone = out["no_scales"]
    assert len(alone["kept"]) == 1 + 5 and not alone["unscaled"]


def test_default_file_stores_int8_with_float16_block_scales(files):
    out, _ = files
    tensors, schema = _tensors(out["default"][0])
    summary = out["default"][1]
    integers = [tensors[f"{name}/{kind}"][0] for kind in ("q8_0", "q4_1") for name in summary[kind]
                if f"{name}/{kind}" in tensors]
    assert len(integers) == len(summary["q8_0"]) + len(summary["q4_1"]) - 1  # the tied table once
    for tensor in integers:
        assert tensor.type == schema.TensorType.INT8 and list(tensor.quantization.scale) == [1.0]
    assert not any(t.type == schema.TensorType.INT4 for t, _ in tensors.values())
    scales = [tensors[f"{name}/{kind}_scale"][0] for kind in ("q8_0", "q4_1") for name in summary[kind]
              if f"{name}/{kind}_scale" in tensors]
    assert len(scales) == len(integers) and all(t.type == schema.TensorType.FLOAT16 for t in scales)


def test_rewritten_files_are_smaller_by_the_integer_bytes(files):
    out, counts = files
    f32_bytes = os.path.getsize(out["f32"])
    # The float32 file holds the table twice: for GATHER, and times the final norm's scale for the logits.
    rewritten = counts["all"] - counts["plain"] + counts["embedding"]
    q4_1 = counts["all"] - counts["plain"] - counts["embedding"]
    # Per weight: int8 q, a float32 scale and an int64 zero point per 32, Q4_1's float16 minimum per 32; the
    # embedding table once.
    per_weight = {("quantization", 8): counts["embedding"] * (1 + 12 / 32) + q4_1 * (1 + 12 / 32 + 2 / 32),
                  ("quantization", 4): counts["embedding"] * (1 + 12 / 32) + q4_1 * (0.5 + 12 / 32 + 2 / 32)}
    # With the scales as float16 tensors: a float16 d per 32 instead.
    per_weight["float16", 8] = counts["embedding"] * (1 + 2 / 32) + q4_1 * (1 + 2 / 32 + 2 / 32)
    per_weight["float16", 4] = counts["embedding"] * (1 + 2 / 32) + q4_1 * (0.5 + 2 / 32 + 2 / 32)
    assert os.path.getsize(out["default"][0]) == os.path.getsize(out["float16", 8][0])
    for storage, bits in STORAGES:
        summary = out[storage, bits][1]
        size = summary["bytes"]
        # The input scales put back: one float32 vector per unscaled filter.
        stored = per_weight[storage, bits] + 4 * CONFIG["hidden_dim"] * len(summary["unscaled"])
        overhead = (4 * rewritten - stored) - (f32_bytes - size)
        print(f"\n{storage}, q4_1_bits={bits}: {size} bytes, float32 {f32_bytes} bytes, "
              f"ratio {size / f32_bytes:.3f}, graph overhead {overhead} bytes")
        # The new ops and tensors (named after the weight) cost about a kilobyte per rewritten weight; the float32
        # buffers' alignment padding, a few bytes each, goes with them. Float16 scales add three tensors (the
        # integers as float32, the scales, the scales as float32) and a MUL per weight.
        rewritten_weights = len(summary["q8_0"]) + len(summary["q4_1"])
        extra = 1024 * rewritten_weights if storage == "float16" else 0
        assert -16 * 16 <= overhead <= 2048 * rewritten_weights + extra


@pytest.mark.parametrize("storage,bits", STORAGES)
def test_rewritten_logits_and_greedy_ids_equal_the_float32_files(files, storage, bits):
    out, _ = files
    f32 = edge.Generator(out["f32"])
    exact = edge.Generator(out[storage, bits][0])
    steps = [f.interpreter.get_signature_runner("decode_step") for f in (f32, exact)]
    caches = [{name: np.zeros(detail["shape"], np.float32) for name, detail in step.get_input_details().items()
               if name.startswith("cache_")} for step in steps]  # each (K, S, H), fed and taken back every step
    worst = 0.0
    for index, token in enumerate([5, 300, 17, 511, 0, 42]):
        logits = []
        for i, step in enumerate(steps):
            result = step(token_ids=np.array([[token]], np.int32), index=np.array(index, np.int32), **caches[i])
            logits.append(result["logits"])
            caches[i] = {name: result[name] for name in caches[i]}
        scale = float(np.abs(logits[0]).max())
        assert scale > 1.0  # not a degenerate model
        worst = max(worst, float(np.abs(logits[0] - logits[1]).max()) / scale)
    print(f"\n{storage}, q4_1_bits={bits}: max |logit difference| / max |logit| {worst:.2e}")
    assert worst <= LOGIT_RTOL
    for prompt in ([1, 2, 3], [400, 7], [9]):
        want = f32.generate(prompt, max_new_tokens=16, end_ids=())
        assert len(set(want)) > 2  # the greedy path is not one repeated token
        assert exact.generate(prompt, max_new_tokens=16, end_ids=()) == want


def test_bad_arguments_name_the_argument(tmp_path, files):
    out, _ = files
    with pytest.raises(ValueError, match=r"`q4_1_bits` must be 4 or 8\. Received: q4_1_bits=5"):
        exact_int8.requantize_blocks(out["f32"], str(tmp_path / "x.tflite"), q4_1_bits=5)
    with pytest.raises(ValueError, match=r"`block_scales` must be 'float16' or 'quantization'\. Received: "
                                         r"block_scales='float32'"):
        exact_int8.requantize_blocks(out["f32"], str(tmp_path / "x.tflite"), block_scales="float32")
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="`tflite_path` is not a TFLite flatbuffer"):
        exact_int8.requantize_blocks(str(bad), str(tmp_path / "x.tflite"))


def test_the_gguf_option_of_tflite_decoder_writes_the_default_rewrite(files):
    """`tflite_decoder(..., quantize="gguf")` is the float32 file rewritten with the model's norm scales: the
    same bytes as `requantize_blocks` with its defaults."""
    out, _ = files
    with open(out["option"], "rb") as a, open(out["default"][0], "rb") as b:
        assert a.read() == b.read()


def _logits(path, ids):
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=path).get_signature_runner("predict_ids")
    return runner(token_ids=ids)["logits"]  # (1, T, V)


def test_the_gguf_option_of_tflite_and_the_cli(tmp_path, files, monkeypatch, capsys):
    """`export.tflite(..., quantize="gguf")` (the whole-sequence logits file) stores the blocks as int8 and gives the
    float32 file's logits to float rounding; `tfformer export --format tflite --quantize gguf` writes it and the
    gguf decoder file (the bytes of `tflite_decoder(..., quantize="gguf")`). A model without block weights is
    refused by name."""
    from tfformer import cli

    out, _ = files
    lm = out["lm"]
    ids = np.array([[5, 300, 17, 511, 0, 42, 9, 1]], np.int32)
    f32 = export.tflite(lm, str(tmp_path / "f32.tflite"), sequence_length=8, batch_size=1)
    monkeypatch.setattr(models, "from_preset", lambda name: lm)
    assert cli.main(["export", "tiny", "--format", "tflite", "--out", str(tmp_path / "cli"), "--quantize", "gguf",
                     "--sequence-length", "8", "--batch-size", "1", "--max-length", str(MAX_LENGTH)]) == 0
    assert "decoder.tflite" in capsys.readouterr().out
    exact = str(tmp_path / "cli" / "model.tflite")
    assert os.path.getsize(exact) < 0.5 * os.path.getsize(f32)  # int8 blocks, not float32
    want, got = _logits(f32, ids), _logits(exact, ids)
    scale = float(np.abs(want).max())
    assert scale > 1.0
    assert float(np.abs(got - want).max()) / scale <= LOGIT_RTOL
    with open(tmp_path / "cli" / "decoder.tflite", "rb") as a, open(out["option"], "rb") as b:
        assert a.read() == b.read()
    plain = models.build_causal_lm(models.TransformerConfig(**CONFIG))  # random weights: no blocks
    with pytest.raises(ValueError, match="quantize='gguf' found no Q8_0 / Q4_1 block weights"):
        export.tflite(plain, str(tmp_path / "plain.tflite"), quantize="gguf", sequence_length=8, batch_size=1)
    with pytest.raises(ValueError, match=r"`quantize` must be one of .*Received: quantize='int4'"):
        export.tflite(plain, str(tmp_path / "plain.tflite"), quantize="int4")
