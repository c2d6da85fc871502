"""Word timestamps from cross-attention (Radford et al., 2022; openai-whisper's `timing.py`, CTranslate2's `align`).

The window's text is fed once more after `<|startoftranscript|> <|notimestamps|>`; the cross-attention weights of
the checkpoint's alignment heads (softmax over the frames that hold audio) are normalised per frame over the
tokens, median-filtered over time (width 7) and averaged over the heads; dynamic time warping on their negative
finds the monotonic path of tokens through the 20 ms encoder frames, and a word starts where the path enters its
first token and ends where it enters the next word's.
"""

import string

import numpy as np
import tensorflow as tf

from tfformer.generation.decode import cached_function
from tfformer.models import base

TOKENS_PER_SECOND = 50  # encoder frames per second (20 ms each)
MEDIAN_FILTER_WIDTH = 7


def cross_attention_fn(model, heads):
    """`(input_features (1, F, M), token_ids (1, T)) -> (len(heads), T, S)`: the cross-attention weights of the
    `(layer, head)` pairs `heads` of a Whisper `model`, compiled once per `heads`."""
    heads = tuple((int(layer), int(head)) for layer, head in heads)

    def make():
        def run(input_features, token_ids):
            encoder_outputs, _ = model.encode(input_features)  # (1, S, D)
            y = base.embed_tokens(model.decoder_token_embedding, model.decoder_position, token_ids)  # (1, T, D)
            weights = []
            for block in model.decoder_blocks:
                y, scores = block(y, encoder_outputs, use_causal_mask=True, return_attention_scores=True)
                weights.append(scores[0])  # (N, T, S)
            return tf.stack([weights[layer][head] for layer, head in heads])  # (A, T, S)

        spec = [tf.TensorSpec([None, None, model.config.num_mel_bins], tf.float32), tf.TensorSpec([1, None], tf.int32)]
        return tf.function(run, input_signature=spec)

    return cached_function(model, ("alignment", heads), make)


def median_filter(x, width):
    """A median over `width` (odd) neighbours along the last axis, reflect-padded as openai-whisper's."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)  # (..., L, width)
    return np.median(windows, axis=-1)


def dtw(cost):
    """openai-whisper's dynamic time warping of a `(N, M)` cost: the path `(token_indices, time_indices)` from
    (0, 0) to (N - 1, M - 1), ties broken towards moving in time."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf, np.float32)
    trace = np.full((n + 1, m + 1), -1, np.int8)
    total[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
            if c0 < c1 and c0 < c2:
                best, step = c0, 0
            elif c1 < c0 and c1 < c2:
                best, step = c1, 1
            else:
                best, step = c2, 2
            total[i, j] = cost[i - 1, j - 1] + best
            trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    path = np.array(path[::-1])
    return path[:, 0], path[:, 1]


def split_words(decode, tokens, end_id):
    """faster-whisper's English word split of `tokens` (ending with `end_id`): `(words, word_tokens)`, a new word at
    each piece that starts with a space, is punctuation or special."""
    pieces, piece_tokens, current = [], [], []
    for token in tokens:  # pieces that decode to whole characters
        current.append(token)
        text = decode(current)
        if "\ufffd" not in text:
            pieces.append(text)
            piece_tokens.append(current)
            current = []
    words, word_tokens = [], []
    for piece, ids in zip(pieces, piece_tokens):
        if ids[0] >= end_id or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def word_times(model, input_features, text_tokens, num_frames, heads, decode):
    """`[(word, start, end, tokens)]` (seconds from the window's start) of a window's `text_tokens` (no timestamps)
    over its `num_frames` 10 ms frames of audio; `decode(ids) -> str`."""
    if not text_tokens:
        return []
    no_timestamps = model.preprocessor.token_to_id["<|notimestamps|>"]
    ids = [model.prompt[0], no_timestamps, *text_tokens, model.end_id]
    weights = cross_attention_fn(model, heads)(input_features, tf.constant([ids], tf.int32)).numpy()  # (A, T, S)
    weights = weights[:, :, :num_frames // 2]
    weights = weights / weights.sum(axis=-1, keepdims=True)  # softmax over the frames with audio
    mean, std = weights.mean(axis=-2, keepdims=True), weights.std(axis=-2, keepdims=True)
    weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(axis=0)[1:-1]  # (len(text_tokens) + 1, frames): rows <|notimestamps|> ... last text token
    text_indices, time_indices = dtw(-matrix)
    words, word_tokens = split_words(decode, [*text_tokens, model.end_id], model.end_id)
    if len(word_tokens) <= 1:
        return []
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND
    starts, ends = jump_times[boundaries[:-1]], jump_times[boundaries[1:]]
    return [(word, float(start), float(end), tokens)
            for word, tokens, start, end in zip(words, word_tokens, starts, ends)]
