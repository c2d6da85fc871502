import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tests.harness import check_layer, count_ops, matmuls_fed_by
from tfformer.layers import MultiHeadAttention

B, T, S, D, N, H = 2, 5, 7, 16, 4, 4


def _np_softmax(x, mask):
    x = np.where(mask, x, -1e9)
    e = np.exp(x - x.max(-1, keepdims=True))
    return np.where(mask, e / e.sum(-1, keepdims=True), 0.0)


def _copy_from_keras(ours, ref):
    """Our fused [q|k|v] kernel from keras' per-projection (D, N, H) kernels."""
    q, k, v, o = ref._query_dense, ref._key_dense, ref._value_dense, ref._output_dense
    flat = lambda w: w.numpy().reshape(w.shape[0], -1) if len(w.shape) == 3 else w.numpy().reshape(-1)  # noqa: E731
    ours.qkv_kernel.assign(np.concatenate([flat(q.kernel), flat(k.kernel), flat(v.kernel)], axis=1))
    ours.qkv_bias.assign(np.concatenate([flat(q.bias), flat(k.bias), flat(v.bias)]))
    ours.output_kernel.assign(o.kernel.numpy().reshape(-1, o.kernel.shape[-1]))
    ours.output_bias.assign(o.bias.numpy())


def _pair(rng, query, value, num_heads=N, key_dim=H, value_dim=None):
    """Our layer and keras' with the same random weights, both built on `query`, `value`."""
    ref = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim)
    ref(query, value)
    ref.set_weights([rng.normal(size=w.shape).astype("float32") * 0.3 for w in ref.get_weights()])
    ours = MultiHeadAttention(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim)
    ours(query, value)
    _copy_from_keras(ours, ref)
    return ours, ref


@pytest.mark.parametrize("case", [
    "self", "self_causal", "self_padding", "cross", "cross_padding", "self_causal_padding"])
def test_matches_keras_multi_head_attention(rng, case):
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = query if case.startswith("self") else rng.normal(size=(B, S, D)).astype("float32")
    ours, ref = _pair(rng, query, value)
    kwargs = {}
    if "padding" in case:
        lengths = np.array([value.shape[1] - 2, value.shape[1]])
        keep = np.arange(value.shape[1])[None, :] < lengths[:, None]  # (B, S)
        kwargs["attention_mask"] = np.repeat(keep[:, None, :], T, axis=1)  # (B, T, S)
    if "causal" in case:
        kwargs["use_causal_mask"] = True
    ours_out, ours_w = ours(query, value, return_attention_scores=True, **kwargs)
    ref_out, ref_w = ref(query, value, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(ours_out, ref_out, atol=1e-5)
    np.testing.assert_allclose(ours_w, ref_w, atol=1e-5)


def test_implicit_keras_masks_match_keras(rng):
    ids = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5]])
    emb = keras.layers.Embedding(10, D, mask_zero=True)
    ours, ref = _pair(rng, emb(ids), emb(ids))
    # keras' layer clears the masks of its inputs, so each call gets fresh embeddings.
    x = emb(ids)
    out = ours(x, x)
    x = emb(ids)
    expected = ref(x, x)
    real = ids != 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(expected)[real], atol=1e-5)
    # Output carries the query mask, as keras' layer does.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out._keras_mask), real)


