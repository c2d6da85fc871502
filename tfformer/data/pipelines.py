"""tf.data pipelines: teacher forcing for translation, next-token windows for LMs, chat fine-tuning."""

import os
import warnings

import numpy as np
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.tokens import END_ID, START_ID


def _finish(dataset):
    """Prefetch, with tf.data's autotuning off.

    With autotuning on, deleting an iterator that lived through a training epoch could block for a minute on
    TF 2.21 (the iterator's destructor waited for one of its tf.data threads; with autotuning off it did not).
    Keras deletes the training and the validation iterators at every epoch end (docs/performance.md, "Data:
    tf.data autotuning"). Without autotuning, `AUTOTUNE`
    parallelism means the number of cores, and these pipelines keep training fed on 2 cores.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


def _boundaries(max_length):
    return [b for b in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < max_length] + [max_length + 1]


def _bucketing(dataset, length_fn, batch_size, max_length):
    boundaries = _boundaries(max_length)
    return dataset.bucket_by_sequence_length(
        length_fn,
        bucket_boundaries=boundaries,
        bucket_batch_sizes=[batch_size] * (len(boundaries) + 1),
        padded_shapes=None,
        padding_values=None,
        pad_to_bucket_boundary=False,
        drop_remainder=False,
    )


def make_translation_dataset(pairs, tokenizer, batch_size=64, max_length=64, shuffle=True, seed=0, bucket=True):
    """`(source, target)` pairs -> batches of `({"encoder_token_ids", "decoder_token_ids"}, labels)`.

    Teacher forcing: the decoder input is `[START] + target` and the labels are
    `target + [END]`, both at most `max_length` long; source and target are
    tokenized in the graph. Padding id 0 marks padded label positions (the loss
    ignores them). Shuffling is deterministic for a given `seed`; `bucket`
    batches sequences of similar length together to cut padding.
    """
    if not pairs:
        raise ValueError("`pairs` is empty: there is nothing to train or evaluate on.")
    check_int("batch_size", batch_size)
    check_int("max_length", max_length)
    sources, targets = zip(*pairs)
    dataset = tf.data.Dataset.from_tensor_slices((list(sources), list(targets)))
    if shuffle:
        dataset = dataset.shuffle(len(pairs), seed=seed, reshuffle_each_iteration=True)

    def tokenize(source, target):
        return tokenizer.tokenize(source), tokenizer.tokenize(target)

    def teacher_forcing(source, target):
        source = source[:max_length]
        target = target[: max_length - 1]
        decoder_input = tf.concat([[START_ID], target], axis=0)
        labels = tf.concat([target, [END_ID]], axis=0)
        return {"encoder_token_ids": source, "decoder_token_ids": decoder_input}, labels

    dataset = dataset.batch(1024).map(tokenize, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
    dataset = dataset.map(teacher_forcing, num_parallel_calls=tf.data.AUTOTUNE)
    if bucket:
        length = lambda inputs, labels: tf.maximum(tf.shape(inputs["encoder_token_ids"])[0], tf.shape(labels)[0])  # noqa: E731
        dataset = _bucketing(dataset, length, batch_size, max_length)
        batches = _bucketed_batches(sources, targets, tokenizer, batch_size, max_length)
    else:
        dataset = dataset.padded_batch(batch_size)
        batches = -(-len(pairs) // batch_size)
    # Bucketing hides the number of batches from tf.data; stated here (and checked by tf.data as it runs), Keras
    # knows an epoch's length: a progress bar with a total, and no "Your input ran out of data" warning at the end
    # of every first epoch and every evaluation.
    return _finish(dataset.apply(tf.data.experimental.assert_cardinality(batches)))


def _bucketed_batches(sources, targets, tokenizer, batch_size, max_length):
    """How many batches `_bucketing` makes of these pairs: per bucket of `_boundaries`, ceil(its pairs / batch
    size), whatever their order (each bucket emits full batches, then its remainder at the end)."""
    source_length = np.minimum(tokenizer.tokenize(list(sources)).row_lengths().numpy(), max_length)
    label_length = np.minimum(tokenizer.tokenize(list(targets)).row_lengths().numpy(), max_length - 1) + 1  # + END
    buckets = np.searchsorted(_boundaries(max_length), np.maximum(source_length, label_length), side="right")
    return int(sum(-(-count // batch_size) for count in np.bincount(buckets) if count))


def _end_id(tokenizer):
    """The id that ends a text: the tokenizer's first `end_ids` (a byte-pair tokenizer's end of turn), else END_ID."""
    end_ids = getattr(tokenizer, "end_ids", None)
    return int(end_ids[0]) if end_ids else END_ID


def make_lm_dataset(texts, tokenizer, sequence_length=128, batch_size=32, shuffle=True, seed=0):
    """Lines of text -> batches of `({"token_ids": (B, L)}, labels (B, L))` next-token windows.

    Lines are tokenized, joined with the end id (the tokenizer's first `end_ids` when it has them, else
    `END_ID`), and cut into windows of `sequence_length + 1` tokens (inputs are the first L, labels the last L).
    """
    if isinstance(texts, (str, bytes)):  # list() would make each character a line
        raise ValueError(f"`texts` must be a list of lines, not one string. Received: {type(texts).__name__} of "
                         f"{len(texts)} characters (pass text.splitlines(), or make_text_file_dataset for a file)")
    check_int("sequence_length", sequence_length)
    check_int("batch_size", batch_size)
    if not texts:
        raise ValueError("`texts` is empty: there is nothing to train on.")
    ids = tokenizer.tokenize(list(texts))  # (N, None)
    ids = tf.concat([ids, tf.fill([ids.nrows(), 1], _end_id(tokenizer))], axis=1).flat_values  # (total,)
    window = sequence_length + 1
    usable = (int(tf.size(ids)) // window) * window
    if usable == 0:
        raise ValueError(f"The text is shorter than one window of sequence_length + 1 = {window} tokens.")
    windows = tf.reshape(ids[:usable], (-1, window))  # (num_windows, L + 1)
    dataset = tf.data.Dataset.from_tensor_slices(windows)
    if shuffle:
        dataset = dataset.shuffle(int(windows.shape[0]), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.map(lambda w: ({"token_ids": w[:-1]}, w[1:])).batch(batch_size)
    return _finish(dataset)


def make_text_file_dataset(path, tokenizer, sequence_length=128, batch_size=32, shuffle=True, seed=0):
    """A UTF-8 text file -> `make_lm_dataset` batches of its non-blank lines (next-token language modelling)."""
    texts = []
    for text in _read_lines(path):
        if text.strip():
            texts.append(text)
    if not texts:
        raise ValueError(f"Text file {os.fspath(path)!r} holds no text (it is empty or blank).")
    try:
        return make_lm_dataset(texts, tokenizer, sequence_length, batch_size, shuffle, seed)
    except ValueError as error:
        raise ValueError(f"Text file {os.fspath(path)!r}: {error}") from error


def read_chat_tsv(path):
    """`(prompt, answer)` pairs of a chat TSV file: one `prompt<TAB>answer` per line, UTF-8.

    Blank lines are skipped. Literal `\\t`, `\\n` and `\\\\` inside a field are a tab, a newline and a backslash,
    so that prompts and answers may span lines. A line without a tab, with an empty prompt or answer, or a
    file without pairs is an error naming the file and the line.
    """
    pairs = []
    for number, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise ValueError(f"{os.fspath(path)}:{number}: expected 'prompt<TAB>answer', found no tab.")
        prompt, answer = (_unescape(field) for field in line.split("\t", 1))
        if not prompt.strip() or not answer.strip():
            empty = "prompt" if not prompt.strip() else "answer"
            raise ValueError(f"{os.fspath(path)}:{number}: the {empty} is empty; expected 'prompt<TAB>answer'.")
        pairs.append((prompt, answer))
    if not pairs:
        raise ValueError(f"Chat file {os.fspath(path)!r} holds no prompt<TAB>answer lines (it is empty or blank).")
    return pairs


def make_chat_dataset(pairs, tokenizer, sequence_length=256, batch_size=8, shuffle=True, seed=0, system_prompt=None):
    """Chat examples -> batches of `({"token_ids": (B, L)}, labels (B, L), sample_weight (B, L))` for `fit`,
    the loss on the answers only.

    Each `(prompt, answer)` is rendered with the tokenizer's chat template (`apply_chat_template`): the prompt
    as a user turn (after a system turn when `system_prompt` is set) with the assistant's turn opener, as
    `CausalLM.chat` renders it, then the answer and the template's end of turn. The prompt and the answer are
    tokenized apart, as `chat` sees the prompt and generates the answer; the answer's tokens stop at the first
    of the tokenizer's `end_ids`, which is kept (the model learns to end its turn). Inputs are the tokens but
    the last, labels the tokens after each, right-padded with id 0 to `L = sequence_length` (an example longer
    than `L + 1` tokens is cut to it, with a warning).

    `sample_weight` is 1 where the label is an answer token (or the end of turn) and 0 on the prompt and on
    padding; the labels there are 0 as well, the padding id `training.MaskedSparseCrossEntropy` ignores, so
    that loss gives the same value with or without the weights (and, without them, trains with its fused
    projection).

    Args:
        pairs: a path of a chat TSV file (`read_chat_tsv`) or a list of `(prompt, answer)` str pairs.
        tokenizer: a tokenizer with a chat template (`data.BytePairTokenizer`, e.g. `lm.preprocessor`).
        sequence_length: int. `L`, the padded length of every example.
        batch_size: int. Examples per batch.
        shuffle: bool. Shuffle the examples (deterministically for a `seed`), every epoch.
        system_prompt: optional str. A system turn before each prompt.
    """
    source = os.fspath(pairs) if isinstance(pairs, (str, os.PathLike)) else None
    if source is not None:
        pairs = read_chat_tsv(source)
    where = (lambda i: f"{source}:{i + 1}") if source else (lambda i: f"`pairs[{i}]`")
    if not pairs:
        raise ValueError("`pairs` is empty: there is nothing to fine-tune on.")
    check_int("sequence_length", sequence_length)
    check_int("batch_size", batch_size)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"`tokenizer` must have a chat template; this {type(tokenizer).__name__} has none.")
    prompts, completions = [], []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise ValueError(f"{where(i)}: expected a (prompt, answer) pair of str. Received: {pair!r:.120}")
        messages = [{"role": "user", "content": pair[0]}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        conversation = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": pair[1]}],
                                                     add_generation_prompt=False)
        if not conversation.startswith(prompt):
            raise ValueError(f"{where(i)}: the chat template does not render the prompt as the start of the "
                             "conversation, so the answer's tokens cannot be told apart.")
        prompts.append(prompt)
        completions.append(conversation[len(prompt):])
    prompt_ids = tokenizer.tokenize(prompts).to_list()  # N lists of ids
    completion_ids = tokenizer.tokenize(completions).to_list()
    end_ids = set(int(i) for i in (getattr(tokenizer, "end_ids", None) or ()))

    window = sequence_length + 1
    tokens = np.zeros((len(prompts), window), np.int32)  # (N, L + 1), right-padded with 0
    answer = np.zeros((len(prompts), window), bool)  # (N, L + 1)
    cut = 0
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        ends = [j for j, token in enumerate(completion) if token in end_ids]
        if ends:
            completion = completion[: ends[0] + 1]  # through the end of turn; what the template adds after it goes
        sequence = (prompt + completion)[:window]
        if len(prompt) >= window:
            raise ValueError(f"{where(i)}: the prompt alone is {len(prompt)} tokens, which leaves no answer token "
                             f"in sequence_length={sequence_length}; raise `sequence_length`.")
        cut += len(prompt) + len(completion) > window
        tokens[i, : len(sequence)] = sequence
        answer[i, len(prompt): len(sequence)] = True
    if cut:
        warnings.warn(f"{cut} of {len(prompts)} chat examples are longer than sequence_length + 1 = {window} "
                      "tokens and were cut (their answers lose their ends).", stacklevel=2)
    weights = answer[:, 1:].astype(np.float32)  # (N, L): the label at t is token t + 1
    labels = np.where(answer[:, 1:], tokens[:, 1:], 0).astype(np.int32)  # (N, L)
    dataset = tf.data.Dataset.from_tensor_slices(({"token_ids": tokens[:, :-1]}, labels, weights))
    if shuffle:
        dataset = dataset.shuffle(len(prompts), seed=seed, reshuffle_each_iteration=True)
    return _finish(dataset.batch(batch_size))


def _read_lines(path):
    """The lines of a UTF-8 text file, without their line ends; a missing file is an error naming it."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise ValueError(f"Data file {path!r} does not exist.")
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n").rstrip("\r") for line in handle]


def _unescape(text):
    return text.replace("\\\\", "\x00").replace("\\t", "\t").replace("\\n", "\n").replace("\x00", "\\")
