"""Grouped-query attention (`num_key_value_heads`) against a numpy reference, and its caches."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfformer.generation.plan import DecodePlan
from tfformer.layers import DecoderBlock, EncoderBlock, MultiHeadAttention
from tfformer.layers.layer_utils import split_cache

B, T, S, D, N, H = 2, 5, 7, 16, 4, 4


def _randomize(layer, rng):
    layer.set_weights([rng.normal(size=w.shape).astype("float32") * 0.3 for w in layer.get_weights()])


def _heads(x, heads):
    b, t, _ = x.shape
    return x.reshape(b, t, heads, -1).transpose(0, 2, 1, 3)  # (B, heads, T, H)


def _reference(layer, query, value, causal=False, attention_mask=None):
    """numpy: q of N heads, k and v of K heads, each KV head repeated for its N / K consecutive query heads."""
    n, k_heads = layer.num_heads, layer.num_key_value_heads or layer.num_heads
    qu, ku = n * layer.key_dim, k_heads * layer.key_dim
    if hasattr(layer, "qkv_kernel"):
        w, b = layer.qkv_kernel.numpy(), layer.qkv_bias.numpy()
        q, k, v = (query @ w[:, :qu] + b[:qu], value @ w[:, qu : qu + ku] + b[qu : qu + ku],
                   value @ w[:, qu + ku :] + b[qu + ku :])
    else:
        q = query @ layer.query_kernel.numpy() + layer.query_bias.numpy()
        k = value @ layer.key_kernel.numpy() + layer.key_bias.numpy()
        v = value @ layer.value_kernel.numpy() + layer.value_bias.numpy()
    q, k, v = _heads(q, n), _heads(k, k_heads), _heads(v, k_heads)
    k, v = np.repeat(k, n // k_heads, axis=1), np.repeat(v, n // k_heads, axis=1)  # (B, N, S, H)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(layer.key_dim)  # (B, N, T, S)
    mask = np.ones(scores.shape, bool)
    if causal:
        mask &= np.tril(np.ones(scores.shape[-2:], bool))
    if attention_mask is not None:
        mask &= attention_mask[:, None]
    scores = np.where(mask, scores, -1e9)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    x = (weights @ v).transpose(0, 2, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # (B, T, N*H)
    return x @ layer.output_kernel.numpy() + layer.output_bias.numpy()


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("case", ["self", "self_causal", "cross", "cross_padding", "separate_projections"])
def test_matches_numpy_reference(rng, case, kv_heads):
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = query if case.startswith("self") else rng.normal(size=(B, S, D if case != "separate_projections" else 12))
    value = value.astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=kv_heads)
    layer(query, value)
    _randomize(layer, rng)
    mask = None
    if case == "cross_padding":
        mask = np.repeat((np.arange(S)[None, :] < np.array([[S - 3], [S]]))[:, None, :], T, axis=1)  # (B, T, S)
    causal = case == "self_causal"
    got = layer(query, value, use_causal_mask=causal, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(got), _reference(layer, query, value, causal, mask), rtol=1e-4, atol=1e-4)


def test_projections_and_cache_have_the_key_value_heads(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    memory = rng.normal(size=(B, S, 12)).astype("float32")
    fused = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=2)
    fused(x, x)
    assert tuple(fused.qkv_kernel.shape) == (D, N * H + 2 * 2 * H)
    separate = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=1)
    separate(x, memory)
    assert [tuple(separate.key_kernel.shape), tuple(separate.value_kernel.shape)] == [(12, H), (12, H)]
    assert tuple(fused.compute_cache(x).shape) == (B, 2, 2, T, H)
    _, cache = fused(x[:, :1], x[:, :1], cache=tf.zeros((B, 2, 2, 6, H)), cache_index=0)
    assert tuple(cache.shape) == (B, 2, 2, 6, H)


@pytest.mark.parametrize("kwargs", [
    dict(num_key_value_heads=3), dict(num_key_value_heads=0), dict(num_key_value_heads=8)])
def test_bad_num_key_value_heads(kwargs):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        MultiHeadAttention(num_heads=N, key_dim=H, **kwargs)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        EncoderBlock(num_heads=N, intermediate_dim=8, **kwargs)


@pytest.mark.parametrize("form", ["stacked", "stacked_xla", "split", "split_xla"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cached_decoding_equals_the_full_pass(rng, form, kv_heads):
    """A two-token prefill then one token at a time over a `(B, 2, K, S, H)` cache (or its split pair,
    `(B*K, S, H)` each), with and without XLA's in-place forms: the outputs of the full causal pass."""
    x = rng.normal(size=(B, T, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=kv_heads)
    layer(x, x)
    _randomize(layer, rng)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    np.testing.assert_allclose(full, _reference(layer, x, x, causal=True), rtol=1e-4, atol=1e-4)
    xla = form.endswith("xla")
    plan = DecodePlan(in_place_cache_writes=xla)
    step = tf.function(lambda q, c, i: layer(q, q, use_causal_mask=True, cache=c, cache_index=i, plan=plan),
                       jit_compile=xla)
    cache = tf.zeros((B, 2, kv_heads, T + 2, H))
    cache = split_cache(cache) if form.startswith("split") else cache
    outs = []
    for start, stop in [(0, 2)] + [(t, t + 1) for t in range(2, T)]:
        out, cache = step(x[:, start:stop], cache, tf.constant(start))
        outs.append(out.numpy())
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5)
    halves = cache if form.startswith("split") else split_cache(cache)
    assert [tuple(h.shape) for h in halves] == [(B * kv_heads, T + 2, H)] * 2


@pytest.mark.parametrize("layout", ["rows", "halves"])
def test_decoder_block_step_on_prepared_kernels(rng, layout):
    """A GQA decoder block's one-token step on a plan's prepared kernels (XLA) == its plain step."""
    batch = 1 if layout == "rows" else 2
    block = DecoderBlock(num_heads=N, intermediate_dim=32, num_key_value_heads=2)
    x = rng.normal(size=(batch, 4, D)).astype("float32")
    memory = rng.normal(size=(batch, S, D)).astype("float32")
    block(x, memory)
    _randomize(block, rng)
    cross = block.compute_cross_attention_cache(memory)
    assert tuple(cross.shape) == (batch, 2, 2, S, H)
    cache = tf.zeros((batch, 2, 2, 6, H))

    def step(plan):
        @tf.function(jit_compile=True)
        def fn(x, cache):
            p = plan.prepared(block)
            return block(x, cache=cache, cache_index=tf.constant(3), cross_attention_cache=cross, plan=p)

        return [t.numpy() for t in fn(x[:, 3:4], cache)]

    plain = step(DecodePlan(in_place_cache_writes=True))
    prepared = step(DecodePlan(layout, in_place_cache_writes=True))
    for got, expected in zip(prepared, plain):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_config_and_keras_round_trip(rng, tmp_path):
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=2)
    assert layer.get_config()["num_key_value_heads"] == 2
    assert MultiHeadAttention.from_config(layer.get_config()).num_key_value_heads == 2
    block = EncoderBlock(num_heads=N, intermediate_dim=8, num_key_value_heads=1)
    assert EncoderBlock.from_config(block.get_config()).num_key_value_heads == 1
    inputs = keras.Input((T, D))
    model = keras.Model(inputs, MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=2)(inputs, inputs))
    x = rng.normal(size=(B, T, D)).astype("float32")
    path = str(tmp_path / "gqa.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), atol=1e-6)
    assert loaded.layers[-1].num_key_value_heads == 2
