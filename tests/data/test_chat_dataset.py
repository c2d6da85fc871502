"""Fine-tuning data: chat TSV files rendered with the chat template, the loss on the answers only; text files."""

import numpy as np
import pytest

from tfformer import data
from tfformer.data.byte_pair import BytePairTokenizer, bytes_to_unicode

# SmolLM2's template (the GGUF's), with a short default system turn.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PAIRS = [("What is 2+2?", "4"), ("Capital of France?", "Paris."), ("Say hi\tand\nbye", "hi\nbye")]


# One merge, of two bytes UTF-8 never uses (a merge table cannot be empty): text is one token per byte.
MERGES = ["ÿ þ"]


def chat_tokenizer():
    """Byte-level BPE, one token per byte (ids 0-255), plus <|im_start|> (256) and <|im_end|> (257, the end of
    turn) and the unused merge (258)."""
    byte_chars = bytes_to_unicode()
    vocabulary = [byte_chars[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>", "ÿþ"]
    return BytePairTokenizer(vocabulary, MERGES, ["<|im_start|>", "<|im_end|>"], chat_template=TEMPLATE,
                             end_tokens=["<|im_end|>"])


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def _decode(tokenizer, ids):
    return tokenizer.detokenize(np.asarray(ids, np.int32)).numpy().decode("utf-8")


def _examples(dataset):
    return [(x["token_ids"], y, w) for x, y, w in dataset.unbatch().as_numpy_iterator()]


def _write(tmp_path, text, name="chat.tsv"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_weights_cover_exactly_the_answer_and_its_end_of_turn(tokenizer):
    dataset = data.make_chat_dataset(PAIRS, tokenizer, sequence_length=64, batch_size=2, shuffle=False)
    x, y, w = next(iter(dataset))
    assert x["token_ids"].shape == y.shape == w.shape == (2, 64)
    assert (x["token_ids"].dtype, y.dtype, w.dtype) == ("int32", "int32", "float32")
    examples = _examples(dataset)
    assert len(examples) == 3
    for (prompt, answer), (token_ids, labels, weights) in zip(PAIRS, examples):
        assert set(np.unique(weights)) <= {0.0, 1.0}
        # The weighted labels are the answer's tokens and the end of turn, nothing else.
        assert _decode(tokenizer, labels[weights == 1]) == answer + "<|im_end|>"
        assert not labels[weights == 0].any()  # 0 (the ignored padding id) wherever the weight is 0
        # The inputs are the rendered conversation through its end of turn, then padding.
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) + answer + "<|im_end|>"
        length = int((token_ids != 0).sum())
        assert _decode(tokenizer, token_ids[:length]) == rendered and not token_ids[length:].any()
        # Each weighted label is the next input token (teacher forcing), the last one the end of turn.
        positions = np.flatnonzero(weights)
        np.testing.assert_array_equal(labels[positions[:-1]], token_ids[positions[:-1] + 1])
        assert labels[positions[-1]] == 257 and positions[-1] == length - 2  # the last answer token's
        # The prompt is tokenized alone, as `chat` sees it: the first weighted label follows the turn opener.
        prompt_ids = tokenizer.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        assert positions[0] == len(prompt_ids.numpy()) - 1


def test_a_tsv_file_with_escapes_and_blank_lines(tokenizer, tmp_path):
    path = _write(tmp_path, "What is 2+2?\t4\n\nCapital of France?\tParis.\r\nSay hi\\tand\\nbye\thi\\nbye\n")
    assert data.read_chat_tsv(path) == PAIRS
    from_file = _examples(data.make_chat_dataset(path, tokenizer, sequence_length=64, shuffle=False))
    from_pairs = _examples(data.make_chat_dataset(PAIRS, tokenizer, sequence_length=64, shuffle=False))
    for a, b in zip(from_file, from_pairs):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)


def test_system_prompt_and_shuffle(tokenizer):
    dataset = data.make_chat_dataset(PAIRS[:1], tokenizer, sequence_length=64, system_prompt="Be kind.")
    token_ids, labels, weights = _examples(dataset)[0]
    text = _decode(tokenizer, token_ids[token_ids != 0])
    assert text.startswith("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nWhat is 2+2?")
    assert _decode(tokenizer, labels[weights == 1]) == "4<|im_end|>"
    rows = lambda dataset: sorted(e[0].tobytes() for e in _examples(dataset))  # noqa: E731
    shuffled = data.make_chat_dataset(PAIRS, tokenizer, sequence_length=64, batch_size=1, seed=3)
    assert rows(shuffled) == rows(data.make_chat_dataset(PAIRS, tokenizer, sequence_length=64, shuffle=False))


def test_long_examples_are_cut_with_a_warning(tokenizer):
    pairs = [("Q?", "a" * 80)]
    with pytest.warns(UserWarning, match="1 of 1 chat examples are longer"):
        dataset = data.make_chat_dataset(pairs, tokenizer, sequence_length=48, shuffle=False)
    token_ids, labels, weights = _examples(dataset)[0]
    assert token_ids.shape == (48,) and token_ids.all()  # no padding left
    assert _decode(tokenizer, labels[weights == 1]) == "a" * int(weights.sum())
    with pytest.raises(ValueError, match=r"`pairs\[0\]`: the prompt alone is \d+ tokens"):
        data.make_chat_dataset([("x" * 60, "y")], tokenizer, sequence_length=48)


def test_bad_files_name_the_file_and_the_line(tokenizer, tmp_path):
    no_tab = _write(tmp_path, "What is 2+2?\t4\nno tab here\n", "no_tab.tsv")
    with pytest.raises(ValueError, match=r"no_tab\.tsv:2: expected 'prompt<TAB>answer', found no tab"):
        data.make_chat_dataset(no_tab, tokenizer)
    empty = _write(tmp_path, "", "empty.tsv")
    with pytest.raises(ValueError, match=r"empty\.tsv.*holds no prompt<TAB>answer lines"):
        data.read_chat_tsv(empty)
    blank = _write(tmp_path, "\n  \n", "blank.tsv")
    with pytest.raises(ValueError, match=r"blank\.tsv.*holds no prompt<TAB>answer lines"):
        data.read_chat_tsv(blank)
    no_answer = _write(tmp_path, "a\tb\nquestion\t \n", "no_answer.tsv")
    with pytest.raises(ValueError, match=r"no_answer\.tsv:2: the answer is empty"):
        data.read_chat_tsv(no_answer)
    with pytest.raises(ValueError, match=r"missing\.tsv.*does not exist"):
        data.make_chat_dataset(str(tmp_path / "missing.tsv"), tokenizer)


def test_bad_arguments_name_themselves(tokenizer):
    with pytest.raises(ValueError, match="`pairs` is empty"):
        data.make_chat_dataset([], tokenizer)
    with pytest.raises(ValueError, match=r"`pairs\[1\]`: expected a \(prompt, answer\) pair"):
        data.make_chat_dataset([("a", "b"), ("c",)], tokenizer)
    with pytest.raises(ValueError, match="`sequence_length` must be a positive integer"):
        data.make_chat_dataset(PAIRS, tokenizer, sequence_length=0)
    plain = BytePairTokenizer(list(chat_tokenizer().vocabulary), MERGES)
    with pytest.raises(ValueError, match="`tokenizer` must have a chat template"):
        data.make_chat_dataset(PAIRS, plain)


def test_text_file_windows_join_lines_with_the_end_id(tokenizer, tmp_path):
    path = _write(tmp_path, "abc\n\ndefg\nhi\n", "corpus.txt")
    batches = list(data.make_text_file_dataset(path, tokenizer, sequence_length=4, batch_size=8, shuffle=False))
    inputs, labels = batches[0][0]["token_ids"].numpy(), batches[0][1].numpy()
    stream = [ord(c) for c in "abc"] + [257] + [ord(c) for c in "defg"] + [257] + [ord(c) for c in "hi"] + [257]
    windows = np.array(stream[:10]).reshape(2, 5)  # 12 tokens -> two windows of sequence_length + 1
    np.testing.assert_array_equal(inputs, windows[:, :-1])
    np.testing.assert_array_equal(labels, windows[:, 1:])
    empty = _write(tmp_path, "\n\n", "empty.txt")
    with pytest.raises(ValueError, match=r"empty\.txt.*holds no text"):
        data.make_text_file_dataset(empty, tokenizer)
    with pytest.raises(ValueError, match=r"corpus\.txt.*shorter than one window"):
        data.make_text_file_dataset(path, tokenizer, sequence_length=64)
    with pytest.raises(ValueError, match=r"nothing\.txt.*does not exist"):
        data.make_text_file_dataset(str(tmp_path / "nothing.txt"), tokenizer)
