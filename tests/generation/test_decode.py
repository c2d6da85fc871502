import contextlib
import itertools
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import spread as _spread
from tests.harness import matmuls_fed_by
from tfformer import generation, models
from tfformer.generation import decode
from tfformer.generation.decode import END_ID
from tfformer.generation.decode import compiled_functions

CFG = dict(vocabulary_size=24, hidden_dim=16, num_heads=2, intermediate_dim=32, num_encoder_layers=1,
           num_decoder_layers=2, dropout=0.0, max_sequence_length=32, norm_first=True, tie_embeddings=False)


@pytest.fixture(scope="module")
def seq2seq():
    return _spread(models.build_seq2seq(models.TransformerConfig(**CFG)))


@pytest.fixture(scope="module")
def lm():
    return _spread(models.build_causal_lm(models.TransformerConfig(architecture="causal_lm", **CFG)), seed=1)


SOURCE = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14], [4, 0, 0, 0, 0, 0]], "int32")
PROMPTS = np.array([[5, 6, 7, 0, 0], [9, 10, 11, 12, 13], [8, 0, 0, 0, 0]], "int32")


def _uncached_seq2seq(model, src, steps):
    out = []
    for row in src:
        dec = [2]
        for _ in range(steps):
            logits = np.asarray(model({"encoder_token_ids": row[None], "decoder_token_ids": np.array([dec], "int32")}))
            dec.append(int(logits[0, -1].argmax()))
            if dec[-1] == END_ID:
                break
        out.append(dec[1:])
    return out


def _uncached_lm(model, prompts, steps):
    out = []
    for row in prompts:
        seq = [int(t) for t in row if t]
        new = []
        for _ in range(steps):
            logits = np.asarray(model({"token_ids": np.array([seq], "int32")}))
            seq.append(int(logits[0, -1].argmax()))
            new.append(seq[-1])
            if new[-1] == END_ID:
                break
        out.append(new)
    return out


def _trim(ids):
    rows = []
    for row in np.asarray(ids).tolist():
        rows.append(row[: row.index(END_ID) + 1] if END_ID in row else row)
    return rows


def test_cached_greedy_equals_uncached_seq2seq(seq2seq):
    cached = generation.generate_ids(seq2seq, SOURCE, max_new_tokens=8)
    expected = _uncached_seq2seq(seq2seq, SOURCE, 8)
    assert _trim(cached) == expected
    assert len({tuple(r) for r in expected}) > 1 and any(len(set(r)) > 2 for r in expected)  # a non-trivial test
    # After an end token, only padding.
    for row in np.asarray(cached).tolist():
        if END_ID in row:
            assert all(t == 0 for t in row[row.index(END_ID) + 1 :])


def test_cached_greedy_equals_uncached_causal_with_ragged_prompts(lm):
    cached = generation.generate_ids(lm, PROMPTS, max_new_tokens=7)
    assert _trim(cached) == _uncached_lm(lm, PROMPTS, 7)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("architecture", ["seq2seq", "causal_lm"])
def test_grouped_query_attention_cached_greedy_equals_uncached(architecture, jit_compile):
    """4 query heads over 2 key/value heads: cached greedy decoding (under XLA a batch of one on the "rows" plan
    with split caches, the batch on "halves"; without XLA the plain forms) == decoding without a cache."""
    config = models.TransformerConfig(**dict(CFG, architecture=architecture, num_heads=4, num_key_value_heads=2))
    build = models.build_seq2seq if architecture == "seq2seq" else models.build_causal_lm
    model = _spread(build(config), seed=2 if architecture == "seq2seq" else 5)
    inputs = SOURCE if architecture == "seq2seq" else PROMPTS
    uncached = _uncached_seq2seq if architecture == "seq2seq" else _uncached_lm
    expected = uncached(model, inputs, 6)
    assert len({tuple(r) for r in expected}) > 1 and any(len(set(r)) > 2 for r in expected)  # a non-trivial test
    batch = generation.generate_ids(model, inputs, max_new_tokens=6, jit_compile=jit_compile)
    assert _trim(batch) == expected
    rows = [generation.generate_ids(model, inputs[i : i + 1], 6, jit_compile=jit_compile) for i in range(len(inputs))]
    assert [_trim(r)[0] for r in rows] == expected
    if jit_compile:
        assert sorted(key[-1] for key in compiled_functions(model)) == ["halves", "rows"]


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("fixture", ["seq2seq", "lm"])
def test_beam_search_honours_end_id(request, fixture, jit_compile):
    """Beam search ends a beam at `end_id` (it used to stop only at id 3): a token that the beams produce
    mid-row without an end id, made the end id, is followed by padding only in every row."""
    model = request.getfixturevalue(fixture)
    ids = SOURCE if fixture == "seq2seq" else PROMPTS
    free = np.asarray(generation.generate_ids(model, ids, 6, beam_size=2, end_id=-1, jit_compile=jit_compile))
    assert (free != 0).all()  # no end: every position generated
    end = int(free[0, 1])  # a token some row continues after
    ended = np.asarray(generation.generate_ids(model, ids, 6, beam_size=2, end_id=end, jit_compile=jit_compile))
    assert (ended == end).any()
    for row in ended.tolist():
        if end in row:
            assert all(t == 0 for t in row[row.index(end) + 1 :]), (end, row)


@pytest.mark.parametrize("fixture", ["seq2seq", "lm"])
def test_beam_one_and_top_k_one_equal_greedy(request, fixture):
    model = request.getfixturevalue(fixture)
    ids = SOURCE if fixture == "seq2seq" else PROMPTS
    greedy = np.asarray(generation.generate_ids(model, ids, max_new_tokens=6))
    beam1 = np.asarray(generation.generate_ids(model, ids, max_new_tokens=6, beam_size=1))
    topk1 = np.asarray(generation.generate_ids(model, ids, max_new_tokens=6,
                                               sampler=generation.TopKSampler(k=1, seed=3)))
    assert _trim(beam1) == _trim(greedy)
    np.testing.assert_array_equal(topk1, greedy)


@pytest.mark.parametrize("cls, extra", [(generation.TemperatureSampler, {}), (generation.TopKSampler, {"k": 5}),
                                        (generation.TopPSampler, {"p": 0.8})])
def test_sampling_is_reproducible_with_a_seed(seq2seq, cls, extra):
    a = generation.generate_ids(seq2seq, SOURCE, 8, sampler=cls(temperature=1.5, seed=7, **extra))
    b = generation.generate_ids(seq2seq, SOURCE, 8, sampler=cls(temperature=1.5, seed=7, **extra))
    c = generation.generate_ids(seq2seq, SOURCE, 8, sampler=cls(temperature=1.5, seed=8, **extra))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_p_only_samples_from_the_nucleus():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], "float32"))
    sampler = generation.TopPSampler(p=0.75)
    seen = {int(sampler.get_next_token(logits, step)[0]) for step in range(200)}
    assert seen == {0, 1}


