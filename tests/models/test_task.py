"""Tasks: strings in and out through the preprocessor, the backbone, and the preset directory round trip."""

import json
import os
import textwrap

import keras
import numpy as np
import pytest

from tests.harness import run_in_fresh_interpreter
from tfformer import data, models, training

CODE = ["def foo(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20
PAIRS = [("File not found", "Datei nicht gefunden"), ("Open file", "Datei öffnen"), ("Save %s", "%s speichern"),
         ("Quit", "Beenden"), ("Cannot open %s: %s\n", "Kann %s nicht öffnen: %s\n")] * 8
TINY = dict(hidden_dim=32, num_heads=2, intermediate_dim=64, max_sequence_length=64, dropout=0.0)


@pytest.fixture(scope="module")
def code_tokenizer():
    return data.SubwordTokenizer.train(CODE, vocabulary_size=64)


@pytest.fixture(scope="module")
def pair_tokenizer():
    return data.SubwordTokenizer.train([t for pair in PAIRS for t in pair], vocabulary_size=96)


def _trained_lm(tokenizer, steps=3):
    keras.utils.set_random_seed(1)
    lm = models.from_preset("gpt-mini", vocabulary_size=tokenizer.vocabulary_size, num_decoder_layers=2, **TINY)
    lm.preprocessor = tokenizer
    lm.compile(optimizer="adam", loss=training.MaskedSparseCrossEntropy())
    dataset = data.make_lm_dataset(CODE, tokenizer, sequence_length=16, batch_size=4).take(steps)
    lm.fit(dataset, verbose=0)
    return lm


def test_causal_lm_generates_from_strings_as_from_ids(code_tokenizer):
    lm = _trained_lm(code_tokenizer)
    prompts = ["def ", "import os"]
    texts = lm.generate(prompts, max_new_tokens=10)
    ids = lm.generate(lm.tokenize(prompts), max_new_tokens=10)  # the same decoding, ids in and out
    assert isinstance(texts, list) and len(texts) == 2
    expected = [code_tokenizer.detokenize([list(row[:list(row).index(data.END_ID)] if data.END_ID in row else row)])
                .numpy()[0].decode() for row in np.asarray(ids)]
    assert texts == expected
    assert lm.generate("def ", max_new_tokens=10) == texts[0]  # a str in, a str out


def test_backbone_is_the_hidden_states_before_the_tied_projection(code_tokenizer):
    lm = _trained_lm(code_tokenizer, steps=1)
    ids = lm.tokenize(["def foo", "import"])
    hidden = np.asarray(lm.backbone({"token_ids": ids}))  # (B, T, D)
    logits = np.asarray(lm({"token_ids": ids}))  # (B, T, V)
    embeddings = np.asarray(lm.token_embedding.embeddings)  # (V, D)
    np.testing.assert_allclose(hidden @ embeddings.T, logits, atol=1e-5)
    assert {w.path for w in lm.backbone.weights} == {w.path for w in lm.weights}  # tied: no head weights


def test_preset_round_trip_in_a_fresh_process(code_tokenizer, tmp_path):
    lm = _trained_lm(code_tokenizer)
    before = lm.generate(["def ", "class A"], max_new_tokens=12)
    before_logits = np.asarray(lm({"token_ids": lm.tokenize(["def foo(x)"])}))
    lm.save_to_preset(str(tmp_path))
    assert json.loads((tmp_path / "preset.json").read_text())["task"] == "CausalLM"
    np.save(tmp_path / "logits.npy", before_logits)
    out = run_in_fresh_interpreter(textwrap.dedent(f"""
        import json, numpy as np
        from tfformer import models
        lm = models.from_preset({str(tmp_path)!r})
        logits = np.asarray(lm({{"token_ids": lm.tokenize(["def foo(x)"])}}))
        assert np.array_equal(logits, np.load({str(tmp_path / "logits.npy")!r})), "logits changed"
        print(json.dumps(lm.generate(["def ", "class A"], max_new_tokens=12)))
    """))
    assert out == before


def test_translator_generates_and_round_trips(pair_tokenizer, tmp_path):
    keras.utils.set_random_seed(2)
    translator = models.from_preset("transformer-tiny", vocabulary_size=pair_tokenizer.vocabulary_size,
                                    num_encoder_layers=1, num_decoder_layers=1, **TINY)
    translator.preprocessor = pair_tokenizer
    sources = ["File not found", "Cannot open %s: %s\n"]
    outputs = translator.translate(sources, max_new_tokens=8, jit_compile=False)
    assert outputs == translator.generate(sources, max_new_tokens=8, jit_compile=False)
    # Protected placeholders come back whatever the untrained model writes: both %s and the trailing newline.
    assert outputs[1].count("%s") == 2 and outputs[1].endswith("\n")
    unprotected = translator.generate(sources[:1], max_new_tokens=8, protect_placeholders=False, jit_compile=False)
    ids = translator.generate(translator.tokenize(sources[:1]), max_new_tokens=8, jit_compile=False)
    assert unprotected == translator.detokenize(ids)
    translator.save_to_preset(str(tmp_path))
    reloaded = models.from_preset(str(tmp_path))
    assert isinstance(reloaded, models.Seq2SeqTransformer)
    assert reloaded.translate(sources, max_new_tokens=8, jit_compile=False) == outputs


def test_classifier_predicts_from_strings(code_tokenizer):
    classifier = models.from_preset("bert-mini", vocabulary_size=code_tokenizer.vocabulary_size, num_classes=3,
                                     num_encoder_layers=1, **TINY)
    classifier.preprocessor = code_tokenizer
    texts = ["def foo", "import os", "class"]
    ids = code_tokenizer.tokenize(texts).to_tensor().numpy()
    expected = classifier.predict({"token_ids": ids, "segment_ids": np.zeros_like(ids)}, verbose=0)["logits"]
    np.testing.assert_array_equal(classifier.predict(texts, verbose=0)["logits"], expected)
    assert classifier.backbone.output.shape[-1] == 32


def test_byte_pair_tokenizer_round_trips_through_its_preset_file(tmp_path):
    vocabulary = [*"abcdefghijklmnopqrstuvwxyz", "Ġ", "ab", "abc", "<|end|>", "<|user|>"]
    tokenizer = data.BytePairTokenizer(vocabulary, ["a b", "ab c"], special_tokens=["<|end|>", "<|user|>"],
                                       chat_template="{% for m in messages %}<|user|>{{ m.content }}{% endfor %}",
                                       end_tokens=["<|end|>"])
    spec = data.assets.save_tokenizer(tokenizer, str(tmp_path))
    reloaded = data.assets.load_tokenizer(str(tmp_path), json.loads(json.dumps(spec)))
    text = ["abc<|user|>cab<|end|>"]
    np.testing.assert_array_equal(reloaded.tokenize(text).to_tensor(), tokenizer.tokenize(text).to_tensor())
    assert reloaded.end_ids == [29] and reloaded.chat_template == tokenizer.chat_template


def test_sentence_encoder_round_trips(tmp_path):
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "a", "dog"]
    encoder = models.from_preset("bert-mini", vocabulary_size=len(vocabulary), num_encoder_layers=1, **TINY)
    model = models.SentenceEncoder(encoder, tokenizer=data.BertTokenizer(vocabulary, max_length=16))
    model.save_to_preset(str(tmp_path))
    assert json.loads((tmp_path / "preset.json").read_text())["tokenizer"] is None  # in the .keras config
    reloaded = models.from_preset(str(tmp_path))
    np.testing.assert_array_equal(reloaded.encode(["the cat sat", "a dog"]), model.encode(["the cat sat", "a dog"]))
    assert reloaded.backbone.output.shape[-1] == 32


