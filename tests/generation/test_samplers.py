"""The sampler classes alone: each `get_next_token` against numpy, the one loop (`Sampler.run`) and beam search's
(`BeamSampler.run`) driven by stub `next` callbacks in pure TensorFlow, no model."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tfformer import generation, models
from tfformer.generation import plan as plan_lib
from tfformer.generation.beam import BeamSampler
from tfformer.generation.decode import compiled_functions
from tfformer.generation.plan import DecodePlan
from tfformer.generation import samplers
from tfformer.generation.samplers import GreedySampler, Sampler, TemperatureSampler, TopKSampler, TopPSampler

LOGITS = np.random.default_rng(0).normal(scale=2.0, size=(4, 20)).astype("float32")


def _draws(sampler, logits, steps=300):
    """`(steps, B)` ids: one draw per step (the stateless seed's second half)."""
    return np.stack([sampler.get_next_token(logits, step).numpy() for step in range(steps)])


def test_greedy_is_argmax():
    ids = GreedySampler().get_next_token(LOGITS, 0).numpy()
    np.testing.assert_array_equal(ids, LOGITS.argmax(-1))
    assert ids.dtype == np.int32 and len(set(ids)) > 1


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_never_picks_outside_the_top_k(k):
    draws = _draws(TopKSampler(k, temperature=2.0, seed=5), LOGITS)
    top = np.argsort(-LOGITS, axis=-1)[:, :k]  # (B, k)
    for row in range(len(LOGITS)):
        assert set(draws[:, row]) == set(top[row])  # inside the top k, and each of them drawn


def test_top_p_never_picks_outside_the_nucleus():
    p, temperature = 0.7, 1.5
    draws = _draws(TopPSampler(p, temperature=temperature, seed=2), LOGITS)
    scaled = LOGITS / temperature
    for row in range(len(LOGITS)):
        order = np.argsort(-scaled[row])
        probs = np.exp(scaled[row][order] - scaled[row].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs  # the mass of the strictly more likely tokens
        nucleus = set(order[before < p])
        assert 1 < len(nucleus) < LOGITS.shape[1]
        assert set(draws[:, row]) == nucleus


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_draws_follow_softmax_of_logits_over_temperature():
    """8000 draws (rows of one call, and a few steps) against softmax(logits / T): a chi-square below the 0.1%
    critical value (3 degrees of freedom: 16.27); the same counts are far from T = 1's distribution."""
    logits = np.array([2.0, 1.0, 0.5, -1.0], "float32")
    counts = np.zeros(4)
    for step in range(4):
        ids = TemperatureSampler(0.5, seed=11).get_next_token(np.tile(logits, (2000, 1)), step).numpy()
        counts += np.bincount(ids, minlength=4)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    assert _chi_square(counts, softmax(logits / 0.5)) < 16.27
    assert _chi_square(counts, softmax(logits)) > 100.0


def _filtered(logits, kind, k=None, p=None):
    """numpy: the logits a top-k / top-p draw samples from (the others at -1e9)."""
    if kind == "top_k":
        cutoff = np.sort(logits, axis=-1)[:, -k:-k + 1 or None]  # (B, 1) the k-th largest
    elif kind == "top_p":
        ordered = -np.sort(-logits, axis=-1)
        probs = np.exp(ordered - ordered[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, -1) - probs
        cutoff = np.where(before < p, ordered, np.inf).min(-1, keepdims=True)
    else:
        return logits
    return np.where(logits < cutoff, -1e9, logits).astype("float32")


@pytest.mark.parametrize("sampler", [TemperatureSampler(1.3, seed=4), TopKSampler(5, 1.3, seed=4),
                                     TopPSampler(0.6, 1.3, seed=4)], ids=lambda s: s.kind)
def test_draws_are_stateless_categorical_of_seed_and_step(sampler):
    """The seeding contract that makes the same seed repeat the same tokens, as the samplers always drew them: one
    `stateless_categorical` draw of the filtered logits / temperature, seeded `(seed, step)`."""
    logits = _filtered(LOGITS / np.float32(1.3), sampler.kind, sampler.k, sampler.p)
    kept = (logits > -1e9).sum(-1)
    if sampler.kind != "temperature":
        assert 1 < kept.min() and kept.max() < LOGITS.shape[1]  # the filter matters
    for step in (0, 7, 31):
        got = sampler.get_next_token(LOGITS, step).numpy()
        np.testing.assert_array_equal(got, tf.random.stateless_categorical(logits, 1, seed=[4, step])[:, 0].numpy())
        np.testing.assert_array_equal(got, sampler.get_next_token(LOGITS, step).numpy())  # same seed, same ids
    assert not np.array_equal(got, TemperatureSampler(1.3, seed=5).get_next_token(LOGITS, 31).numpy())


def test_samplers_get_and_keys():
    """`samplers.get` (what a task's `generate(sampler=...)` takes), and the keys of compiled decode functions."""
    assert type(samplers.get(None)) is GreedySampler and type(samplers.get("greedy")) is GreedySampler
    sampler = TopKSampler(k=5, temperature=1.5, seed=7)
    assert isinstance(sampler, Sampler) and samplers.get(sampler) is sampler
    assert sampler.key() == ("top_k", 1.5, 5, None, 7)
    assert TopPSampler(p=0.9).key() == ("top_p", 1.0, None, 0.9, 0)
    assert TemperatureSampler(temperature=0.5, seed=1).key() == ("temperature", 0.5, None, None, 1)
    assert GreedySampler().key() == ("greedy", 1.0, None, None, 0)
    assert type(samplers.get("temperature")) is TemperatureSampler
    assert samplers.get("temperature").key() == ("temperature", 1.0, None, None, 0)
    assert BeamSampler(4, 0.8).key() == ("beam", 4, 0.8)
    for name in ("nucleus", "top_k"):  # top-k and top-p have no default `k` or `p`: made by their class only
        with pytest.raises(ValueError, match=rf"`sampler` must be a Sampler .*TopKSampler.*Received: sampler='{name}'"):
            samplers.get(name)
    with pytest.raises(ValueError, match="`k` must be an integer >= 1"):
        TopKSampler(0)
    with pytest.raises(ValueError, match="`p` must be in"):
        TopPSampler(1.5)
    with pytest.raises(ValueError, match="`temperature` must be a number > 0"):
        TemperatureSampler(0.0)
    with pytest.raises(ValueError, match="`beam_size` must be a positive integer"):
        BeamSampler(0)
    with pytest.raises(ValueError, match="`sampler` must be a Sampler"):
        samplers.get(3)
    with pytest.raises(NotImplementedError):
        BeamSampler(2).get_next_token(LOGITS, 0)


VOCAB = 7


def _stub(calls):
    """`next` of a model whose greedy choice after token `t` fed at cache index `i` is `(t + i) % VOCAB`; the cache
    counts the steps of each row. Each call is recorded (the loop runs eagerly)."""

    def next(ids, cache, index, plan=None):
        calls.append((int(index), ids.numpy()[:, 0].tolist()))
        logits = 10.0 * tf.one_hot((ids[:, 0] + index) % VOCAB, VOCAB)  # (B, V)
        return logits, None, tuple(c + 1 for c in cache)

    return next


def _replayed(start, end_id, steps):
    """numpy: the seq2seq-like contract of `_stub` under greedy decoding: tokens, and the `(index, ids)` calls."""
    tokens, done, calls, ids = np.zeros((len(start), steps), "int32"), np.zeros(len(start), bool), [], start
    done_before = done  # what the loop's condition reads: `done` one step late
    for i in range(steps):
        if done_before.all():
            break
        calls.append((i, ids.tolist()))
        ids = np.where(done, 0, (ids + i) % VOCAB)
        done_before = done
        tokens[:, i], done = ids, done | (ids == end_id)
    return tokens, calls


@pytest.mark.parametrize("start", [[1, 2, 4], [2, 4]])
def test_the_loop_calls_next_with_the_last_ids_and_the_cache_index(start):
    """Seq2seq-like: `ids` fed at index 0, 1, ...; step i fills column i; a row stops at `end_id` (later columns
    hold `fill`), the loop one step after every row has (rows from 2 and 4 end at columns 2 and 1; from 1, never):
    its condition reads `done` a step late, so that a step's predicate does not wait for the previous token."""
    calls = []
    start = np.array(start, "int32")
    tokens = GreedySampler().run(_stub(calls), tf.zeros([len(start), 6], tf.int32), (tf.zeros([len(start)]),), 0,
                                 end_id=5, max_new_tokens=6, ids=tf.constant(start[:, None]))
    expected, expected_calls = _replayed(start, 5, 6)
    np.testing.assert_array_equal(tokens.numpy(), expected)
    assert calls == expected_calls
    assert (expected == 5).any(axis=1).tolist() == [s != 1 for s in start]
    assert len(calls) == (6 if 1 in start else 4)  # stopped one step after every row had ended


def test_the_loop_keeps_prompts_and_stops_each_row_after_its_own_new_tokens():
    """Causal-like: prefill `logits` for the first column past the shortest prompt; a row's prompt columns are kept
    (`prompt_lengths`), and each row gets `max_new_tokens` columns after its own prompt, then `fill`."""
    calls = []
    prompts = np.array([[3, 1, 0, 0, 0, 0, 0], [2, 6, 1, 4, 0, 0, 0]], "int32")  # lengths 2, 4; 3 new tokens
    lengths = np.array([2, 4], "int32")
    logits = 10.0 * tf.one_hot([6, 0], VOCAB)  # the prefill's choice for column 2: 6 (row 0); row 1 keeps its 1
    tokens = GreedySampler().run(_stub(calls), tf.constant(prompts), (tf.zeros([2]),), tf.constant(2), end_id=-1,
                                 max_new_tokens=3, logits=logits, prompt_lengths=tf.constant(lengths))
    # Column c > 2 is (column c - 1 + cache index c - 1) % V, unless in the prompt.
    expected = prompts.copy()
    expected[0, 2] = 6
    for c in range(3, 7):
        for row in range(2):
            if c >= lengths[row] + 3:
                expected[row, c] = 0  # past the row's 3 new tokens
            elif c >= lengths[row]:
                expected[row, c] = (expected[row, c - 1] + c - 1) % VOCAB
    np.testing.assert_array_equal(tokens.numpy(), expected)
    assert [i for i, _ in calls] == [2, 3, 4, 5]  # the last column (6) is written, not fed


def test_the_loop_grows_plan_caches_in_segments(monkeypatch):
    """With a plan, the loop runs `DecodePlan.segmented_loop`: `next` sees caches of prefix + 1, 2, 4, 8 slots,
    each step's index inside, and the step's plan."""
    monkeypatch.setattr(plan_lib, "MIN_SEGMENT", 1)
    seen = []

    def next(ids, cache, index, plan=None):
        assert isinstance(plan, DecodePlan)
        seen.append((int(index), int(cache[0].shape[-2])))
        return 10.0 * tf.one_hot((ids[:, 0] + 1) % VOCAB, VOCAB), None, cache

    plan = DecodePlan()
    cache = (tf.zeros([1, 2, 1, 2 + plan.first_segment(8), 4]),)  # (B, 2, K, S, H), a prompt of 2
    tokens = GreedySampler().run(next, tf.constant([[1, 2] + [0] * 8]), cache, tf.constant(2), end_id=-1,
                                 max_new_tokens=8, logits=10.0 * tf.one_hot([3], VOCAB),
                                 prompt_lengths=tf.constant([2]), plan=plan, prefix=2)
    np.testing.assert_array_equal(tokens.numpy(), [[1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    assert [i for i, _ in seen] == list(range(2, 9))
    assert all(i < slots for i, slots in seen)
    assert sorted(set(s for _, s in seen)) == [2 + n for n in (1, 2, 4, 8)]


def _beam_table(seed):
    """Log-probabilities `(V, V)` of the next token after each token: id 0 (the fill) never likely."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=1.5, size=(VOCAB, VOCAB))
    logits[:, 0] = -30.0
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype("float32")


def _best_by_enumeration(table, first, end_id, length, length_penalty):
    best, best_score = None, -np.inf
    for seq in itertools.product(range(1, VOCAB), repeat=length):
        cut = seq[: seq.index(end_id) + 1] if end_id in seq else seq
        prev, score = first, 0.0
        for token in cut:
            score, prev = score + table[prev, token], token
        score /= ((5.0 + len(cut)) / 6.0) ** length_penalty
        if score > best_score + 1e-6:
            best, best_score = cut, score
    return best


@pytest.mark.parametrize("seed, length_penalty, ends", [(6, 0.6, True), (10, 0.6, False), (0, 2.0, False),
                                                         (5, 0.0, True)])
def test_beam_search_stops_a_beam_at_end_id_and_finds_the_penalized_best(seed, length_penalty, ends):
    """A stub model (fixed next-token log-probabilities after each token): beam search as wide as the search
    space is exact, so it must find the best sequence by enumeration under the GNMT penalty (here one other than
    without it), a beam that ended at `end_id` followed by `fill` only."""
    table, end_id, length = tf.constant(_beam_table(seed)), 3, 3
    beams = (VOCAB - 1) ** length  # room for every sequence

    def next(ids, cache, index, plan=None):
        steps, = cache
        return tf.gather(table, ids[:, 0]), None, (steps + 1,)

    found = BeamSampler(beams, length_penalty).run(next, tf.zeros([1, length], tf.int32), (tf.zeros([beams]),), 0,
                                                   end_id, length, ids=tf.fill([beams, 1], 1)).numpy()[0].tolist()
    best = _best_by_enumeration(table.numpy(), 1, end_id, length, length_penalty)
    assert (end_id in best) == ends and (length_penalty == 0 or best != _best_by_enumeration(
        table.numpy(), 1, end_id, length, 0.0))
    assert found[: len(best)] == list(best) and found[len(best):] == [0] * (length - len(best))


def test_beam_search_ends_beams_early():
    """End id made likely after the first token: the best sequence ends at column 1, later columns are fill."""
    table = _beam_table(3)
    table[1] = np.log(np.full(VOCAB, 1e-6))
    table[1, 4] = 0.0  # after 1: 4
    table[4] = np.log(np.full(VOCAB, 1e-6))
    table[4, 5] = 0.0  # after 4: the end, 5
    found = BeamSampler(3, 0.6).run(
        lambda ids, cache, index, plan=None: (tf.gather(tf.constant(table), ids[:, 0]), None, cache),
        tf.zeros([2, 5], tf.int32), (tf.zeros([6]),), 0, 5, 5, ids=tf.fill([6, 1], 1)).numpy()
    np.testing.assert_array_equal(found, [[4, 5, 0, 0, 0]] * 2)
    free = BeamSampler(3, 0.6).run(
        lambda ids, cache, index, plan=None: (tf.gather(tf.constant(table), ids[:, 0]), None, cache),
        tf.zeros([2, 5], tf.int32), (tf.zeros([6]),), 0, -1, 5, ids=tf.fill([6, 1], 1)).numpy()
    assert (free[:, :2] == [4, 5]).all() and (free != 0).all()  # end_id=-1: no end, every column generated


@pytest.fixture(scope="module")
def lm():
    from tests.harness import spread

    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=24, hidden_dim=16, num_heads=2,
                                      intermediate_dim=32, num_decoder_layers=1, dropout=0.0, max_sequence_length=32)
    return spread(models.build_causal_lm(config), seed=1)


def test_generate_takes_a_beam_sampler_and_reset_compiled_drops_the_functions(lm):
    prompts = np.array([[5, 6, 7, 0], [9, 10, 11, 12]], "int32")
    by_size = generation.generate_ids(lm, prompts, 5, beam_size=2, jit_compile=False).numpy()
    by_sampler = generation.generate_ids(lm, prompts, 5, sampler=BeamSampler(2), jit_compile=False).numpy()
    np.testing.assert_array_equal(by_sampler, by_size)
    assert list(compiled_functions(lm)) == [("causal_lm", 5, ("beam", 2, 0.6), False, 3, False, False, False, 4, None)]
    function = compiled_functions(lm)[list(compiled_functions(lm))[0]]
    generation.reset_compiled(lm)
    assert compiled_functions(lm) == {}
    np.testing.assert_array_equal(generation.generate_ids(lm, prompts, 5, beam_size=2, jit_compile=False), by_size)
    assert list(compiled_functions(lm).values())[0] is not function
    generation.reset_compiled(lm)  # nothing kept: no error
    generation.reset_compiled(lm)


def test_speech_decoding_takes_beam_search():
    from tfformer.models import whisper_decode as speech

    config = models.TransformerConfig(
        architecture="speech_seq2seq", vocabulary_size=50, hidden_dim=16, num_heads=2, intermediate_dim=32,
        num_encoder_layers=1, num_decoder_layers=1, dropout=0.0, max_sequence_length=16, position="learned",
        num_mel_bins=8, max_source_positions=10)
    whisper = models.build_whisper(config)
    features = np.random.default_rng(0).normal(size=(2, 20, 8)).astype("float32")
    options = dict(prompt=(1,), end_id=49)
    beams = speech.transcribe_ids(whisper, features, 4, sampler=BeamSampler(2), **options)
    assert beams.shape == (2, 4) and beams.dtype == np.int32
    assert ((beams >= 0) & (beams < 50)).all()
    # One beam is greedy search (the beam loop's own bookkeeping, checked against the sampler loop).
    np.testing.assert_array_equal(speech.transcribe_ids(whisper, features, 4, sampler=BeamSampler(1), **options),
                                  speech.transcribe_ids(whisper, features, 4, **options))