def test_exhaustive_search_equals_wide_beam():
    """With beam width V^(L-1), beam search is exact: it must find the best sequence by enumeration."""
    config = models.TransformerConfig(**dict(CFG, vocabulary_size=6))
    model = _spread(models.build_seq2seq(config), seed=4)
    src = np.array([[4, 5, 1]], "int32")
    length, vocab = 3, 6

    memo = {}

    def log_probs(prefix):
        if prefix not in memo:
            dec = np.array([[2, *prefix]], "int32")
            logits = np.asarray(model({"encoder_token_ids": src, "decoder_token_ids": dec}))[0, -1].astype("float64")
            memo[prefix] = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        return memo[prefix]

    def score(seq):
        return sum(log_probs(tuple(seq[:k]))[token] for k, token in enumerate(seq))

    candidates = {}
    for seq in itertools.product(range(vocab), repeat=length):
        cut = seq[: seq.index(END_ID) + 1] if END_ID in seq else seq
        candidates[cut] = score(cut)
    best = max(candidates, key=candidates.get)
    beam = np.asarray(generation.generate_ids(model, src, length, beam_size=vocab ** (length - 1), length_penalty=0.0))
    assert tuple(_trim(beam)[0]) == best


GREEDY = ("greedy", 1.0, None, None, 0)  # Sampler().key()


def _fn_key(model, max_new_tokens, layout, method=GREEDY):
    """The key of the XLA function `generate_ids` caches in `compiled_functions(model)` (its default plan)."""
    from tfformer.generation.plan import DecodePlan

    return (model.config.architecture, max_new_tokens, method, True, END_ID,
            *DecodePlan(layout, in_place_cache_writes=True).key())


@pytest.mark.parametrize("batch", [1, 2])  # a batch of one has its own function (kernel layout "rows")
def test_generate_does_not_retrace(seq2seq, batch):
    generation.generate_ids(seq2seq, SOURCE[:batch], 5)
    layout = "rows" if batch == 1 else "halves"
    fn = compiled_functions(seq2seq)[_fn_key(seq2seq, 5, layout)]
    before = fn.experimental_get_tracing_count()
    for length in (3, 7, 9):
        generation.generate_ids(seq2seq, np.ones((batch, length), "int32") * 5, 5)
    assert fn.experimental_get_tracing_count() == before


@pytest.mark.parametrize("fixture, batch, beam_size", [("lm", 1, None), ("lm", 2, None), ("lm", 2, 2),
                                                       ("seq2seq", 2, None), ("seq2seq", 2, 2)])
def test_xla_compiles_once_per_shape_not_per_prompt(request, fixture, batch, beam_size):
    # A value-dependent slice (e.g. a prefill of the shortest prompt's length) makes XLA treat the ids as a
    # compile-time constant: one compilation, seconds long, per new prompt and a cache that grows with them.
    # The HLO XLA compiles for prompts of one shape with other values and other row lengths must be the same.
    model = request.getfixturevalue(fixture)
    first = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]], "int32")[:batch]
    other = np.array([[4, 9, 0, 0, 0, 0], [7, 7, 8, 5, 6, 0]], "int32")[:batch]
    generation.generate_ids(model, first, 6, beam_size=beam_size)
    method = ("beam", beam_size, 0.6) if beam_size else GREEDY
    layout = None if beam_size else "rows" if batch == 1 else "halves"
    fn = compiled_functions(model)[_fn_key(model, 6, layout, method)]
    padded = [tf.pad(ids, [[0, 0], [0, 16 - ids.shape[1]]]) for ids in (first, other)]  # generate_ids' bucket
    hlo = [fn.experimental_get_compiler_ir(ids)(stage="hlo") for ids in padded]
    assert hlo[0] == hlo[1]


@pytest.mark.parametrize("rows, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (33, 64), (64, 64), (65, 128),
                                          (130, 192)])
def test_batch_bucket(rows, bucket):
    assert decode.batch_bucket(rows) == bucket


@pytest.mark.parametrize("fixture", ["lm", "seq2seq"])
def test_xla_batch_sizes_share_a_compilation(request, fixture):
    # A batch of 3 runs the compiled function at the bucket's 4 rows (one compilation for batches of 3 and 4)
    # and returns its own 3 rows: those of a batch of 4 that starts with them (rows decode independently).
    model = request.getfixturevalue(fixture)
    ids = np.array([[5, 6, 7, 0], [9, 10, 11, 12], [4, 9, 0, 0], [7, 7, 8, 5]], "int32")
    four = generation.generate_ids(model, ids, 6).numpy()
    key = _fn_key(model, 6, "halves")
    fn, shapes = compiled_functions(model)[key], []
    compiled_functions(model)[key] = lambda x: shapes.append(tuple(x.shape)) or fn(x)
    try:
        three = generation.generate_ids(model, ids[:3], 6).numpy()
    finally:
        compiled_functions(model)[key] = fn
    assert shapes == [(4, 16)]
    np.testing.assert_array_equal(three, four[:3])


