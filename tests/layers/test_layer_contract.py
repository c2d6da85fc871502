"""What a Keras user expects of every layer, beyond its own numbers: weights drawn independently, arguments of the
wrong shape named where they are given (not a TF op error, not a silent broadcast), and cached decoding equal to the
full pass whatever the block's options."""

import itertools

import keras
import numpy as np
import pytest

from tfformer import layers, models

TINY = dict(vocabulary_size=40, hidden_dim=16, num_heads=2, intermediate_dim=16, num_encoder_layers=1,
            num_decoder_layers=1, dropout=0.0, max_sequence_length=16)


def _mha():
    layer = layers.MultiHeadAttention(num_heads=2, key_dim=4, score="general")
    layer.build((1, 3, 8), (1, 3, 8))
    layer.enable_lora(2)  # four adapters A, each from the same "he_uniform"
    return layer


def _built(layer, *shapes):
    layer.build(*shapes)
    return layer


BUILDERS = {
    "MultiHeadAttention + LoRA": _mha,
    "FeedForward (intermediate_dim = hidden_dim)": lambda: _built(layers.FeedForward(8, 8), (1, 3, 8)),
    "GatedFeedForward": lambda: _built(layers.GatedFeedForward(8, 8), (1, 3, 8)),
    "DecoderBlock": lambda: _built(layers.DecoderBlock(num_heads=2, intermediate_dim=8), (1, 3, 8), (1, 5, 8)),
    # One TruncatedNormal for the token table, the pooler and the classifier, before.
    "TransformerEncoder": lambda: models.build_encoder(models.TransformerConfig(
        architecture="encoder", initializer_range=0.02, num_classes=3, num_segments=2, **TINY)),
    "SequenceRegressor": lambda: models.build_regressor(models.TransformerConfig(
        architecture="regressor", input_dim=16, output_dim=16, **TINY)),
    "Seq2SeqTransformer": lambda: models.build_seq2seq(models.TransformerConfig(architecture="seq2seq", **TINY)),
}


@pytest.mark.parametrize("name", BUILDERS)
def test_no_two_weights_start_from_the_same_draws(name):
    # Keras 3's random initializers repeat their values at every call: one instance for several weights started
    # them equal (a DecoderBlock's self- and cross-attention kernels) or as scaled copies of each other's first
    # values (MultiHeadAttention's output kernel: the first columns of its qkv kernel).
    keras.utils.set_random_seed(0)
    weights = [(w.path, np.asarray(w).ravel()) for w in BUILDERS[name]().weights]
    drawn = [(path, values[:64]) for path, values in weights if values.size >= 16 and np.std(values) > 0]
    assert len(drawn) >= 2, [path for path, _ in weights]
    for (path_a, a), (path_b, b) in itertools.combinations(drawn, 2):
        n = min(len(a), len(b))
        correlation = np.corrcoef(a[:n], b[:n])[0, 1]
        # Independent draws: |r| of 16-64 values about N(0, 1/n); a shared initializer gives 1.
        assert abs(correlation) < 0.8, (path_a, path_b, correlation)


def test_the_seed_still_repeats_a_model():
    def weights():
        keras.utils.set_random_seed(7)
        return [np.asarray(w) for w in BUILDERS["DecoderBlock"]().weights]

    first, second = weights(), weights()
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_callable_initializer_is_taken_as_it_is():
    ones = lambda shape, dtype=None: np.ones(shape, "float32")  # noqa: E731
    layer = _built(layers.GatedFeedForward(8, 8, kernel_initializer=ones), (1, 3, 8))
    assert all(np.all(np.asarray(w) == 1) for w in layer.weights)


x5 = np.zeros((2, 5, 8), "float32")


