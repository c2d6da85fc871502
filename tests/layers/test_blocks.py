import numpy as np
import pytest

from tests.harness import check_layer
from tfformer.layers import DecoderBlock, EncoderBlock

B, T, S, D = 2, 6, 5, 8


def _layer_norm(x, gamma, beta, eps):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_residual_structure_matches_numpy(rng, norm_first):
    x = rng.normal(size=(B, T, D)).astype("float32")
    block = EncoderBlock(num_heads=2, intermediate_dim=16, norm_first=norm_first)
    out = np.asarray(block(x))
    ln = lambda layer, h: _layer_norm(h, layer.gamma.numpy(), layer.beta.numpy(), layer.epsilon)  # noqa: E731
    attn = lambda h: np.asarray(block.self_attention(h, h))  # noqa: E731
    ffn = lambda h: np.asarray(block.feedforward(h))  # noqa: E731
    if norm_first:
        h = x + attn(ln(block.self_attention_norm, x))
        expected = h + ffn(ln(block.feedforward_norm, h))
    else:
        h = ln(block.self_attention_norm, x + attn(x))
        expected = ln(block.feedforward_norm, h + ffn(h))
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_encoder_ignores_padded_content(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    pad = np.array([[1, 1, 1, 1, 0, 0], [1] * T], bool)
    block = EncoderBlock(num_heads=2, intermediate_dim=16)
    base = np.asarray(block(x, padding_mask=pad))
    changed = x.copy()
    changed[0, 4:] = rng.normal(size=(2, D)) * 100
    out = np.asarray(block(changed, padding_mask=pad))
    np.testing.assert_allclose(out[pad], base[pad], atol=1e-5)


def test_decoder_no_future_leakage(rng):
    x = rng.normal(size=(1, T, D)).astype("float32")
    memory = rng.normal(size=(1, S, D)).astype("float32")
    block = DecoderBlock(num_heads=2, intermediate_dim=16)
    base = np.asarray(block(x, memory))
    for t in range(T - 1):
        changed = x.copy()
        changed[:, t + 1 :] = rng.normal(size=changed[:, t + 1 :].shape)
        np.testing.assert_allclose(np.asarray(block(changed, memory))[:, : t + 1], base[:, : t + 1], atol=1e-5)


def test_decoder_ignores_padded_encoder_positions(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    memory = rng.normal(size=(B, S, D)).astype("float32")
    enc_pad = np.array([[1, 1, 1, 0, 0], [1] * S], bool)
    block = DecoderBlock(num_heads=2, intermediate_dim=16)
    base = np.asarray(block(x, memory, encoder_padding_mask=enc_pad))
    changed = memory.copy()
    changed[0, 3:] = 50.0
    np.testing.assert_allclose(np.asarray(block(x, changed, encoder_padding_mask=enc_pad)), base, atol=1e-5)


@pytest.mark.parametrize("cross", [True, False])
def test_decoder_cache_equals_full(rng, cross):
    x = rng.normal(size=(B, T, D)).astype("float32")
    memory = rng.normal(size=(B, S, D)).astype("float32")
    block = DecoderBlock(num_heads=2, intermediate_dim=16, norm_first=True, cross_attention=cross)
    memory_arg = memory if cross else None
    full = np.asarray(block(x, memory_arg))
    cache = np.zeros((B, 2, 2, T + 2, D // 2), "float32")
    cross_cache = block.compute_cross_attention_cache(memory) if cross else None
    steps = []
    for t in range(T):
        out, cache = block(x[:, t : t + 1], cache=cache, cache_index=t, cross_attention_cache=cross_cache)
        steps.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)


def test_decoder_return_structure(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    memory = rng.normal(size=(B, S, D)).astype("float32")
    block = DecoderBlock(num_heads=2, intermediate_dim=16)
    out, scores = block(x, memory, return_attention_scores=True)
    assert out.shape == (B, T, D) and scores.shape == (B, 2, T, S)
    with pytest.raises(ValueError, match="encoder_outputs"):
        block(x)


def test_harnesses(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    memory = rng.normal(size=(B, S, D)).astype("float32")
    check_layer(EncoderBlock, dict(num_heads=2, intermediate_dim=16, dropout=0.1, activation="gelu"),
                {"inputs": x}, expected_output_shape=(B, T, D))
    check_layer(DecoderBlock, dict(num_heads=2, intermediate_dim=16, dropout=0.1, norm_first=True),
                {"inputs": x, "encoder_outputs": memory}, expected_output_shape=(B, T, D))
    check_layer(DecoderBlock, dict(num_heads=2, intermediate_dim=16, cross_attention=False),
                {"inputs": x}, expected_output_shape=(B, T, D))


def test_hidden_dim_not_divisible_by_heads(rng):
    with pytest.raises(ValueError, match="hidden_dim.*num_heads"):
        EncoderBlock(num_heads=3, intermediate_dim=16)(rng.normal(size=(1, 2, 8)).astype("float32"))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("kind", ["encoder", "cross", "causal gated rms grouped"])
def test_symbolic_output_is_what_tracing_call_gives(kind, policy):
    """The blocks state their output spec (a functional model is built without tracing `call`): the shape and
    dtype Keras' traced spec gives, with masks, scores and caches; every weight is made by the symbolic call."""
    import keras

    block = {"encoder": lambda: EncoderBlock(num_heads=2, intermediate_dim=16, dtype=policy),
             "cross": lambda: DecoderBlock(num_heads=2, intermediate_dim=16, dtype=policy),
             "causal gated rms grouped": lambda: DecoderBlock(
                 num_heads=4, intermediate_dim=16, num_key_value_heads=2, cross_attention=False, use_bias=False,
                 activation="swiglu", normalization="rms", rope_max_wavelength=10000, dtype=policy)}[kind]
    x = keras.KerasTensor((None, T, D), dtype=keras.mixed_precision.DTypePolicy(policy).compute_dtype)
    memory = keras.KerasTensor((None, S, D), dtype=x.dtype)
    padding = keras.KerasTensor((None, T), dtype="bool")
    calls = [dict(), dict(padding_mask=padding), dict(return_attention_scores=True)]
    if kind == "cross":
        calls = [dict(c, encoder_outputs=memory) for c in calls]
    if kind != "encoder":
        head_dim = D // (4 if "grouped" in kind else 2)
        cache = keras.KerasTensor((None, 2, 2, T, head_dim), dtype=x.dtype)  # (B, 2, K, T, H)
        calls.append(dict(calls[0], cache=cache, cache_index=0))
    layer = block()
    layer.build(x.shape, memory.shape) if kind == "cross" else layer.build(x.shape)
    for kwargs in calls:
        ours = layer.compute_output_spec(x, **kwargs)
        traced = keras.layers.Layer.compute_output_spec(layer, x, **kwargs)
        assert keras.tree.map_structure(lambda t: (t.shape, t.dtype), ours) == keras.tree.map_structure(
            lambda t: (t.shape, t.dtype), traced), kwargs
    layer = block()
    layer(x, **calls[0])  # symbolic: builds, no `call`
    count = len(layer.weights)
    inputs = {"encoder_outputs": np.zeros((1, S, D), "float32")} if kind == "cross" else {}
    layer(np.zeros((1, T, D), "float32"), **inputs)
    assert len(layer.weights) == count > 0