def test_bad_arguments(seq2seq, lm):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generation.generate_ids(seq2seq, SOURCE, 0)
    with pytest.raises(ValueError, match="beam_size"):
        generation.generate_ids(seq2seq, SOURCE, 4, beam_size=0)
    with pytest.raises(ValueError, match="max_sequence_length=32"):
        generation.generate_ids(lm, np.ones((1, 30), "int32"), 5)
    with pytest.raises(ValueError, match="empty prompt"):
        generation.generate_ids(lm, np.array([[5, 6], [0, 0]], "int32"), 3)
    # A prompt's length is its count of non-padding ids: left or inner padding read the padding as the prompt's
    # last tokens (a wrong continuation, no error). Hugging Face pads decoder-only prompts on the left.
    for padded in ([[0, 0, 5, 6]], [[5, 0, 0, 6]], [[5, 6, 7, 0], [0, 5, 6, 7]]):
        with pytest.raises(ValueError, match=r"`token_ids` must be right-padded.*rows \["):
            generation.generate_ids(lm, np.array(padded, "int32"), 3)
    with pytest.raises(ValueError, match="empty source"):  # was decoded from padding alone
        generation.generate_ids(seq2seq, np.array([[5, 6], [0, 0]], "int32"), 3)
    with pytest.raises(ValueError, match="integer ids.*float64"):  # was "`inputs` must hold str"
        lm.generate(np.array([[5.0, 6.0]]), max_new_tokens=3)
    with pytest.raises(ValueError, match="`sampler` must be a Sampler.*'nucleus'"):
        generation.generate_ids(seq2seq, SOURCE, 4, sampler="nucleus")
    # Float ids used to be truncated to int32 silently; out-of-range ids clamped by XLA's gather.
    with pytest.raises(ValueError, match="integer ids.*float64"):
        generation.generate_ids(lm, np.array([[5.5, 6.0]]), 3)
    with pytest.raises(ValueError, match=r"2-D.*\(3,\)"):
        generation.generate_ids(lm, np.array([5, 6, 7]), 3)
    vocab = lm.config.vocabulary_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"\[0, vocabulary_size={vocab}\)"):
            generation.generate_ids(lm, np.array([[5, bad]]), 3, jit_compile=True)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_causal_beam_search_with_and_without_xla(lm, jit_compile):
    out = np.asarray(generation.generate_ids(lm, PROMPTS, max_new_tokens=5, beam_size=3, jit_compile=jit_compile))
    assert out.shape == (3, 5)
    one = np.asarray(generation.generate_ids(lm, PROMPTS, max_new_tokens=5, beam_size=1, jit_compile=jit_compile))
    assert _trim(one) == _trim(generation.generate_ids(lm, PROMPTS, max_new_tokens=5, jit_compile=jit_compile))


def test_segment_sizes():
    from tfformer.generation.plan import segment_sizes

    assert segment_sizes(128) == [16, 32, 64, 128]
    assert segment_sizes(48) == [24, 48]  # 6 and 12 slots are below MIN_SEGMENT
    assert segment_sizes(16) == [16]
    assert segment_sizes(1) == [1]


def test_split_slots():
    """Split caches from 3/4 of XLA's one-core edge (128 KiB per head) up are allocated past it, a multiple of 8."""
    from tfformer.generation.plan import split_slots

    # float32, H = 64: a head holds 128 KiB at 512 slots, so 384-512 become 520.
    assert [split_slots(s, 64) for s in (1, 383, 384, 500, 512, 513, 1000)] == [1, 383, 520, 520, 520, 513, 1000]
    # H = 32, or bfloat16 at H = 64: the edge is at 1024 slots, 768-1024 become 1032.
    assert [split_slots(s, 32) for s in (767, 768, 1024, 1025)] == [767, 1032, 1032, 1025]
    assert [split_slots(s, 64, itemsize=2) for s in (767, 768, 1024, 1025)] == [767, 1032, 1032, 1025]
    # The tensor form (prompt widths are tensors while tracing) gives the same numbers.
    slots = np.arange(300, 1100)
    expected = [split_slots(int(s), 64) for s in slots]
    np.testing.assert_array_equal(split_slots(tf.constant(slots, tf.int32), 64).numpy(), expected)


def test_batch_one_decoding_on_caches_grown_past_the_edge():
    """A batch-1 XLA decode whose split caches hold 400 slots gets 520 (H = 64): same tokens as without XLA."""
    config = models.TransformerConfig(architecture="causal_lm", **dict(
        CFG, hidden_dim=64, num_heads=1, intermediate_dim=64, num_decoder_layers=1, max_sequence_length=448))
    model = _spread(models.build_causal_lm(config), seed=2, scale=0.3)
    from tfformer.generation.plan import layer_caches

    assert [tuple(c.shape) for c in layer_caches(model, 1, 400, split=True)[0]] == [(1, 520, 64)] * 2
    assert tuple(layer_caches(model, 1, 400)[0].shape) == (1, 2, 1, 400, 64)  # stacked ones are not grown
    prompt = np.random.default_rng(3).integers(4, CFG["vocabulary_size"], size=(1, 380)).astype("int32")
    slots = []
    step = model.decode_step

    def spy(token_ids, cache, cache_index, *args, **kwargs):
        slots.append(int(cache[0][0].shape[-2]))
        return step(token_ids, cache, cache_index, *args, **kwargs)

    model.decode_step = spy
    try:
        eager = np.asarray(decode.decode_fn(model, 8, end_id=-1, kernel_layout="rows")(prompt))  # the loop, eagerly
    finally:
        del model.decode_step
    assert set(slots) == {520}  # 380 + 8 slots, grown
    xla = np.asarray(generation.generate_ids(model, prompt, max_new_tokens=8, end_id=-1))  # bucket 384 + 8 slots
    reference = np.asarray(generation.generate_ids(model, prompt, max_new_tokens=8, end_id=-1, jit_compile=False))
    np.testing.assert_array_equal(eager, reference)
    np.testing.assert_array_equal(xla, reference)
    assert len(set(reference.ravel())) > 2  # not one repeated token


@pytest.mark.parametrize("beam_size, kernel_layout", [(None, None), (None, "rows"), (2, None)])
@pytest.mark.parametrize("fixture", ["seq2seq", "lm"])
def test_decode_steps_attend_over_growing_caches(request, fixture, beam_size, kernel_layout, monkeypatch):
    """A step attends over a cache sized to what is filled (prompt + 1, 2, 4, 7 slots), not the full buffer;
    stacked caches, or split ones in the one-row ("rows", a batch of one) loop."""
    from tfformer.generation import decode
    from tfformer.generation import plan as plan_lib

    monkeypatch.setattr(plan_lib, "MIN_SEGMENT", 1)  # tiny models: segment from one slot up
    model = request.getfixturevalue(fixture)
    inputs, new_tokens = (SOURCE, 7) if fixture == "seq2seq" else (PROMPTS, 7)
    # A batch of one: a prompt as wide as the input, so that its 7 new tokens reach the last segment (the last
    # token is written, not fed to a step: a shorter prompt's steps end in an earlier segment).
    inputs = inputs[1:2] if kernel_layout == "rows" else inputs
    prefix = 0 if fixture == "seq2seq" else PROMPTS.shape[1]
    seen = []  # (first position written, cache slots) per decode_step call
    step = model.decode_step

    def spy(token_ids, cache, cache_index, *args, **kwargs):
        # Split caches, 2 x (B*N, S, H) per layer, in the one-row loop; else stacked ones, (B, 2, N, S, H).
        assert isinstance(cache[0], tuple) == (kernel_layout == "rows")
        slots = int(tf.nest.flatten(cache[0])[0].shape[-2])
        seen.append((int(cache_index), slots))
        assert int(cache_index) + token_ids.shape[1] <= slots  # every write lands inside the cache
        return step(token_ids, cache, cache_index, *args, **kwargs)

    monkeypatch.setattr(model, "decode_step", spy)
    eager = decode.decode_fn(model, new_tokens, beam_size=beam_size, kernel_layout=kernel_layout)(inputs)  # eager loop
    monkeypatch.undo()
    slots = [s for _, s in seen]
    assert slots == sorted(slots) and slots[-1] == prefix + new_tokens
    assert sorted(set(slots)) == [prefix + n for n in (1, 2, 4, 7)]
    if beam_size is None:  # same tokens as decoding without a cache
        uncached = _uncached_seq2seq if fixture == "seq2seq" else _uncached_lm
        assert _trim(eager) == uncached(model, inputs, new_tokens)
    else:  # same beams as one full-size cache (MIN_SEGMENT is back to 16: one loop for 7 tokens)
        full = generation.generate_ids(model, inputs, new_tokens, beam_size=beam_size, jit_compile=False)
        np.testing.assert_array_equal(np.asarray(eager), np.asarray(full))


