"""The in-graph BERT tokenizer against Hugging Face's `tokenizers` (a keras-hub dependency) on random text."""

import os

import numpy as np
import pytest
import tensorflow as tf
from tokenizers import Tokenizer

from tfformer.convert import BertTokenizer, pretrained

# Code points of everyday text in many scripts, plus the characters BERT's
# normaliser treats specially (controls, zero-widths, odd spaces, U+FFFD).
ALPHABET = [chr(c) for lo, hi in [
    (0x20, 0x7E), (0xA0, 0x17F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x5D0, 0x5EA), (0x621, 0x64A),
    (0x900, 0x97F), (0xE01, 0xE3A), (0x1E00, 0x1EFF), (0x2010, 0x2027), (0x2030, 0x205E), (0x20A0, 0x20B9),
    (0x2100, 0x218B), (0x2190, 0x21FF), (0x2200, 0x22FF), (0x3000, 0x303F), (0x3041, 0x3096), (0x30A1, 0x30FA),
    (0x4E00, 0x4F00), (0xAC00, 0xAC50), (0xFB00, 0xFB06), (0xFF01, 0xFF5E), (0x1F300, 0x1F64F),
] for c in range(lo, hi + 1)]
ALPHABET += list("\x00\x07\x1b\x7f\x85\xad\t\n\r\u200b\u200c\u200d\u200e\u2028\u2029\ufeff\ufffd\ufe0f\ue000\u1680")
SPECIAL = ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[cls]", "[unused1]"]


@pytest.fixture(scope="module")
def model_dir():
    return pretrained.all_minilm_l6_v2_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return BertTokenizer.from_vocabulary(os.path.join(model_dir, "vocab.txt"), lower_case=True, max_length=256)


@pytest.fixture(scope="module")
def huggingface(model_dir):
    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    hf.no_padding()
    hf.enable_truncation(256)
    return hf


def _random_texts(rng, count):
    texts = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.integers(0, 40)):
            r = rng.random()
            if r < 0.5:
                pieces.append(ALPHABET[rng.integers(len(ALPHABET))])
            elif r < 0.8:
                pieces.append(" " if r < 0.65 else "abcdefghij"[rng.integers(10)])
            elif r < 0.97:
                words = ["hello", "World", "naïve", "Straße", "ΣΟΦΟΣ", "東京", "don't", "x2"]
                pieces.append(words[rng.integers(len(words))])
            else:
                pieces.append(SPECIAL[rng.integers(len(SPECIAL))])
        texts.append("".join(pieces))
    texts.append("a" * 101 + " " + "é" * 100 + " " + "b" * 99)  # words over 100 characters become [UNK]
    return texts


def test_matches_huggingface_on_random_text(tokenizer, huggingface, rng):
    texts = _random_texts(rng, 1500)
    tokens = tokenizer(texts)
    ids, mask = tokens["token_ids"].numpy(), tokens["padding_mask"].numpy()
    mismatches = [t for t, row, m in zip(texts, ids, mask) if row[m == 1].tolist() != huggingface.encode(t).ids]
    assert not mismatches, mismatches[:5]


def test_truncates_pads_and_marks(tokenizer):
    tokens = tokenizer(["word " * 300, "a", ""])
    ids, mask = tokens["token_ids"].numpy(), tokens["padding_mask"].numpy()
    assert ids.shape == (3, 256) and ids.dtype == np.int32 and mask.dtype == np.int32
    assert ids[0, 0] == tokenizer.cls_id and ids[0, -1] == tokenizer.sep_id
    assert mask.sum(axis=1).tolist() == [256, 3, 2]
    assert ids[2, :2].tolist() == [tokenizer.cls_id, tokenizer.sep_id] and not ids[2, 2:].any()


def test_tensor_input_and_graph_mode(tokenizer):
    texts = ["Hello, world!", "東京タワー"]
    eager = tokenizer(texts)["token_ids"].numpy()
    np.testing.assert_array_equal(tokenizer(tf.constant(texts))["token_ids"], eager)
    graph = tf.function(lambda x: tokenizer(x)["token_ids"])(tf.constant(texts))
    np.testing.assert_array_equal(graph, eager)
    assert eager[0].tolist() == [101, 7592, 1010, 2088, 999, 102, 0]  # padded to the second text


def test_config_round_trip(tokenizer):
    clone = BertTokenizer.from_config(tokenizer.get_config())
    assert clone.get_config() == tokenizer.get_config()
    texts = ["Café au lait, s'il vous plaît."]
    np.testing.assert_array_equal(clone(texts)["token_ids"], tokenizer(texts)["token_ids"])


def test_cased_tokenizer_keeps_case_and_accents():
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "Café", "café", "cafe", "!"]
    ids = BertTokenizer(vocabulary, lower_case=False)(["Café!"])["token_ids"].numpy()
    assert ids.tolist() == [[2, 4, 7, 3]]
    ids = BertTokenizer(vocabulary, lower_case=True)(["Café!"])["token_ids"].numpy()
    assert ids.tolist() == [[2, 6, 7, 3]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocabulary=["[UNK]", "[PAD]", "[CLS]", "[SEP]"]), r"'\[PAD\]' at id 0.*'\[UNK\]'"),
        (dict(vocabulary=["[PAD]", "[UNK]", "[SEP]"]), r"must contain '\[CLS\]'"),
        (dict(vocabulary=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], max_length=1), r"max_length.*>= 2.*max_length=1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BertTokenizer(**kwargs)


def test_bad_inputs(tokenizer):
    with pytest.raises(ValueError, match="single string; wrap it in a list"):
        tokenizer("hello")
    with pytest.raises(ValueError, match="list of strings"):
        tokenizer([1, 2])
    with pytest.raises(ValueError, match="1-D tf.string tensor.*int32"):
        tokenizer(tf.constant([1, 2]))
