"""The decode plan alone: its choices, its layer protocol and its loops."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfformer import models
from tfformer.generation import plan as plan_lib
from tfformer.generation.decode import compiled_functions
from tfformer.generation.plan import DecodePlan, prepared_kernels

CFG = dict(vocabulary_size=40, hidden_dim=16, num_heads=4, intermediate_dim=32, num_encoder_layers=1,
           num_decoder_layers=2, dropout=0.0, max_sequence_length=64)


def _dense(rng, units=10, input_dim=6, use_bias=True, dtype=None):
    layer = keras.layers.Dense(units, use_bias=use_bias, dtype=dtype)
    layer.build((None, input_dim))
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])
    return layer


@pytest.mark.parametrize("kwargs, match", [
    (dict(kernel_layout="columns"), "kernel_layout"),
    (dict(cache_segments=0), "cache_segments"),
    (dict(cache_segments=True), "cache_segments"),
    (dict(kernels={}), "kernel_layout"),
    (dict(kernel_layout="rows", native_bfloat16=True), "native_bfloat16"),
    (dict(in_place_cache_writes=True, native_bfloat16=True), "native_bfloat16"),
    (dict(kernel_layout="halves", transposed_embeddings=True), "transposed_embeddings"),
    (dict(transposed_embeddings=True), "transposed_embeddings"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodePlan(**kwargs)


def _plain_matmuls(plan, x, kernel, bias=None, start=0, stop=None):
    """`plan.dense(...)` and whether its traced graph is the plain form: one MatMul, none of the laid-out forms'
    transposed rows ("rows") or concatenated halves ("halves")."""
    fn = tf.function(lambda x: plan.dense(x, kernel, bias, start, stop))
    kinds = [n.op for n in fn.get_concrete_function(x).graph.as_graph_def().node]
    return fn(x), kinds.count("MatMul") == 1 and not {"Transpose", "ConcatV2", "BatchMatMulV2"} & set(kinds)


def test_default_plan_takes_the_plain_forms(rng):
    """The default plan (what SavedModel export and TFLite trace) has no kernels, no in-place writes, no split
    caches: `dense` takes the plain matmul for any kernel, `uses` and `one_row` say no."""
    layer = _dense(rng)
    plan = DecodePlan().prepared(layer)
    x = tf.constant(rng.normal(size=(1, 1, 6)).astype("float32"))
    assert plan.kernels is None and not plan.in_place_cache_writes and not plan.split_caches
    y, plain = _plain_matmuls(plan, x, layer.kernel, layer.bias)
    np.testing.assert_allclose(y.numpy(), x.numpy() @ layer.kernel.numpy() + layer.bias.numpy(), rtol=1e-5, atol=1e-5)
    assert plain
    assert not plan.uses(x, layer.kernel, layer.bias) and not plan.one_row(x)
    assert DecodePlan().key() != DecodePlan("rows").key() != DecodePlan("rows", in_place_cache_writes=True).key()
    assert DecodePlan("rows").split_caches and not DecodePlan("halves").split_caches


@pytest.mark.parametrize("layout", ["rows", "halves"])
def test_dense_on_its_kernels_equals_the_matmul(rng, layout):
    """`plan.dense` == x @ W[:, a:b] + b[a:b] on the prepared kernel (eagerly too); the plain matmul where it has
    no layout: another kernel, another bias, more than one token, and column slices in "halves"."""
    layer, other = _dense(rng), _dense(rng)
    plan = DecodePlan(layout).prepared(layer)
    assert plan.kernels is not None and plan.kernel_layout == layout
    x = rng.normal(size=(1 if layout == "rows" else 3, 1, 6)).astype("float32")
    w, b = layer.kernel.numpy(), layer.bias.numpy()
    np.testing.assert_allclose(plan.dense(x, layer.kernel, layer.bias, 0, 10).numpy(), x @ w + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.dense(x, layer.kernel, None, 0, 10).numpy(), x @ w, rtol=1e-5, atol=1e-5)
    sliced, plain = _plain_matmuls(plan, x, layer.kernel, layer.bias, 3, 7)
    np.testing.assert_allclose(sliced.numpy(), x @ w[:, 3:7] + b[3:7], rtol=1e-5, atol=1e-5)
    assert plain == (layout == "halves")
    assert plan.uses(x, layer.kernel, layer.bias) and plan.one_row(x) == (layout == "rows")
    x2 = np.repeat(x, 2, axis=1)
    for inputs, kernel, bias, expected in ((x, other.kernel, other.bias, x @ other.kernel.numpy() + other.bias.numpy()),
                                           (x, layer.kernel, other.bias, x @ w + other.bias.numpy()),
                                           (x2, layer.kernel, layer.bias, x2 @ w + b)):
        y, plain = _plain_matmuls(plan, inputs, kernel, bias)
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5)
        assert plain and not plan.uses(inputs, kernel, bias)


def test_prepared_kernels_layouts(rng):
    layer = _dense(rng)
    (rows, bias_id), = prepared_kernels(layer, "rows").values()
    np.testing.assert_array_equal(rows.numpy(),
                                  np.concatenate([layer.kernel.numpy().T, layer.bias.numpy()[:, None]], 1))
    assert bias_id == id(layer.bias)
    (halves, _), = prepared_kernels(layer, "halves").values()
    np.testing.assert_array_equal(np.concatenate([h.numpy() for h in halves], 1), layer.kernel.numpy())
    no_bias = _dense(rng, use_bias=False)
    (rows, bias_id), = prepared_kernels(no_bias, "rows").values()
    assert bias_id is None and not rows.numpy()[:, -1].any()
    with pytest.raises(ValueError, match="layout"):
        prepared_kernels(layer, None)


def test_transposed_embeddings_give_the_tables_logits(rng):
    """`DecodePlan("rows", transposed_embeddings=True)`: each TokenEmbedding's table laid out as float32 columns
    `(D, V)`, which `attend` reads for one row: the logits `x @ E^T` of the plain form, under XLA too; without the
    option no table is laid out."""
    from tfformer.layers.token_embedding import TokenEmbedding

    embedding = TokenEmbedding(11, 6)
    embedding.build()
    embedding.embeddings.assign(rng.normal(size=(11, 6)).astype("float32"))
    x = tf.constant(rng.normal(size=(1, 1, 6)).astype("float32"))
    expected = x.numpy() @ embedding.embeddings.numpy().T  # (1, 1, 11)
    assert id(embedding.embeddings) not in DecodePlan("rows").prepared(embedding).kernels
    plan = DecodePlan("rows", transposed_embeddings=True).prepared(embedding)
    (columns, bias_id), = plan.kernels.values()
    np.testing.assert_array_equal(columns.numpy(), embedding.embeddings.numpy().T)
    assert bias_id is None and DecodePlan("rows", transposed_embeddings=True).key() != DecodePlan("rows").key()
    logits = tf.function(lambda x: embedding(x, reverse=True, plan=DecodePlan(
        "rows", transposed_embeddings=True).prepared(embedding)), jit_compile=True)(x)
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(embedding(x, reverse=True, plan=plan).numpy(), expected, rtol=1e-5, atol=1e-5)
    # The logits read the plan's table, not the layer's: a plan holding twice the table gives twice the logits.
    doubled = DecodePlan("rows", kernels={id(embedding.embeddings): (2 * columns, None)})
    np.testing.assert_allclose(embedding(x, reverse=True, plan=doubled).numpy(), 2 * expected, rtol=1e-5, atol=1e-5)


def test_while_loop_hands_the_body_the_plan():
    """Without narrow rows `while_loop` is `tf.while_loop` whose body gets this plan as its first argument."""
    plan = DecodePlan(in_place_cache_writes=True)
    seen = []

    def body(step_plan, i, total):
        seen.append(step_plan)
        return i + 1, total + i

    i, total = plan.while_loop(lambda i, total: i < 5, body, (tf.constant(0), tf.constant(0)))
    assert (int(i), int(total)) == (5, 10) and seen and all(p is plan for p in seen)


def test_while_loop_carries_bfloat16_rows_through_a_barrier(rng):
    """Under XLA with bfloat16 "rows" the loop state carries them, and the body's plan reads the carried ones:
    same products as the plan outside the loop."""
    layer = _dense(rng, dtype="mixed_bfloat16")
    x = tf.constant(rng.normal(size=(1, 1, 6)).astype("float32"))

    @tf.function(jit_compile=True)
    def run(x):
        plan = DecodePlan("rows", in_place_cache_writes=True).prepared(layer)
        (rows, _), = plan.kernels.values()
        assert rows.dtype == tf.bfloat16
        carried = []

        def body(step_plan, i, y):
            carried.append(step_plan.kernels[id(layer.kernel)][0] is not rows)
            return i + 1, step_plan.dense(x, layer.kernel, layer.bias)

        _, y = plan.while_loop(lambda i, y: i < 3, body, (tf.constant(0), tf.zeros((1, 1, 10))))
        assert carried == [True]
        return y, plan.dense(x, layer.kernel, layer.bias)

    in_loop, outside = run(x)
    np.testing.assert_array_equal(in_loop.numpy(), outside.numpy())
    states = re.findall(r"= \(([^)]*)\) while\(", run.experimental_get_compiler_ir(x)(stage="optimized_hlo"))
    assert states and all("bf16[10,7]" in state and "f32[10,7]" not in state for state in states), states


@pytest.mark.parametrize("segments, expected", [
    (plan_lib.CACHE_SEGMENTS, [16, 32, 64, 128]), (2, [64, 128]), (1, [128])])
def test_segmented_loop_grows_the_caches(segments, expected):
    """Each segment's loop runs on caches of its size; the caches are zero-padded between segments."""
    plan = DecodePlan(cache_segments=segments)
    sizes = []

    def body(step_plan, i, cache):
        sizes.append(int(cache[0].shape[-2]))
        return i + 1, (cache[0] + 1.0,)

    @tf.function  # traced once: each segment's body once
    def run(cache):
        return plan.segmented_loop(lambda i, cache: tf.constant(True), body, (tf.constant(0), (cache,)), 1, 3, 128)

    i, (cache,) = run(tf.zeros((1, 2, 1, 3, 2)))
    assert sizes == [3 + s for s in expected] and int(i) == 3 + 128
    assert tuple(cache.shape) == (1, 2, 1, 131, 2)
    # Slot s was in the cache for the steps from the segment that first held it on: fewer adds the later it came.
    adds = cache.numpy()[0, 0, 0, :, 0]
    starts = [0] + [3 + size for size in expected[:-1]]  # the step each segment starts at
    assert list(adds[: 3 + expected[0]]) == [131] * (3 + expected[0])
    for start, stop in zip(starts[1:], [3 + size for size in expected[1:]]):
        prev = 3 + expected[expected.index(stop - 3) - 1]
        assert list(adds[prev:stop]) == [131 - start] * (stop - prev)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_layer_caches(kv_heads):
    """Stacked per-layer caches `(B, 2, K, S, H)` in the dtype asked for; split float32 pairs `(B*K, S, H)` in the
    "rows" plan."""
    model = models.build_causal_lm(models.TransformerConfig(architecture="causal_lm", num_key_value_heads=kv_heads,
                                                            **CFG))
    k = kv_heads or CFG["num_heads"]
    stacked = DecodePlan("halves").layer_caches(model, 3, 5, "bfloat16")
    assert [(tuple(c.shape), c.dtype) for c in stacked] == [((3, 2, k, 5, 4), tf.bfloat16)] * 2
    split = DecodePlan("rows").layer_caches(model, 3, 5, "bfloat16")
    assert [[(tuple(h.shape), h.dtype) for h in pair] for pair in split] == [[((3 * k, 5, 4), tf.float32)] * 2] * 2