def test_last_only_logits_equal_the_last_row(lm):
    cache = lm.empty_cache(3, 8)
    full, full_cache = lm.decode_step(PROMPTS, cache, 0)
    last, last_cache = lm.decode_step(PROMPTS, cache, 0, last_only=True)
    assert tuple(last.shape) == (3, 1, CFG["vocabulary_size"])
    np.testing.assert_allclose(np.asarray(last), np.asarray(full)[:, -1:], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(last_cache), np.asarray(full_cache))


def test_logits_index_equals_that_row(lm):
    cache = lm.empty_cache(3, 8)
    full, full_cache = lm.decode_step(PROMPTS, cache, 0)
    for index in (0, 2, tf.constant(3)):
        one, one_cache = lm.decode_step(PROMPTS, cache, 0, logits_index=index)
        assert tuple(one.shape) == (3, 1, CFG["vocabulary_size"])
        np.testing.assert_allclose(np.asarray(one), np.asarray(full)[:, int(index):int(index) + 1], atol=1e-6)
        np.testing.assert_array_equal(np.asarray(one_cache), np.asarray(full_cache))
    with pytest.raises(ValueError, match="not both"):
        lm.decode_step(PROMPTS, cache, 0, last_only=True, logits_index=1)


def _randomized(model, seed):
    """`spread` kernels plus small random biases, so that a dropped or misplaced bias would show."""
    rng = np.random.default_rng(seed)
    _spread(model, seed)
    for w in model.weights:
        if w.name.endswith("bias"):
            w.assign(rng.normal(size=w.shape).astype("float32") * 0.1)
    return model


ONE_ROW_MODELS = {
    "causal tied gelu": dict(architecture="causal_lm", tie_embeddings=True, activation="gelu"),
    "causal tied gelu_approximate": dict(architecture="causal_lm", tie_embeddings=True, activation="gelu_approximate"),
    "causal untied swiglu": dict(architecture="causal_lm", tie_embeddings=False, activation="swiglu"),
    "seq2seq untied relu": dict(architecture="seq2seq", tie_embeddings=False, activation="relu"),
}


def _one_row_model(options, policy="float32"):
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        config = models.TransformerConfig(**dict(CFG, **options))
        build = models.build_causal_lm if options["architecture"] == "causal_lm" else models.build_seq2seq
        return _randomized(build(config), seed=4)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.fixture(scope="module")
def one_row_model():
    """`(name, policy="float32") -> model`: `ONE_ROW_MODELS[name]` built under `policy`, once per module: the decode
    functions that `generate_ids` keeps on it (`compiled_functions`), and XLA's compilations of them, serve every test
    that decodes with it. Tests look at the functions their own calls use (`_decodes`), never at all of them."""
    built = {}

    def get(name, policy="float32"):
        if (name, policy) not in built:
            built[name, policy] = _one_row_model(ONE_ROW_MODELS[name], policy)
        return built[name, policy]

    yield get
    built.clear()


@pytest.fixture(scope="module")
def xla_step():
    """`_xla_step`, computed once per model and layout in the module (its function compiles each time it is made)."""
    done = {}

    def get(model, layout):
        if (id(model), layout) not in done:
            done[id(model), layout] = model, _xla_step(model, layout)  # the model held: its id stays its own
        return done[id(model), layout][1]

    yield get
    done.clear()


@contextlib.contextmanager
def _decodes(model):
    """`with _decodes(model) as used:` the keys of `compiled_functions(model)` whose functions the decodes inside
    run, one per call in call order (each made there or reused: `decode.cached_function`). On leaving, every
    function added to `compiled_functions(model)` is one of them and each of them is kept: what a model's functions
    would be after these calls alone."""
    before, used, cached_function = set(compiled_functions(model)), [], decode.cached_function

    def spy(of, key, make):
        if of is model:
            used.append(key)
        return cached_function(of, key, make)

    decode.cached_function = spy
    try:
        yield used
    finally:
        decode.cached_function = cached_function
    added = set(compiled_functions(model)) - before
    assert added <= set(used) <= set(compiled_functions(model)), (added, used)


def _xla_step(model, layout):
    """One decode step of one token under XLA at position 3 of a cache, batch 1 (rows) or 2, a `DecodePlan` of
    kernel layout `layout` (None: off). Returns the first row's logits and the matmuls with a prepared-kernel
    operand."""
    import tensorflow as tf

    from tfformer.generation.plan import DecodePlan

    batch = 1 if layout in (None, "rows") else 2
    tokens = np.array([[7], [9]][:batch], "int32")

    @tf.function(jit_compile=True)
    def step(tokens):
        plan = DecodePlan(layout, in_place_cache_writes=True).prepared(model)
        cache = tuple(tf.unstack(model.empty_cache(batch, 8)))
        if model.config.architecture == "seq2seq":
            encoder_outputs, mask = model.encode(tf.constant(SOURCE[:batch]))
            cross = tuple(tf.unstack(model.cross_attention_caches(encoder_outputs)))
            return model.decode_step(tokens, cache, 3, cross, mask, plan=plan)[0]
        return model.decode_step(tokens, cache, 3, plan=plan)[0]

    fed = matmuls_fed_by("Identity" if layout == "halves" else "Transpose", step, tokens)
    return np.asarray(step(tokens))[:1], fed