def test_a_legacy_run_directory_loads(code_tokenizer, tmp_path):
    lm = _trained_lm(code_tokenizer, steps=1)
    lm.save(str(tmp_path / "model.keras"))
    code_tokenizer.save(str(tmp_path / "tokenizer.model"))
    reloaded = models.from_preset(str(tmp_path))
    assert reloaded.generate("def ", max_new_tokens=6) == lm.generate("def ", max_new_tokens=6)


def test_bad_input_is_named(code_tokenizer, tmp_path):
    lm = models.from_preset("gpt-mini", vocabulary_size=code_tokenizer.vocabulary_size, num_decoder_layers=1, **TINY)
    with pytest.raises(ValueError, match="no preprocessor"):
        lm.generate("def ")
    lm.preprocessor = code_tokenizer
    with pytest.raises(ValueError, match="`inputs` holds an empty"):
        lm.generate(["def ", "  "])
    with pytest.raises(ValueError, match="`inputs` is empty"):
        lm.generate([])
    with pytest.raises(ValueError, match="`inputs` must hold str"):
        lm.generate(["def ", 3])
    with pytest.raises(ValueError, match="chat template"):
        lm.chat([{"role": "user", "content": "hi"}])
    lm.save_to_preset(str(tmp_path))
    with pytest.raises(ValueError, match="already holds a preset"):
        lm.save_to_preset(str(tmp_path))
    lm.save_to_preset(str(tmp_path), overwrite=True)
    with pytest.raises(ValueError, match="takes no overrides"):
        models.from_preset(str(tmp_path), dropout=0.1)
    with pytest.raises(ValueError, match="not a preset directory"):
        models.from_preset(str(tmp_path / "missing"))
    (tmp_path / "preset.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a tfformer preset"):
        models.from_preset(str(tmp_path))
    os.remove(tmp_path / "preset.json")
    os.remove(tmp_path / "tokenizer.model")
    with pytest.raises(ValueError, match="holds no preset"):
        models.from_preset(str(tmp_path))


@pytest.mark.parametrize("messages", ["hi", [], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]])
def test_malformed_chat_messages_are_named(messages):
    from tfformer.checks import check_messages

    with pytest.raises(ValueError, match="messages"):
        check_messages(messages)