def test_beam_search_refuses_a_kernel_layout():
    """Beam search reorders stacked caches along the batch axis: a plan with split caches or prepared kernels is
    an error, not a silent misorder; `decode_fn` hands it a plan without a layout."""
    from tfformer.generation import decode
    from tfformer.generation.beam import BeamSampler

    model = models.build_causal_lm(models.TransformerConfig(architecture="causal_lm", **CFG))
    for plan in (DecodePlan("rows"), DecodePlan("halves")):
        with pytest.raises(ValueError, match="kernel_layout"):
            BeamSampler(2).run(None, tf.zeros([1, 4], tf.int32), (), 0, 3, 4, ids=tf.zeros([2, 1], tf.int32),
                               plan=plan)
    assert callable(decode.decode_fn(model, 4, beam_size=2, plan=DecodePlan("rows", in_place_cache_writes=True)))
    with pytest.raises(ValueError, match="not both"):
        decode.decode_fn(model, 4, kernel_layout="halves", plan=DecodePlan("rows"))


def test_generate_ids_takes_a_plan(rng):
    """A caller's plan (here one loop over the full cache; the default runs two, on 20 and 40 new slots) gives the
    default plan's tokens and its own compiled function; a plan that already holds prepared kernels is refused
    (they are laid out inside the function)."""
    from tests.harness import spread

    from tfformer import generation

    model = spread(models.build_causal_lm(models.TransformerConfig(architecture="causal_lm", **CFG)), seed=1)
    prompts = np.array([[5, 6, 7, 0], [9, 10, 11, 12]], "int32")
    default = np.asarray(generation.generate_ids(model, prompts, 40, jit_compile=False, end_id=-1))
    one_loop = np.asarray(generation.generate_ids(model, prompts, 40, jit_compile=False, end_id=-1,
                                                  plan=DecodePlan(cache_segments=1)))
    np.testing.assert_array_equal(one_loop, default)
    assert len(set(default.ravel())) > 3  # not one repeated token
    assert sorted(key[-2] for key in compiled_functions(model)) == [1, plan_lib.CACHE_SEGMENTS]
    with pytest.raises(ValueError, match="prepared kernels"):
        generation.generate_ids(model, prompts, 4, plan=DecodePlan("halves").prepared(model))