@pytest.mark.parametrize("layout", ["rows", "halves"])
@pytest.mark.parametrize("name", list(ONE_ROW_MODELS))
def test_decode_step_on_prepared_kernels_equals_the_plain_step(one_row_model, xla_step, name, layout):
    """XLA decoding on kernels laid out before the loop (DecodePlan: [W^T | b] transposed back for a batch of
    one, column halves for more): same logits as the plain step, biases included."""
    model = one_row_model(name)
    plain, plain_fed = xla_step(model, None)
    prepared, fed = xla_step(model, layout)
    # Every decode-step matmul of a decoder layer (self-attention qkv/output, FFN in/out, for seq2seq also the
    # cross-attention output, and its query in "rows": "halves" leaves a column slice plain) and an untied
    # output projection use the prepared kernels (two matmuls each for "halves").
    seq2seq = ONE_ROW_MODELS[name]["architecture"] == "seq2seq"
    per_layer = (6 if layout == "rows" else 5) if seq2seq else 4
    untied = 0 if ONE_ROW_MODELS[name]["tie_embeddings"] else 1
    assert fed - (plain_fed if layout == "rows" else 0) >= (per_layer * CFG["num_decoder_layers"] + untied) * (
        1 if layout == "rows" else 2)
    assert np.abs(plain).max() > 1.0  # logits of some size, so that the tolerance below means something
    np.testing.assert_allclose(prepared, plain, rtol=1e-5, atol=1e-4)


def test_one_row_decode_step_under_mixed_bfloat16(one_row_model, xla_step):
    """Under mixed_bfloat16 the one-row matmuls read bfloat16 rows (the weights as the bfloat16 step multiplies
    them; their dtypes: test_rows_take_the_compute_dtype_of_the_layer_that_holds_the_kernel) in float32
    products: same logits as the bfloat16 step, to bfloat16 precision."""
    reference, _ = xla_step(one_row_model("causal untied swiglu"), None)
    model = one_row_model("causal untied swiglu", "mixed_bfloat16")
    plain, _ = xla_step(model, None)
    rows, transposed = xla_step(model, "rows")
    assert transposed >= 4 * CFG["num_decoder_layers"] + 1
    assert rows.dtype == plain.dtype == np.float32
    scale = np.abs(reference).max()
    assert np.abs(plain - reference).max() < 0.05 * scale  # what bfloat16 costs here
    assert np.abs(rows - reference).max() < 0.05 * scale
    assert np.abs(rows - plain).max() < 0.05 * scale


def test_rows_take_the_compute_dtype_of_the_layer_that_holds_the_kernel(one_row_model):
    """A float32 layer inside a mixed_bfloat16 model (the untied output projection: float32 logits) keeps float32
    rows, no silent rounding of its weights; the decoder blocks' are bfloat16. A float32 model's stay float32."""
    from tfformer.generation.plan import prepared_kernels

    model = one_row_model("causal untied swiglu", "mixed_bfloat16")
    head = model.get_layer("output_projection")
    assert head.compute_dtype == "float32"
    table = prepared_kernels(model, "rows")
    assert table[id(head.kernel)][0].dtype.name == "float32"
    assert {rows.dtype.name for key, (rows, _) in table.items() if key != id(head.kernel)} == {"bfloat16"}
    assert len(table) == 4 * CFG["num_decoder_layers"] + 1
    plain = prepared_kernels(one_row_model("causal untied swiglu"), "rows")
    assert {rows.dtype.name for rows, _ in plain.values()} == {"float32"}


def _loop_states(hlo):
    """The shapes in the state tuples of an optimized HLO module's while loops, e.g. "bf16[32,17]"."""
    states = re.findall(r"= \(([^)]*)\) while\(", hlo)
    return [re.findall(r"(?:bf16|f32|f16|s32|pred)\[[0-9,]*\]", state) for state in states]


def test_batch_one_decode_loop_reads_bfloat16_rows_under_mixed_bfloat16(one_row_model):
    """The decode loop's state carries the bfloat16 rows (`DecodePlan.while_loop`): without the barrier XLA hoists
    their conversion out of the loop and every step reads a float32 copy, twice the bytes. Its caches are float32
    split pairs (`SplitCache`: no cast to bfloat16 at each layer call). Tokens: the same as the batch's, whose
    matmuls run in bfloat16 too."""
    model = one_row_model("causal untied swiglu", "mixed_bfloat16")
    with _decodes(model) as used:
        rows = np.asarray(generation.generate_ids(model, PROMPTS[1:2], max_new_tokens=6))
    (fn,) = [compiled_functions(model)[key] for key in used]
    hlo = fn.experimental_get_compiler_ir(tf.constant(PROMPTS[1:2]))(stage="optimized_hlo")
    d, f = CFG["hidden_dim"], CFG["intermediate_dim"]
    # qkv, attention output, swiglu's doubled intermediate, output; each [units, input_dim + 1] with its bias column
    shapes = [f"[{3 * d},{d + 1}]", f"[{d},{d + 1}]", f"[{2 * f},{d + 1}]", f"[{d},{f + 1}]"]
    states = _loop_states(hlo)
    assert states
    head_dim = d // CFG["num_heads"]
    for state in states:
        for shape in shapes:
            assert state.count("bf16" + shape) == CFG["num_decoder_layers"], (shape, state)
            assert "f32" + shape not in state, (shape, state)
        caches = [x for x in state if re.fullmatch(rf"(bf16|f32)\[{CFG['num_heads']},[0-9]+,{head_dim}\]", x)]
        assert caches == [caches[0]] * (2 * CFG["num_decoder_layers"]) and caches[0].startswith("f32"), state
        assert not any(x.startswith("bf16[1,2,") for x in state), state  # no stacked bfloat16 cache
    batch = np.asarray(generation.generate_ids(model, np.repeat(PROMPTS[1:2], 2, axis=0), max_new_tokens=6))
    np.testing.assert_array_equal(rows[0], batch[0])


@pytest.mark.parametrize("name", ["causal tied gelu_approximate", "seq2seq untied relu"])
def test_batch_one_generate_under_mixed_bfloat16_equals_the_batch(one_row_model, name):
    """Under mixed_bfloat16 a prompt alone (bfloat16 rows, float32 split caches) decodes the same tokens as in a
    batch (bfloat16 matmuls, stacked caches)."""
    model = one_row_model(name, "mixed_bfloat16")
    inputs = SOURCE if ONE_ROW_MODELS[name]["architecture"] == "seq2seq" else PROMPTS
    with _decodes(model) as used:
        rows = [np.asarray(generation.generate_ids(model, inputs[i : i + 1], max_new_tokens=6))[0]
                for i in range(len(inputs))]
        batch = np.asarray(generation.generate_ids(model, inputs, max_new_tokens=6))
    assert sorted(key[-1] for key in set(used)) == ["halves", "rows"]
    np.testing.assert_array_equal(np.stack(rows), batch)
    assert len({tuple(r) for r in _trim(batch)}) > 1 and len(set(batch.ravel())) > 3  # not one repeated token


