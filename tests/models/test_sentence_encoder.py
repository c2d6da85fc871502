"""SentenceEncoder on a tiny random encoder: pooling, normalisation, batching, .keras round trip."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from tfformer import convert, models

VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog", "##s", "."]


def _encoder():
    config = models.TransformerConfig(
        architecture="encoder", vocabulary_size=len(VOCABULARY), hidden_dim=16, num_heads=2, intermediate_dim=32,
        num_encoder_layers=2, num_decoder_layers=0, dropout=0.0, max_sequence_length=32, activation="gelu",
        position="learned", scale_embeddings=False, num_segments=2,
    )
    return models.build_encoder(config)


def _model(normalize=True):
    tokenizer = convert.BertTokenizer(VOCABULARY, max_length=16)
    return models.SentenceEncoder(_encoder(), tokenizer=tokenizer, normalize=normalize)


TEXTS = ["The cat sat on the mat.", "a dog", "Dogs!", "the the the the the the the the the the the the the the"]


def test_mean_pooling_over_real_tokens():
    model = _model(normalize=False)
    tokens = model.tokenize(TEXTS)
    sequence = np.asarray(model.encoder({"token_ids": tokens["token_ids"],
                                         "segment_ids": np.zeros_like(tokens["token_ids"])})["sequence_output"])
    mask = tokens["padding_mask"][..., None]
    expected = (sequence * mask).sum(1) / mask.sum(1)
    np.testing.assert_allclose(model.encode(TEXTS), expected, atol=1e-5)


def test_vectors_are_unit_length_and_independent_of_the_batch():
    model = _model()
    together = model.encode(TEXTS, batch_size=3)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
    alone = np.concatenate([model.encode([text]) for text in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    assert model.encode([]).shape == (0, 16)


def test_encode_runs_one_compiled_function_for_every_shape():
    model = _model()
    texts = TEXTS + ["the cat", "a dog sat on the mat .", "cats", "the dog sat", "a mat on a cat on a dog on a mat"]
    vectors = model.encode(texts, batch_size=2)  # batches of 2 or 1 rows, 3 to 16 tokens
    tokens = model.tokenize(texts)
    np.testing.assert_allclose(vectors, model(tokens, training=False), atol=1e-5)  # one eager call, padded
    traces = model._inference_function().experimental_get_tracing_count()
    assert traces <= 3  # the first shape, then the length left open, then the batch too (the last, shorter batch)
    model.encode(["the"] + texts + ["the cat sat on the mat on the mat on the mat"], batch_size=3)  # new shapes
    assert model._inference_function().experimental_get_tracing_count() == traces


def test_encode_under_a_mirrored_strategy_gives_one_vector_per_text():
    # A model built in a 2-replica strategy's scope (what `training.get_strategy(2)` gives on a CPU): Keras'
    # predict_on_batch would run the whole batch on each replica and return it twice.
    script = textwrap.dedent(f"""
        import numpy as np
        from tfformer import convert, models, training
        strategy = training.get_strategy(2)
        assert strategy.num_replicas_in_sync == 2
        with strategy.scope():
            config = models.TransformerConfig(
                architecture="encoder", vocabulary_size={len(VOCABULARY)}, hidden_dim=16, num_heads=2,
                intermediate_dim=32, num_encoder_layers=1, num_decoder_layers=0, dropout=0.0,
                max_sequence_length=32, position="learned", scale_embeddings=False)
            model = models.SentenceEncoder(models.build_encoder(config),
                                           tokenizer=convert.BertTokenizer({VOCABULARY!r}, max_length=16))
        texts = {TEXTS!r}
        vectors = model.encode(texts, batch_size=3)
        assert vectors.shape == (len(texts), 16), vectors.shape
        np.testing.assert_allclose(vectors, model(model.tokenize(texts), training=False), atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_save_load_round_trip(tmp_path):
    model = _model()
    path = tmp_path / "sentence_encoder.keras"
    model.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    assert isinstance(reloaded, models.SentenceEncoder) and reloaded.normalize
    assert reloaded.tokenizer.get_config() == model.tokenizer.get_config()
    np.testing.assert_array_equal(reloaded.encode(TEXTS), model.encode(TEXTS))
    tokens = model.tokenize(TEXTS)
    np.testing.assert_array_equal(reloaded(tokens), model(tokens))


def test_without_tokenizer_it_runs_on_ids_only(tmp_path):
    model = models.SentenceEncoder(_encoder())
    ids = np.array([[2, 6, 7, 3, 0]], "int32")
    assert model({"token_ids": ids, "padding_mask": (ids != 0).astype("int32")}).shape == (1, 16)
    with pytest.raises(ValueError, match="no tokenizer"):
        model.encode(["the cat"])
    model.save(tmp_path / "no_tokenizer.keras")
    assert keras.models.load_model(tmp_path / "no_tokenizer.keras", safe_mode=True).tokenizer is None


def test_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size.*positive integer.*batch_size=0"):
        _model().encode(TEXTS, batch_size=0)


def test_cosine_similarity():
    a = np.array([[3.0, 4.0], [1.0, 0.0]])
    np.testing.assert_allclose(models.cosine_similarity(a), [[1.0, 0.6], [0.6, 1.0]], atol=1e-6)
    assert models.cosine_similarity(a, a[:1]).shape == (2, 1)