def _bfloat16_softmax_inputs(graph):
    """How many Softmax ops of `graph` (and its functions) take bfloat16 tensors."""
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(n.op in ("Softmax", "_MklSoftmax") and n.attr["T"].type == tf.bfloat16.as_datatype_enum for n in nodes)


def test_native_bfloat16_gives_the_float32_casts_numbers(rng):
    """`native_bfloat16`: a bfloat16 prompt pass through grouped-query attention with rotary positions and a SwiGLU
    feed-forward takes its softmax and SiLU on bfloat16 tensors (the graph shows it) and gives the numbers of the
    float32 casts around them, to bfloat16 rounding. 300 keys per row: a softmax that summed in bfloat16 would be
    off by several units in the last place."""
    from tfformer import layers

    block = layers.DecoderBlock(num_heads=4, intermediate_dim=64, cross_attention=False, activation="swiglu",
                                norm_first=True, normalization="rms", use_bias=False, rope_max_wavelength=1000.0,
                                num_key_value_heads=2, dtype="bfloat16")
    x = tf.constant(rng.normal(size=(1, 300, 32)), tf.bfloat16)
    block.build(x.shape)
    block.set_weights([rng.normal(size=w.shape).astype("float32") * 0.4 for w in block.get_weights()])
    cache = tf.zeros((1, 2, 2, 304, 8), tf.bfloat16)  # (B, 2, K, S, H)
    outputs = {}
    for native in (False, True):
        plan = DecodePlan(native_bfloat16=native)
        fn = tf.function(lambda x, cache, plan=plan: block(x, cache=cache, cache_index=0, plan=plan), autograph=False)
        graph = fn.get_concrete_function(x, cache).graph.as_graph_def()
        assert _bfloat16_softmax_inputs(graph) == (1 if native else 0)
        outputs[native] = [np.asarray(tf.cast(t, tf.float32)) for t in fn(x, cache)]
    assert np.abs(outputs[True][0]).max() > 0.1  # not a vanishing output
    if not plan_lib.native_bfloat16_on_this_cpu():
        # No bfloat16 instructions (e.g. AMD Zen 2): the kernels differ, so prompt passes never take the form.
        pytest.skip("no avx512_bf16 / amx_bf16 on this CPU: the native form is not taken here (checked below)")
    for plain, native in zip(outputs[False], outputs[True]):
        np.testing.assert_allclose(native, plain, rtol=2 ** -8, atol=1e-6)


def test_native_bfloat16_only_on_cpus_with_bfloat16_instructions(tmp_path):
    """The prompt pass takes `native_bfloat16` where /proc/cpuinfo's flags show bfloat16 instructions, else not."""
    for flags, expected in (("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16", True)):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
        assert plan_lib.native_bfloat16_on_this_cpu(str(cpuinfo)) is expected
    assert plan_lib.native_bfloat16_on_this_cpu(str(tmp_path / "missing")) is False