@pytest.mark.parametrize("name", list(ONE_ROW_MODELS))
def test_batch_one_generate_takes_the_one_row_form_and_equals_the_batch(one_row_model, name):
    model = one_row_model(name)
    inputs = SOURCE if ONE_ROW_MODELS[name]["architecture"] == "seq2seq" else PROMPTS
    with _decodes(model) as used:
        rows = [np.asarray(generation.generate_ids(model, inputs[i : i + 1], max_new_tokens=6))[0]
                for i in range(len(inputs))]
    assert [key[-1] for key in set(used)] == ["rows"]  # only the one-row function so far
    batch = np.asarray(generation.generate_ids(model, inputs, max_new_tokens=6, jit_compile=False))  # no XLA
    np.testing.assert_array_equal(np.stack(rows), batch)
    assert len({tuple(r) for r in _trim(batch)}) > 1 and len(set(batch.ravel())) > 3  # not one repeated token


# === The prompts' pass outside XLA (`prefill_jit_compile=False`) ===
def _compiled(key):
    """What XLA compiles, in a key of `compiled_functions(model)`: False (nothing), True (the whole function) or
    "loop" (the decode loop; the prompts' pass outside XLA)."""
    return key[3]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3])  # a batch of one on the "rows" plan (split caches), more on "halves"
def test_prefill_outside_xla_gives_the_fused_functions_ids(one_row_model, policy, rows):
    """The prompts' pass in TensorFlow's graph runtime, the loop under XLA: the greedy ids of the function that
    compiles both, which in float32 are those of decoding without a cache. Both functions are kept, under keys
    that differ in the prefill's choice only."""
    model = one_row_model("causal untied swiglu", policy)
    prompts = PROMPTS[:rows]
    with _decodes(model) as keys:  # the fused function's key, the split one's
        fused = np.asarray(generation.generate_ids(model, prompts, 6))
        split = np.asarray(generation.generate_ids(model, prompts, 6, prefill_jit_compile=False))
    np.testing.assert_array_equal(split, fused)
    if policy == "float32":
        assert _trim(split) == _uncached_lm(model, prompts, 6)
    assert len(set(fused.ravel())) > 3  # not one repeated token
    assert [_compiled(k) for k in keys] == [True, "loop"]
    assert keys[0][:3] + keys[0][4:] == keys[1][:3] + keys[1][4:]
    # Cached: a second call runs the kept function again, without a retrace.
    split_fn = compiled_functions(model)[keys[1]]
    before, kept = split_fn.experimental_get_tracing_count(), set(compiled_functions(model))
    with _decodes(model) as used:
        again = np.asarray(generation.generate_ids(model, prompts[:, :3], 6, prefill_jit_compile=False))
    assert split_fn.experimental_get_tracing_count() == before and used == keys[1:]
    assert set(compiled_functions(model)) == kept  # no function made
    np.testing.assert_array_equal(again, generation.generate_ids(model, prompts[:, :3], 6))