@pytest.mark.parametrize("score", ["scaled_dot", "dot", "general", "additive"])
def test_matches_numpy_reference(rng, score):
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = rng.normal(size=(B, S, D)).astype("float32")
    mask = rng.random((B, T, S)) > 0.3
    mask[0, 0] = False  # a fully masked row
    layer = MultiHeadAttention(num_heads=N, key_dim=H, score=score)
    out, weights = layer(query, value, attention_mask=mask, return_attention_scores=True)

    W = layer.qkv_kernel.numpy()
    bias = layer.qkv_bias.numpy()
    heads = lambda x: x.reshape(x.shape[0], x.shape[1], N, H).transpose(0, 2, 1, 3)  # noqa: E731  (B, N, L, H)
    q = heads(query @ W[:, : N * H] + bias[: N * H])
    k = heads(value @ W[:, N * H : 2 * N * H] + bias[N * H : 2 * N * H])
    v = heads(value @ W[:, 2 * N * H :] + bias[2 * N * H :])
    if score == "scaled_dot":
        logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)
    elif score == "dot":
        logits = q @ k.transpose(0, 1, 3, 2)
    elif score == "general":
        logits = np.einsum("bnth,nhg,bnsg->bnts", q, layer.general_kernel.numpy(), k)
    else:
        w = layer.additive_vector.numpy()[:, 0, :]  # (N, H)
        logits = np.einsum("bntsh,nh->bnts", np.tanh(q[:, :, :, None, :] + k[:, :, None, :, :]), w)
    expected_w = _np_softmax(logits, mask[:, None])
    ctx = (expected_w @ v).transpose(0, 2, 1, 3).reshape(B, T, N * H)
    expected = ctx @ layer.output_kernel.numpy() + layer.output_bias.numpy()
    np.testing.assert_allclose(weights, expected_w, atol=1e-5)
    np.testing.assert_allclose(out, expected, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(weights)[0, :, 0], 0.0)


def test_restricted_window_attention(rng):
    x = rng.normal(size=(1, 9, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, window=2)
    _, w = layer(x, x, return_attention_scores=True)
    i, j = np.meshgrid(np.arange(9), np.arange(9), indexing="ij")
    w = np.asarray(w)
    assert np.all(w[..., np.abs(i - j) > 2] == 0)
    assert np.all(w[..., np.abs(i - j) <= 2] > 0)


def test_causal_no_future_leakage(rng):
    x = rng.normal(size=(1, 8, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H)
    base = np.asarray(layer(x, x, use_causal_mask=True))
    for t in range(7):
        changed = x.copy()
        changed[:, t + 1 :] = rng.normal(size=changed[:, t + 1 :].shape)
        out = np.asarray(layer(changed, changed, use_causal_mask=True))
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)
        assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :])