@pytest.mark.parametrize("call, match", [
    # A (B, S) padding mask as an attention mask broadcast its batch over the heads: here B = N = 2, no error.
    (lambda: layers.MultiHeadAttention(2, 4)(x5, x5, attention_mask=np.ones((2, 5), bool)),
     r"`attention_mask` must be \(B, T, S\) = \(2, 5, 5\).*shape=\(2, 5\)"),
    (lambda: layers.MultiHeadAttention(2, 4)(x5, x5, attention_mask=np.ones((2, 5, 4), bool)),
     r"`attention_mask` must be \(B, T, S\).*shape=\(2, 5, 4\)"),
    (lambda: layers.MultiHeadAttention(2, 4)(x5[0], x5[0]), r"`query` must be a batch of sequences \(B, T, D\)"),
    (lambda: layers.EncoderBlock(2, 8)(x5, padding_mask=np.ones((2, 4), bool)),
     r"`padding_mask` must be \(B, T\) = \(2, 5\).*shape=\(2, 4\)"),
    (lambda: layers.EncoderBlock(2, 8)(x5, padding_mask=np.ones((2, 1), bool)), r"`padding_mask` must be \(B, T\)"),
    (lambda: layers.EncoderBlock(2, 8)(x5, attention_mask=np.ones((2, 5), bool)), r"`attention_mask` must be"),
    (lambda: layers.DecoderBlock(2, 8)(x5, np.zeros((2, 3, 8), "float32"),
                                       encoder_padding_mask=np.ones((2, 5), bool)),
     r"`encoder_padding_mask` must be \(B, S\) = \(2, 3\)"),
    (lambda: layers.DecoderBlock(2, 8)(x5[0], x5), r"`inputs` must be a batch of sequences"),
    (lambda: layers.PositionEmbedding(8)(x5, start_index=-1), r"`start_index` must be >= 0"),
    (lambda: layers.TokenEmbedding(10, 8)(np.zeros((1, 2, 6), "float32"), reverse=True),
     r"`inputs` with reverse=True must be hidden states \(\.\.\., hidden_dim=8\)"),
    (lambda: layers.LayerNorm(epsilon=-1.0), r"`epsilon` must be a non-negative float"),
    (lambda: layers.EncoderBlock(2, 8, layer_norm_epsilon=-1.0), r"`layer_norm_epsilon` must be"),
    (lambda: models.TransformerConfig(layer_norm_epsilon=-1.0, **TINY), r"`layer_norm_epsilon` must be"),
    # Checked when the block is made, not only when its sublayers are, at the first call.
    (lambda: layers.DecoderBlock(2, 8, score="bogus"), r"`score` must be one of"),
    (lambda: layers.EncoderBlock(2, 8, activation="tanh"), r"`activation` must be one of"),
    (lambda: layers.EncoderBlock(2, 8, window=-1), r"`window` must be"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_attention_mask_axes_of_size_one_broadcast():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = layers.MultiHeadAttention(2, 4)
    keys = rng.random((2, 1, 5)) > 0.3
    assert np.allclose(layer(x, x, attention_mask=keys), layer(x, x, attention_mask=np.repeat(keys, 5, axis=1)))


@pytest.mark.parametrize("index, new", [(3, 3), (5, 1), (0, 6)])
def test_a_cache_write_past_its_slots_is_an_error(index, new):
    # Before: the keys past the end were dropped (3 at 3 into 4 slots) or the cache grew (6 at 0 into 4).
    layer = layers.MultiHeadAttention(2, 4)
    x = np.ones((1, new, 8), "float32")
    cache = np.zeros((1, 2, 2, 4, 4), "float32")
    with pytest.raises(ValueError, match=r"new position\(s\) from `cache_index` must fit the cache's 4 slots"):
        layer(x, x, use_causal_mask=True, cache=cache, cache_index=index)


def test_a_cache_write_that_fits_still_runs():
    layer = layers.MultiHeadAttention(2, 4)
    x = np.ones((1, 1, 8), "float32")
    _, cache = layer(x, x, use_causal_mask=True, cache=np.zeros((1, 2, 2, 4, 4), "float32"), cache_index=3)
    assert np.abs(np.asarray(cache)[:, :, :, 3]).sum() > 0


def test_a_decoder_window_restricts_its_self_attention_only():
    # Before, the window applied to the cross-attention too, measured from position 0 at every cached step: query 3
    # saw encoder keys 2-4 only, and cached decoding differed from the full pass by 0.32.
    rng = np.random.default_rng(1)
    x, memory = rng.normal(size=(1, 6, 8)).astype("float32"), rng.normal(size=(1, 6, 8)).astype("float32")
    block = layers.DecoderBlock(2, 16, window=1)
    full, cross_weights = block(x, memory, return_attention_scores=True)
    assert np.all(np.asarray(cross_weights) > 0)  # every encoder key seen by every query
    cache = np.zeros((1, 2, 2, 6, 4), "float32")
    steps = []
    for i in range(6):
        y, cache = block(x[:, i:i + 1], memory, cache=cache, cache_index=i)
        steps.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    # The self-attention window still holds: a key 2 positions back does not reach the output.
    changed = x.copy()
    changed[:, 2] += 1.0
    assert np.allclose(block(changed, memory)[:, 4:], full[:, 4:], atol=1e-6)
    assert not np.allclose(block(changed, memory)[:, 3], full[:, 3], atol=1e-3)