def _xla_calls(graph):
    """The calls of XLA-compiled functions in `graph` and in the functions it holds (a `tf.cond`'s branches)."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return [n for n in nodes if n.op in ("StatefulPartitionedCall", "PartitionedCall")
            and "_XlaMustCompile" in n.attr and n.attr["_XlaMustCompile"].b]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "bfloat16"])
def test_prefill_outside_xla_runs_the_prompt_in_the_graph_and_the_loop_under_xla(one_row_model, policy):
    """The split function is a graph function (no XLA) holding the prompts' pass, its projections in the compute
    dtype (oneDNN's bfloat16 matmuls under mixed_bfloat16), and one call of an XLA-compiled loop."""
    model = one_row_model("causal untied swiglu", policy)
    with _decodes(model) as used:
        generation.generate_ids(model, PROMPTS[:1], 6, prefill_jit_compile=False)
    (fn,) = [compiled_functions(model)[key] for key in used]
    concrete = fn.get_concrete_function(tf.TensorSpec([None, None], tf.int32))
    assert len(_xla_calls(concrete.graph)) == 1  # the loop, in the branch that runs decode steps
    ops = concrete.graph.get_operations()
    matmuls = [op.get_attr("T") for op in ops if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3")]
    # qkv, attention output, swiglu's gate and up, down: per layer, at least.
    bfloat16 = sum(dtype == tf.bfloat16 for dtype in matmuls)
    if policy == "float32":
        assert bfloat16 == 0 and len(matmuls) >= 4 * CFG["num_decoder_layers"]
    else:
        assert bfloat16 >= 4 * CFG["num_decoder_layers"]



@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("prompts", ["equal", "ragged"])
def test_prefill_outside_xla_first_token_alone(one_row_model, policy, prompts):
    """One new token for prompts of one length needs no decode step: the graph function takes it from the prompt's
    logits, in the branch that does not call the XLA loop (nor lay its kernels out). Ragged prompts still need
    steps. The ids are the fused function's either way, and those of a longer call start with them."""
    model = one_row_model("causal untied swiglu", policy)
    ids = np.concatenate([PROMPTS[1:2], PROMPTS[1:2, ::-1]]) if prompts == "equal" else PROMPTS  # (2, 5) unpadded
    with _decodes(model) as used:
        fused = np.asarray(generation.generate_ids(model, ids, 1))
        split = np.asarray(generation.generate_ids(model, ids, 1, prefill_jit_compile=False))
    np.testing.assert_array_equal(split, fused)
    if policy == "float32":
        assert _trim(split) == _uncached_lm(model, ids, 1)
    loop_fns = [k for k in set(used) if _compiled(k) == "loop"]
    assert len(loop_fns) == 1
    longer = np.asarray(generation.generate_ids(model, ids, 5, prefill_jit_compile=False))
    np.testing.assert_array_equal(longer[:, :1], split)
    np.testing.assert_array_equal(longer, generation.generate_ids(model, ids, 5))


@pytest.mark.parametrize("beam_size", [None, 2])
def test_prefill_outside_xla_with_ragged_prompts_and_beams(lm, beam_size):
    """The same split for beam search (stacked caches, each row's beams adjacent) and for ragged prompts."""
    fused = np.asarray(generation.generate_ids(lm, PROMPTS, 7, beam_size=beam_size))
    split = np.asarray(generation.generate_ids(lm, PROMPTS, 7, beam_size=beam_size, prefill_jit_compile=False))
    np.testing.assert_array_equal(split, fused)
    if beam_size is None:
        assert _trim(split) == _uncached_lm(lm, PROMPTS, 7)


def test_prefill_jit_compile_arguments(seq2seq, lm):
    with pytest.raises(ValueError, match="prefill_jit_compile.*bool or None"):
        generation.generate_ids(lm, PROMPTS, 3, prefill_jit_compile="no")
    with pytest.raises(ValueError, match="prefill_jit_compile=True.*jit_compile=False"):
        generation.generate_ids(lm, PROMPTS, 3, jit_compile=False, prefill_jit_compile=True)
    with pytest.raises(ValueError, match="causal LMs.*architecture='seq2seq'"):
        generation.generate_ids(seq2seq, SOURCE, 3, prefill_jit_compile=False)
    # Without XLA at all, False is what None means.
    np.testing.assert_array_equal(generation.generate_ids(lm, PROMPTS, 3, jit_compile=False, prefill_jit_compile=False),
                                  generation.generate_ids(lm, PROMPTS, 3, jit_compile=False))


@pytest.mark.parametrize("policy, under_xla", [("float32", True), ("mixed_bfloat16", False), ("bfloat16", False)])
def test_causal_lm_generate_chooses_the_prefill_by_its_dtype_policy(one_row_model, policy, under_xla):
    """`CausalLM.generate` runs the prompts' pass outside XLA under a bfloat16 compute dtype (its
    `prefill_jit_compile_for_policy`), unless told otherwise; without XLA, nothing is compiled."""
    model = one_row_model("causal untied swiglu", policy)
    assert model.prefill_jit_compile_for_policy() is under_xla
    with _decodes(model) as used:
        ids = np.asarray(model.generate(PROMPTS, 6))
        (key,) = used
        assert _compiled(key) == (True if under_xla else "loop")
        np.testing.assert_array_equal(ids, generation.generate_ids(model, PROMPTS, 6, prefill_jit_compile=under_xla))
        np.testing.assert_array_equal(model.generate(PROMPTS, 6, prefill_jit_compile=not under_xla), ids)
        model.generate(PROMPTS, 6, jit_compile=False)
    assert {_compiled(k) for k in used} == {False, True, "loop"}
    assert len(set(used)) == 3


# === Beam search with patience (CTranslate2's search) ===
STUB_VOCAB, STUB_STATES, STUB_END = 8, 16, 5


def _history_table(seed):
    """Log-probabilities `(STUB_STATES, STUB_VOCAB)` of the next token per history state; the end id likely
    enough that hypotheses end within a few steps."""
    logits = np.random.default_rng(seed).normal(scale=1.5, size=(STUB_STATES, STUB_VOCAB))
    logits[:, STUB_END] += 1.0
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype("float32")


def _state(start, tokens):
    """The stub model's state after feeding `start` then `tokens`: it depends on the whole history, so a cache
    that does not follow its beam gives other log-probabilities."""
    state = 0
    for token in (start, *tokens):
        state = (state * 3 + token) % STUB_STATES
    return state


def _stub_next(table):
    table = tf.constant(table)

    def next(ids, cache, index, plan=None):
        state, = cache
        state = (state * 3 + ids[:, 0]) % STUB_STATES  # (B*K,)
        return tf.gather(table, state), None, (state,)

    return next


def _normalized(score, length, length_penalty, normalization):
    if normalization == "gnmt":
        return score / ((5.0 + length) / 6.0) ** length_penalty
    if length == 0:
        return -np.inf if length_penalty else score
    return score / length ** length_penalty


def ctranslate2_beam_search(log_probs_of, vocab, beam, end_id, max_steps, length_penalty, patience,
                            normalization="length"):
    """CTranslate2's `BeamSearch::search` (src/decoding.cc) for one row, in plain Python, on `log_probs_of(tokens)
    -> (vocab,)` log-probabilities after the generated `tokens`: the best `2 * beam` continuations of the live
    beams; those among the first `beam` that end (all of them at the last step) become hypotheses, the first
    `beam` that do not end stay live; stop after `round(beam * patience)` hypotheses (length_penalty 0: once
    the best candidate ends); the best normalized hypothesis wins. Returns `(tokens without the end, ended)`."""
    live = [((), 0.0)]  # only one beam at the first step
    hypotheses = []
    needed = max(1, int(np.floor(beam * patience + 0.5)))
    for step in range(max_steps):
        candidates = []
        for tokens, score in live:
            log_probs = np.asarray(log_probs_of(tokens), np.float64)
            candidates += [(score + float(log_probs[v]), tokens + (v,)) for v in range(vocab)]
        candidates = sorted(candidates, key=lambda c: -c[0])[:2 * beam]
        last = step + 1 == max_steps
        top_finished = False
        for k, (score, tokens) in enumerate(candidates[:beam]):
            if tokens[-1] == end_id or last:
                ended = tokens[-1] == end_id
                kept = tokens[:-1] if ended else tokens
                hypotheses.append((_normalized(score, len(kept), length_penalty, normalization), kept, ended))
                top_finished |= k == 0
        if last or (top_finished if length_penalty == 0 else len(hypotheses) >= needed):
            break
        live = [(tokens, score) for score, tokens in candidates if tokens[-1] != end_id][:beam]
    _, tokens, ended = max(hypotheses, key=lambda h: h[0])
    return list(tokens), ended


def _run_patience(sampler, table, starts, steps, fill=0):
    beams = sampler.beams
    ids = tf.constant(np.repeat(starts, beams)[:, None], tf.int32)  # (B*K, 1)
    return sampler.run(_stub_next(table), tf.fill([len(starts), steps], fill), (tf.zeros([len(starts) * beams],
                       tf.int32),), 0, STUB_END, steps, ids=ids, fill=fill)


@pytest.mark.parametrize("seed, beam, length_penalty, patience, normalization", [
    (0, 3, 1.0, 1.0, "length"), (1, 3, 1.0, 1.0, "length"), (2, 2, 1.0, 2.0, "length"), (3, 3, 0.0, 1.0, "length"),
    (4, 4, 0.6, 1.0, "gnmt"), (5, 3, 2.0, 0.5, "length")])
def test_patience_beam_search_equals_ctranslate2s_loop(seed, beam, length_penalty, patience, normalization):
    """A stub model whose next-token log-probabilities depend on the whole history (through its cache): the
    compiled search gives the tokens of CTranslate2's loop written out in Python, an ended hypothesis followed
    by the end id and `fill`."""
    table, steps, starts = _history_table(seed), 6, np.array([1, 2, 3])
    sampler = generation.BeamSampler(beam, length_penalty, normalization=normalization, patience=patience)
    found = _run_patience(sampler, table, starts, steps, fill=7).numpy()
    for start, row in zip(starts, found.tolist()):
        tokens, ended = ctranslate2_beam_search(lambda tokens, start=start: table[_state(start, tokens)],
                                                STUB_VOCAB, beam, STUB_END, steps, length_penalty, patience,
                                                normalization)
        expected = tokens + ([STUB_END] + [7] * (steps - len(tokens) - 1) if ended else [])
        assert row == expected, (start, row, expected)
    np.testing.assert_array_equal(tf.function(lambda: _run_patience(sampler, table, starts, steps, fill=7),
                                              jit_compile=True)(), found)


def test_patience_keeps_a_finished_hypothesis_that_scores_minus_infinity():
    # The end as the second of the first step's candidates: a hypothesis of length 0, -inf under "length"
    # normalization with a length penalty. Every registered candidate at -inf, argmax took candidate 0, which had
    # not ended, and (round(2 * 0.5) = 1 hypothesis) returned it as the answer.
    table, start = _history_table(0), 1
    table[_state(start, ())] = -5.0
    table[_state(start, ()), [3, STUB_END]] = -0.1, -0.2
    sampler = generation.BeamSampler(2, 1.0, normalization="length", patience=0.5)
    tokens, ended = ctranslate2_beam_search(lambda tokens: table[_state(start, tokens)], STUB_VOCAB, 2, STUB_END, 6,
                                            1.0, 0.5)
    assert (tokens, ended) == ([], True)
    assert _run_patience(sampler, table, np.array([start]), 6, fill=7).numpy().tolist() == [[STUB_END] + [7] * 5]


def test_patience_beam_search_searches():
    """The fixture of the test above is not trivial: some rows end early, some run to the last step, and the
    search finds sequences that greedy decoding and the search keeping ended beams in their slots do not."""
    steps, starts = 6, np.array([1, 2, 3])
    ended, lengths, differs_from_greedy, differs_from_in_slots = set(), set(), False, False
    for seed in range(6):
        table = _history_table(seed)
        patience = _run_patience(generation.BeamSampler(3, 1.0, "length", 1.0), table, starts, steps).numpy()
        greedy = generation.GreedySampler().run(_stub_next(table), tf.zeros([3, steps], tf.int32),
                                                (tf.zeros([3], tf.int32),), 0, STUB_END, steps,
                                                ids=tf.constant(starts[:, None], tf.int32)).numpy()
        in_slots = _run_patience(generation.BeamSampler(3, 1.0, "length"), table, starts, steps).numpy()
        for row in patience.tolist():
            ended.add(STUB_END in row)
            lengths.add(row.index(STUB_END) if STUB_END in row else steps)
        differs_from_greedy |= bool((patience != greedy).any())
        differs_from_in_slots |= bool((patience != in_slots).any())
    assert ended == {True, False} and len(lengths) >= 3 and differs_from_greedy and differs_from_in_slots


def test_patience_beam_of_one_is_greedy(seq2seq, lm):
    table, starts = _history_table(7), np.array([1, 2, 3, 4])
    greedy = generation.GreedySampler().run(_stub_next(table), tf.zeros([4, 6], tf.int32), (tf.zeros([4], tf.int32),),
                                            0, STUB_END, 6, ids=tf.constant(starts[:, None], tf.int32)).numpy()
    np.testing.assert_array_equal(_run_patience(generation.BeamSampler(1, 1.0, "length", 1.0), table, starts, 6),
                                  greedy)
    # Through the text tasks' decodes: a seq2seq source, causal prompts of different lengths (forced columns).
    one = generation.BeamSampler(1, 1.0, normalization="length", patience=1.0)
    for model, ids in ((seq2seq, SOURCE), (lm, PROMPTS)):
        for jit_compile in (False, True):
            np.testing.assert_array_equal(
                generation.generate_ids(model, ids, 6, sampler=one, jit_compile=jit_compile),
                generation.generate_ids(model, ids, 6, jit_compile=jit_compile))


def test_patience_beam_search_through_the_text_decodes(seq2seq, lm):
    """Three beams with patience decode the text tasks, eager loop and XLA alike, ending rows at the end id."""
    sampler = generation.BeamSampler(3, 1.0, normalization="length", patience=1.0)
    for model, ids in ((seq2seq, SOURCE), (lm, PROMPTS)):
        free = np.asarray(generation.generate_ids(model, ids, 6, sampler=sampler, end_id=-1, jit_compile=False))
        assert (free != 0).all()  # no end id: every column generated
        end = int(free[0, 1])
        ended = np.asarray(generation.generate_ids(model, ids, 6, sampler=sampler, end_id=end, jit_compile=False))
        np.testing.assert_array_equal(
            generation.generate_ids(model, ids, 6, sampler=sampler, end_id=end, jit_compile=True), ended)
        assert (ended == end).any()
        for row in ended.tolist():
            if end in row:
                assert all(t == 0 for t in row[row.index(end) + 1:]), (end, row)


def test_beam_sampler_options():
    assert generation.BeamSampler(4, 0.8).key() == ("beam", 4, 0.8)  # the GNMT search keeps its key
    assert generation.BeamSampler(4, 1.0, "length", 1.0).key() == ("beam", 4, 1.0, "length", 1.0)
    assert generation.BeamSampler(4, 1.0, "length").key() != generation.BeamSampler(4, 1.0).key()
    with pytest.raises(ValueError, match=r"`normalization` must be one of \('gnmt', 'length'\). Received: "
                                         r"normalization='average'"):
        generation.BeamSampler(2, normalization="average")
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match=rf"`patience` must be a number > 0 or None. Received: patience={bad!r}"):
            generation.BeamSampler(2, patience=bad)


def test_a_generated_padding_id_ends_the_row_in_generate():
    """Id 0 is padding to the model (SmolLM2's <|endoftext|>): the cached loop went on after it as after any token,
    while `model(...)` masks it and the exported files stop at it. `CausalLM.generate` now ends the row there: up to
    it, an uncached greedy loop over `model(...)`; after it, zeros."""
    model = _spread(models.build_causal_lm(models.TransformerConfig(architecture="causal_lm", **CFG)), seed=1)
    kernel, bias = model.output_projection.get_weights()
    model.output_projection.set_weights([kernel, np.where(np.arange(len(bias)) == 0, 4.0, bias).astype("float32")])
    prompts = np.array([[5, 6, 7], [9, 10, 0]], "int32")
    new = model.generate(prompts, max_new_tokens=8, jit_compile=False).numpy().tolist()
    for prompt, row in zip(prompts.tolist(), new):
        sequence, expected = [t for t in prompt if t], []
        while len(expected) < 8 and (not expected or expected[-1] != 0):
            expected.append(int(np.argmax(model({"token_ids": np.array([sequence], "int32")})[0, -1])))
            sequence.append(expected[-1])
        assert 0 in expected, "the fixture must generate id 0"
        assert row == expected + [0] * (8 - len(expected))