def test_incremental_decoding_with_cache_equals_full(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    max_len = T + 3  # a cache longer than the sequence: unfilled slots must be ignored
    cache = np.zeros((B, 2, N, max_len, H), "float32")
    steps = []
    # A two-token prefill, then one token at a time.
    out, cache = layer(x[:, :2], x[:, :2], use_causal_mask=True, cache=cache, cache_index=0)
    steps.append(np.asarray(out))
    for t in range(2, T):
        out, cache = layer(x[:, t : t + 1], x[:, t : t + 1], use_causal_mask=True, cache=cache, cache_index=t)
        steps.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_read_only_cache_equals_cross_attention(rng):
    query = rng.normal(size=(B, T, D)).astype("float32")
    memory = rng.normal(size=(B, S, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H)
    expected = layer(query, memory)
    out, _ = layer(query, memory, cache=layer.compute_cache(memory))
    np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_fully_masked_rows_are_finite(rng, policy):
    x = rng.normal(size=(B, T, D)).astype("float32") * 10
    layer = MultiHeadAttention(num_heads=N, key_dim=H, dtype=policy)
    mask = np.zeros((B, T, T), bool)
    mask[1, 2:] = True
    out, w = layer(x, x, attention_mask=mask, return_attention_scores=True)
    out = ops.convert_to_numpy(ops.cast(out, "float32"))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(np.asarray(w)))
    assert keras.backend.standardize_dtype(w.dtype) == "float32"  # softmax ran in float32
    np.testing.assert_array_equal(np.asarray(w)[0], 0.0)
    # A query with no visible key outputs exactly the output bias.
    bias = ops.convert_to_numpy(ops.cast(layer.output_bias, "float32"))
    np.testing.assert_allclose(out[0], np.broadcast_to(bias, out[0].shape), atol=1e-6)


def test_unequal_widths_use_separate_projections(rng):
    query = rng.normal(size=(B, T, 6)).astype("float32")
    value = rng.normal(size=(B, S, 10)).astype("float32")
    layer = MultiHeadAttention(num_heads=2, key_dim=3, value_dim=5, output_dim=7)
    assert layer(query, value).shape == (B, T, 7)
    assert not layer._fused and layer.key_kernel.shape == (10, 6) and layer.value_kernel.shape == (10, 10)


def test_layer_harness(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    check_layer(
        MultiHeadAttention,
        dict(num_heads=N, key_dim=H, dropout=0.1, score="general", window=3),
        {"query": x, "value": x},
        {"use_causal_mask": True},
        expected_output_shape=(B, T, D),
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=0, key_dim=4), "num_heads"),
        (dict(num_heads=2, key_dim=-1), "key_dim"),
        (dict(num_heads=2, key_dim=4, score="cosine"), "score.*scaled_dot"),
        (dict(num_heads=2, key_dim=4, dropout=1.5), "dropout"),
        (dict(num_heads=2, key_dim=4, window=-2), "window"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)


def test_in_place_cache_write_under_xla_equals_select_write(rng):
    import tensorflow as tf

    from tfformer.layers.layer_utils import write_cache

    cache = tf.constant(rng.normal(size=(2, 2, 3, 9, 4)).astype("float32"))
    new = tf.constant(rng.normal(size=(2, 2, 3, 2, 4)).astype("float32"))
    expected = cache.numpy().copy()
    expected[:, :, :, 5:7] = new.numpy()
    fn = tf.function(lambda c, n, i: write_cache(c, n, i, in_place=True), jit_compile=True)
    in_place = fn(cache, new, tf.constant(5))
    graph = fn.get_concrete_function(cache, new, tf.constant(5)).graph.as_graph_def()
    assert any(node.op == "XlaDynamicUpdateSlice" for node in graph.node)
    np.testing.assert_array_equal(in_place.numpy(), expected)
    np.testing.assert_array_equal(write_cache(cache, new, 5).numpy(), expected)  # default: select form


@pytest.mark.parametrize("shapes", [((2, 2, 3, 9, 4), (2, 2, 3, 4, 4)), ((6, 9, 4), (6, 9, 4))])
def test_cache_write_at_a_python_zero_equals_the_select_form(rng, shapes):
    """A prompt pass writes at a Python 0 as a concat of the new slots and the cache's own past them: the select
    form's result at a tensor 0, the old slots kept (here not zeros), on stacked and split halves."""
    import tensorflow as tf

    from tfformer.layers.layer_utils import write_cache

    cache = tf.constant(rng.normal(size=shapes[0]).astype("float32"))
    new = tf.constant(rng.normal(size=shapes[1]).astype("float32"))
    expected = write_cache(cache, new, tf.constant(0)).numpy()
    np.testing.assert_array_equal(expected[..., : new.shape[-2], :], new.numpy())
    np.testing.assert_array_equal(expected[..., new.shape[-2]:, :], cache.numpy()[..., new.shape[-2]:, :])
    graph = tf.function(lambda c, n: write_cache(c, n, 0)).get_concrete_function(cache, new).graph.as_graph_def()
    assert not any(node.op == "SelectV2" for node in graph.node)  # the concat form, not the select
    np.testing.assert_array_equal(write_cache(cache, new, 0).numpy(), expected)


@pytest.mark.parametrize("key_dim", [H, 16])  # one-query dot-product scores: a dot (H=4), a split multiply + sum (16)
@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("score", ["scaled_dot", "general", "dot", "additive"])
def test_xla_decoding_with_in_place_cache_equals_full(rng, score, batch, key_dim):
    """The XLA path (in-place cache writes, attention over the stacked cache) == the full causal pass."""
    import tensorflow as tf

    from tfformer.generation.plan import DecodePlan

    plan = DecodePlan(in_place_cache_writes=True)
    x = rng.normal(size=(batch, T, D)).astype("float32")
    memory = rng.normal(size=(batch, S, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=key_dim, score=score)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    cross = np.asarray(layer(x, memory))
    step = tf.function(lambda q, c, i: layer(q, q, use_causal_mask=True, cache=c, cache_index=i, plan=plan),
                       jit_compile=True)
    read = tf.function(lambda q, c: layer(q, q, cache=c, plan=plan)[0], jit_compile=True)
    cache = tf.zeros((batch, 2, N, T + 2, key_dim))
    out, cache = step(x[:, :2], cache, tf.constant(0))
    outs = [out.numpy()]
    for t in range(2, T):
        out, cache = step(x[:, t : t + 1], cache, tf.constant(t))
        outs.append(out.numpy())
    got_cross = read(x, layer.compute_cache(memory)).numpy()
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5)
    np.testing.assert_allclose(got_cross, cross, atol=1e-5)


@pytest.mark.parametrize("xla", [False, True])
@pytest.mark.parametrize("score", ["scaled_dot", "general", "additive"])
def test_split_cache_decoding_equals_full_and_the_stacked_cache(rng, score, xla):
    """A split cache `(keys, values)` `(B*N, S, H)`: outputs == the full causal pass, and after every step its
    contents == the stacked cache's (written the same way), with and without XLA's in-place writes."""
    import tensorflow as tf

    from tfformer.generation.plan import DecodePlan
    from tfformer.layers.layer_utils import split_cache

    plan = DecodePlan(in_place_cache_writes=xla)
    x = rng.normal(size=(B, T, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, score=score)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    step = tf.function(lambda q, c, i: layer(q, q, use_causal_mask=True, cache=c, cache_index=i, plan=plan),
                       jit_compile=xla)
    stacked = tf.zeros((B, 2, N, T + 2, H))  # two unfilled slots at the end
    split = split_cache(stacked)
    outs = []
    for start, stop in [(0, 2)] + [(t, t + 1) for t in range(2, T)]:  # a two-token prefill, then one at a time
        out, split = step(x[:, start:stop], split, tf.constant(start))
        _, stacked = step(x[:, start:stop], stacked, tf.constant(start))
        outs.append(out.numpy())
        assert isinstance(split, tuple) and len(split) == 2
        for half, expected in zip(split, split_cache(stacked)):
            assert tuple(half.shape) == (B * N, T + 2, H)
            np.testing.assert_allclose(half.numpy(), expected.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5)
    np.testing.assert_array_equal(split[0].numpy()[:, T:], 0)  # the unfilled slots stay empty


@pytest.mark.parametrize("xla", [False, True])
def test_split_cache_object_keeps_its_float32_buffers_under_mixed_bfloat16(rng, xla):
    """Keras casts a pair of float32 tensors passed to a mixed_bfloat16 layer to bfloat16; a `SplitCache` of the
    same tensors reaches `call` as it is and comes back as a float32 pair with the same contents (the keys and
    values are bfloat16 numbers either way) and the same outputs."""
    import tensorflow as tf

    from tfformer.generation.plan import DecodePlan
    from tfformer.layers.layer_utils import SplitCache, split_cache

    plan = DecodePlan(in_place_cache_writes=xla)
    x = rng.normal(size=(B, 3, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, dtype="mixed_bfloat16")
    step = tf.function(lambda q, c, i: layer(q, q, use_causal_mask=True, cache=c, cache_index=i, plan=plan),
                       jit_compile=xla)
    pair = split_cache(tf.zeros((B, 2, N, 4, H)))
    out_pair, pair = step(x, pair, tf.constant(0))
    wrapped = split_cache(tf.zeros((B, 2, N, 4, H)))
    out_wrapped, wrapped = step(x, SplitCache(*wrapped), tf.constant(0))
    assert [h.dtype for h in pair] == [tf.bfloat16] * 2  # Keras' autocast: the reason for SplitCache
    assert isinstance(wrapped, tuple) and [h.dtype for h in wrapped] == [tf.float32] * 2
    for got, expected in zip(wrapped, pair):
        np.testing.assert_array_equal(got.numpy(), tf.cast(expected, tf.float32).numpy())
    assert np.abs(wrapped[0].numpy()[:, :3]).max() > 0.1  # the three written slots hold keys, not zeros
    np.testing.assert_allclose(np.asarray(out_wrapped, "float32"), np.asarray(out_pair, "float32"),
                               rtol=2e-2, atol=2e-2)


def test_split_cache_needs_a_pair_cache_index_and_a_plan(rng):
    """A split cache is a decode plan's form (`DecodeForms`): a pair, with `cache_index`; without a plan (the plain
    forms) it is an error too, not a silent misread."""
    from tfformer.layers.decode_forms import DecodeForms
    from tfformer.layers.layer_utils import SplitCache, split_cache

    x = rng.normal(size=(B, 1, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H)
    keys, values = split_cache(np.zeros((B, 2, N, 4, H), "float32"))
    for plan in (DecodeForms(), None):
        with pytest.raises(ValueError, match="needs `cache_index`"):
            layer(x, x, cache=(keys, values), plan=plan)
        with pytest.raises(ValueError, match="needs `cache_index`"):
            layer(x, x, cache=SplitCache(keys, values), plan=plan)
        with pytest.raises(ValueError, match="pair"):
            layer(x, x, cache=(keys, values, values), cache_index=0, plan=plan)
    with pytest.raises(ValueError, match="decode plan"):
        layer(x, x, cache=(keys, values), cache_index=0)
    out, cache = layer(x, x, cache=(keys, values), cache_index=0, plan=DecodeForms())
    assert isinstance(cache, tuple) and tuple(out.shape) == (B, 1, D)


@pytest.mark.parametrize("layout", ["rows", "halves"])
@pytest.mark.parametrize("use_bias, start, stop", [(True, 0, 10), (True, 3, 7), (False, 0, 10), (False, 2, 9)])
def test_dense_on_prepared_kernels_equals_the_matmul(rng, use_bias, start, stop, layout):
    """`dense` with a plan of prepared kernels (XLA) == x @ W[:, start:stop] + b[start:stop]; column slices stay
    plain in the "halves" layout."""
    import tensorflow as tf

    from tfformer.generation.plan import DecodePlan

    layer = keras.layers.Dense(10, use_bias=use_bias)
    layer.build((None, 6))
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])
    x = rng.normal(size=(1 if layout == "rows" else 3, 1, 6)).astype("float32")
    bias = layer.bias if use_bias else None

    @tf.function(jit_compile=True)
    def fn(x):
        return DecodePlan(layout).prepared(layer).dense(x, layer.kernel, bias, start, stop)

    expected = x @ layer.kernel.numpy()[:, start:stop] + (layer.bias.numpy()[start:stop] if use_bias else 0)
    np.testing.assert_allclose(fn(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    if layout == "rows":
        assert matmuls_fed_by("Transpose", fn, x) == 1  # the one-row form ran
    else:
        assert matmuls_fed_by("Identity", fn, x) == (2 if (start, stop) == (0, 10) else 0)


@pytest.mark.parametrize("layout", ["rows", "halves"])
def test_dense_with_another_bias_keeps_the_plain_form(rng, layout):
    """Prepared kernels belong with their own bias: `dense` with a different bias takes the plain matmul."""
    import tensorflow as tf

    from tfformer.generation.plan import DecodePlan

    layer = keras.layers.Dense(4)
    layer.build((None, 3))
    other = keras.Variable(np.arange(4, dtype="float32"), name="bias")
    x = rng.normal(size=(1, 1, 3)).astype("float32")

    @tf.function(jit_compile=True)
    def fn(x):
        return DecodePlan(layout).prepared(layer).dense(x, layer.kernel, other)

    np.testing.assert_allclose(fn(x).numpy(), x @ layer.kernel.numpy() + np.arange(4), rtol=1e-5, atol=1e-5)
    assert matmuls_fed_by("Transpose", fn, x) == matmuls_fed_by("Identity", fn, x) == 0


def test_prepared_kernels_rejects_an_unknown_layout():
    from tfformer.generation.plan import prepared_kernels

    with pytest.raises(ValueError, match="layout"):
        prepared_kernels(keras.layers.Dense(2), "columns")


@pytest.mark.parametrize("shape", [(6,), (2, 6), (2, 3, 6), (2, 3, 1, 6)])
@pytest.mark.parametrize("use_bias, start, stop", [(True, 0, 10), (True, 3, 7), (False, 2, 9)])
def test_dense_is_a_2d_matmul_and_a_bias_add(rng, shape, use_bias, start, stop):
    """Outside decode loops `dense` is x @ W[:, start:stop] + b[start:stop] as one rank-2 MatMul and one BiasAdd
    (the pair grappler fuses into one oneDNN kernel), for inputs of any rank; the static shape is kept."""
    import tensorflow as tf

    from tfformer.layers.layer_utils import dense

    kernel = keras.Variable(rng.normal(size=(6, 10)).astype("float32"))
    bias = keras.Variable(rng.normal(size=(10,)).astype("float32")) if use_bias else None
    x = rng.normal(size=shape).astype("float32")
    fn = tf.function(lambda x: dense(x, kernel, bias, start, stop))
    expected = x @ kernel.numpy()[:, start:stop] + (bias.numpy()[start:stop] if use_bias else 0)
    np.testing.assert_allclose(fn(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    graph = fn.get_concrete_function(tf.TensorSpec((None,) * (len(shape) - 1) + (6,), tf.float32)).graph
    kinds = [n.op for n in graph.as_graph_def().node]
    assert kinds.count("MatMul") == 1 and "BatchMatMulV2" not in kinds
    assert kinds.count("BiasAdd") == int(use_bias) and "AddV2" not in kinds
    assert graph.outputs[0].shape.as_list() == [None] * (len(shape) - 1) + [stop - start]
    # One unknown leading dimension (a decode step's batch): the shapes are constants, no shape arithmetic.
    if len(shape) == 3:
        step_fn = tf.function(lambda x: dense(x, kernel, bias, start, stop))  # a fresh trace, not the general one
        step = step_fn.get_concrete_function(tf.TensorSpec((None, 1, 6), tf.float32)).graph
        assert not {"Shape", "ConcatV2"} & {n.op for n in step.as_graph_def().node}
        assert step.outputs[0].shape.as_list() == [None, 1, stop - start]


@pytest.mark.parametrize("shape", [(2, 6), (2, 3, 6), (2, 3, 1, 6)])
@pytest.mark.parametrize("start, stop", [(0, 10), (3, 7)])
def test_dense_gradients_under_a_tape(rng, shape, start, stop):
    """Under a gradient tape `dense` takes `matmul_bias_add`, whose bias gradient is a (1, rows) @ (rows, U) matmul
    (no BiasAddGrad in the step's graph): input, kernel and bias gradients against numpy, also for column slices."""
    import tensorflow as tf

    from tfformer.layers.layer_utils import dense

    kernel = keras.Variable(rng.normal(size=(6, 10)).astype("float32"))
    bias = keras.Variable(rng.normal(size=(10,)).astype("float32"))
    x = rng.normal(size=shape).astype("float32")
    dy = rng.normal(size=shape[:-1] + (stop - start,)).astype("float32")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = dense(x, kernel, bias, start, stop)
        return [y] + tape.gradient(y, [x, kernel.value, bias.value], output_gradients=dy)

    y, dx, dkernel, dbias = (t.numpy() for t in step(x))
    w = kernel.numpy()[:, start:stop]
    x2, dy2 = x.reshape(-1, 6), dy.reshape(-1, stop - start)
    np.testing.assert_allclose(y, x @ w + bias.numpy()[start:stop], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dy @ w.T, rtol=1e-5, atol=1e-5)
    expected_dkernel, expected_dbias = np.zeros((6, 10), "float32"), np.zeros(10, "float32")
    expected_dkernel[:, start:stop], expected_dbias[start:stop] = x2.T @ dy2, dy2.sum(0)
    np.testing.assert_allclose(dkernel, expected_dkernel, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dbias, expected_dbias, rtol=1e-5, atol=1e-5)
    kinds = [n.op for n in step.get_concrete_function(x).graph.as_graph_def().node]
    assert "BiasAddGrad" not in kinds and "IdentityN" in kinds


@pytest.mark.parametrize("case, transposes", [("self", 2), ("cross", 3)])
def test_fused_projection_splits_heads_with_one_transpose(rng, case, transposes):
    """q, k, v (self-attention) or k, v (cross-attention) of the fused kernel come out of one reshape + transpose and
    a split of the leading axis: no split of the last axis, one Transpose each plus the one merging the heads.
    (The values are checked against keras.layers.MultiHeadAttention above.)"""
    import tensorflow as tf

    query = rng.normal(size=(B, T, D)).astype("float32")
    value = query if case == "self" else rng.normal(size=(B, S, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H)
    layer(query, value)
    fn = tf.function(lambda q, v: layer(q, q) if case == "self" else layer(q, v))
    kinds = [n.op for n in fn.get_concrete_function(query, value).graph.as_graph_def().node]
    assert kinds.count("Transpose") == transposes
    assert "SplitV" not in kinds and "Split" not in kinds


@pytest.mark.parametrize("case", ["self", "cross"])
@pytest.mark.parametrize("num_heads, key_dim, value_dim", [(2, 3, None), (3, 2, 5)])
def test_matches_keras_with_unequal_heads_and_head_sizes(rng, case, num_heads, key_dim, value_dim):
    """Head splitting keeps heads and head sizes apart (N != H), for the one-transpose split of the fused kernel
    (value_dim == key_dim) and for the split of the last axis (value_dim != key_dim); keras' layer as reference."""
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = query if case == "self" else rng.normal(size=(B, S, D)).astype("float32")
    ours, ref = _pair(rng, query, value, num_heads, key_dim, value_dim)
    kwargs = {"use_causal_mask": True} if case == "self" else {}
    ours_out, ours_w = ours(query, value, return_attention_scores=True, **kwargs)
    ref_out, ref_w = ref(query, value, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(ours_out, ref_out, atol=1e-5)
    np.testing.assert_allclose(ours_w, ref_w, atol=1e-5)


@pytest.mark.parametrize("value_dim", [None, 6])
def test_cross_attention_gradients_match_keras(rng, value_dim):
    """Under a gradient tape cross-attention splits the fused kernel once into its q and k/v columns (the
    gradient is one concat, no zero-filled StridedSliceGrad per slice): outputs and the gradients of the inputs,
    the fused kernel and its bias against keras.layers.MultiHeadAttention with the same weights."""
    import tensorflow as tf

    query = rng.normal(size=(B, T, D)).astype("float32")
    value = rng.normal(size=(B, S, D)).astype("float32")
    ours, ref = _pair(rng, query, value, value_dim=value_dim)
    dy = rng.normal(size=(B, T, D)).astype("float32")
    projections = [ref._query_dense, ref._key_dense, ref._value_dense]

    @tf.function
    def grads(query, value):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([query, value])
            ours_out, ref_out = ours(query, value), ref(query, value)
        ours_grads = tape.gradient(ours_out, [query, value, ours.qkv_kernel.value, ours.qkv_bias.value],
                                   output_gradients=dy)
        ref_grads = tape.gradient(ref_out, [query, value] + [p.kernel.value for p in projections]
                                  + [p.bias.value for p in projections], output_gradients=dy)
        return ours_out, ref_out, ours_grads, ref_grads

    ours_out, ref_out, ours_grads, ref_grads = grads(query, value)
    np.testing.assert_allclose(ours_out, ref_out, atol=1e-5)
    for ours_g, ref_g in zip(ours_grads[:2], ref_grads[:2]):  # d query, d value
        np.testing.assert_allclose(ours_g, ref_g, atol=1e-4)
    flat = lambda g: g.numpy().reshape(g.shape[0], -1) if len(g.shape) == 3 else g.numpy().reshape(-1)  # noqa: E731
    np.testing.assert_allclose(ours_grads[2], np.concatenate([flat(g) for g in ref_grads[2:5]], axis=1), atol=1e-4)
    np.testing.assert_allclose(ours_grads[3], np.concatenate([flat(g) for g in ref_grads[5:8]]), atol=1e-4)
    kinds = [n.op for n in grads.get_concrete_function(query, value).graph.as_graph_def().node]
    assert "StridedSliceGrad" not in kinds


@pytest.mark.parametrize("case", ["self", "self_causal_padding", "cross_padding", "cross_key_padding",
                                  "gqa_rotary_causal", "additive"])
def test_query_chunks_give_the_numbers_of_one_piece(rng, case):
    # T = 10 queries in chunks of 4: pieces of 4, 4 and 2, each with its rows of the (B, 1, T, S) mask.
    t = 10
    query = rng.normal(size=(B, t, D)).astype("float32")
    value = rng.normal(size=(B, S, D)).astype("float32") if case.startswith("cross") else query
    options = dict(num_key_value_heads=2, rope_max_wavelength=10000.0) if case.startswith("gqa") else {}
    layer = MultiHeadAttention(num_heads=N, key_dim=H, score="additive" if case == "additive" else "scaled_dot",
                               **options)
    layer(query, value)
    for weight in layer.weights:  # larger than the initializers': weights that differ visibly between keys
        weight.assign(rng.normal(scale=0.5, size=weight.shape).astype("float32"))
    kwargs = {"use_causal_mask": "causal" in case}
    if "padding" in case:
        keep = np.arange(value.shape[1])[None, :] < np.array([value.shape[1] - 3, value.shape[1]])[:, None]  # (B, S)
        kwargs["attention_mask"] = np.repeat(keep[:, None, :], t, axis=1)  # (B, T, S)
    if case == "cross_key_padding":  # a mask with one row for every query: (B, 1, 1, S)
        kwargs["value_mask"] = np.arange(S)[None, :] < np.array([S - 3, S])[:, None]  # (B, S)
    whole, whole_weights = layer(query, value, return_attention_scores=True, **kwargs)
    chunked, chunked_weights = layer(query, value, return_attention_scores=True, query_chunk_size=4, **kwargs)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunked_weights, whole_weights, rtol=1e-5, atol=1e-7)
    assert ops.shape(chunked_weights) == (B, N, t, value.shape[1])
    np.testing.assert_allclose(layer(query, value, query_chunk_size=4, **kwargs), whole, rtol=1e-5, atol=1e-6)
    if case != "additive":  # one Softmax per piece; the additive score's masked softmax is no Softmax op
        for size, pieces in ((4, 3), (t, 1)):
            attend = tf.function(lambda q, v, size=size: layer(q, v, query_chunk_size=size, **kwargs))
            assert count_ops("Softmax", attend, query, value) == pieces


def test_query_chunks_in_a_prefill_with_a_cache_equal_one_piece(rng):
    x = rng.normal(size=(B, 6, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=H)
    cache = np.zeros((B, 2, N, 9, H), "float32")
    whole, whole_cache = layer(x, x, use_causal_mask=True, cache=cache, cache_index=0)
    chunked, chunked_cache = layer(x, x, use_causal_mask=True, cache=cache, cache_index=0, query_chunk_size=4)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(chunked_cache, whole_cache)


@pytest.mark.parametrize("size", [0, 2.5, "4"])
def test_query_chunk_size_must_be_a_positive_int(rng, size):
    x = rng.normal(size=(1, 5, D)).astype("float32")
    with pytest.raises(ValueError, match="query_chunk_size"):
        MultiHeadAttention(num_heads=N, key_dim=H)(x, x, query_chunk_size=size)
