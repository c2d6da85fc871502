"""tf.data pipelines: teacher forcing for translation, next-token windows for LMs."""

import tensorflow as tf

from tfformer.data.tokenizers import END_ID, START_ID


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


def _bucketing(dataset, length_fn, batch_size, max_length):
    boundaries = [b for b in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < max_length] + [max_length + 1]
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
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
    else:
        dataset = dataset.padded_batch(batch_size)
    return _finish(dataset)


def make_lm_dataset(texts, tokenizer, sequence_length=128, batch_size=32, shuffle=True, seed=0):
    """Lines of text -> batches of `({"token_ids": (B, L)}, labels (B, L))` next-token windows.

    Lines are tokenized, joined with the end id, and cut into windows of
    `sequence_length + 1` tokens (inputs are the first L, labels the last L).
    """
    if not texts:
        raise ValueError("`texts` is empty: there is nothing to train on.")
    ids = tokenizer.tokenize(list(texts))  # (N, None)
    ids = tf.concat([ids, tf.fill([ids.nrows(), 1], END_ID)], axis=1).flat_values  # (total,)
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
