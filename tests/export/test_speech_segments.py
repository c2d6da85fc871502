"""`tfformer.export.speech_segments.split_window`, the in-graph cut of the Whisper SavedModel's `segments` signature,
against the Python cut it copies (`models.transcript.split_by_timestamps`, faster-whisper's), on hand-worked windows
and on a few hundred random ones that follow Whisper's timestamp rules. The signature itself, on the pretrained model,
is tested in test_whisper_export.py.
"""

import numpy as np
import pytest

from tfformer.models import transcript

END = 10  # <|endoftext|> of this made-up vocabulary: ids 0..9 are text, 10 the end, 11..19 other special tokens
BEGIN = 20  # <|0.00|>; <|0.02|> is 21, ...


def t(seconds):
    return BEGIN + int(round(seconds / 0.02))


def expected_pieces(tokens, frames):
    """`(start, end, text ids)` of a window that starts the recording: `split_by_timestamps`' pieces without
    `start == end`, and the unfinished piece after the last pair, which the signature keeps up to the window's end
    when it starts before it."""
    duration = frames * 0.01
    pieces, _ = transcript.split_by_timestamps(tokens, BEGIN, 0, frames)
    found = [(start, end, [i for i in piece if i < END]) for start, end, piece in pieces]
    pairs = [i for i in range(1, len(tokens)) if tokens[i] >= BEGIN and tokens[i - 1] >= BEGIN]
    single_ending = len(tokens) >= 2 and tokens[-2] < BEGIN <= tokens[-1]
    if pairs and not single_ending and (tokens[pairs[-1]] - BEGIN) * 0.02 < duration:
        found.append(((tokens[pairs[-1]] - BEGIN) * 0.02, duration, [i for i in tokens[pairs[-1]:] if i < END]))
    return [piece for piece in found if piece[0] != piece[1]]


def split(rows, frames, width):
    """`split_window` on `rows` (lists of ids; padded with the end id to `width`): `(start, end, text ids)` per row."""
    import tensorflow as tf

    from tfformer.export import speech_segments

    ids = np.full((len(rows), width), END, np.int32)  # (B, N)
    for row, tokens in zip(ids, rows):
        row[:len(tokens)] = tokens
    start, end, exists, text_ids = speech_segments.split_window(tf.constant(ids), tf.constant(frames, tf.int32),
                                                                BEGIN, END)
    flat = text_ids.to_list()  # B * N lists, row-major
    texts = [flat[row * width:(row + 1) * width] for row in range(len(rows))]
    return [[(float(s), float(e), list(x)) for s, e, x, keep in zip(*values) if keep]
            for values in zip(start.numpy(), end.numpy(), texts, exists.numpy())]


def assert_same(found, expected):
    assert len(found) == len(expected), (found, expected)
    for (start, end, text), (want_start, want_end, want_text) in zip(found, expected):
        assert text == want_text and start == pytest.approx(want_start, abs=1e-5) and end == pytest.approx(
            want_end, abs=1e-5), (found, expected)


def test_hand_worked_windows():
    rows_and_pieces = [
        # Two segments ending with a lone timestamp; ids after the end are ignored.
        ([t(0.0), 1, 2, t(1.0), t(1.2), 3, t(2.5), END, 4, t(9.0)], 300, [(0.0, 1.0, [1, 2]), (1.2, 2.5, [3])]),
        # Unfinished after the last pair: kept, up to the window's end (3.0 s)...
        ([t(0.0), 1, 2, t(1.0), t(1.2), 3, t(2.5), t(2.6), 4], 300,
         [(0.0, 1.0, [1, 2]), (1.2, 2.5, [3]), (2.6, 3.0, [4])]),
        # ... unless it starts at or after the window's end (2.5 s).
        ([t(0.0), 1, t(1.0), t(2.5), 4], 250, [(0.0, 1.0, [1])]),
        # No pair: from 0 s to the last timestamp, or to the window's end without one (or with <|0.00|> only).
        ([t(0.4), 1, 2, t(3.0)], 3000, [(0.0, 3.0, [1, 2])]),
        ([t(0.0), 1, 2], 1200, [(0.0, 12.0, [1, 2])]),
        ([1, 2, 11], 700, [(0.0, 7.0, [1, 2])]),  # no timestamp at all; special ids (11) are no text
        # A pair at the very end: its second timestamp alone is an empty piece (text is checked later).
        ([t(0.0), 1, t(1.0), t(1.0)], 300, [(0.0, 1.0, [1]), (1.0, 3.0, [])]),
        ([t(0.0), 1, t(0.0)], 300, [(0.0, 3.0, [1])]),  # the last timestamp is <|0.00|>: to the window's end
        ([], 300, [(0.0, 3.0, [])]),  # the end at once: one piece without text
        ([t(0.0), 1, t(1.0)], 0, [(0.0, 1.0, [1])]),  # the signature drops rows without audio itself
    ]
    found = split([row for row, _, _ in rows_and_pieces], [frames for _, frames, _ in rows_and_pieces], 12)
    for got, (row, frames, pieces) in zip(found, rows_and_pieces):
        assert_same(got, pieces)
        assert_same(got, expected_pieces(row[:row.index(END)] if END in row else row, frames))


def random_window(rng):
    """Ids as Whisper's timestamp rules allow them: pieces `<|a|> text <|b|>` with non-decreasing timestamps, cut
    anywhere (the end, or the token limit, can come at any point); sometimes text without timestamps."""
    if rng.random() < 0.1:
        return [int(i) for i in rng.integers(0, END, rng.integers(0, 6))]
    tokens, time = [], int(rng.integers(0, 20))
    for _ in range(rng.integers(1, 5)):
        tokens.append(BEGIN + time)
        tokens += [int(i) for i in rng.integers(0, END, rng.integers(0, 4))]
        time += int(rng.integers(0, 40))
        tokens.append(BEGIN + time)
        time += int(rng.integers(0, 3))
    return tokens[:rng.integers(1, len(tokens) + 1)]


def test_random_windows_are_cut_as_split_by_timestamps():
    rng = np.random.default_rng(7)
    rows = [random_window(rng) for _ in range(400)]
    frames = [int(f) for f in rng.integers(0, 250, len(rows))]  # windows of 0 to 2.5 s: timestamps run past some
    width = max(len(row) for row in rows) + 2
    found = split(rows, frames, width)
    for got, row, count in zip(found, rows, frames):
        assert_same(got, expected_pieces(row, count))
    kinds = [(len([i for i in range(1, len(r)) if r[i] >= BEGIN and r[i - 1] >= BEGIN]) > 0,
              len(r) >= 2 and r[-2] < BEGIN <= r[-1]) for r in rows]
    assert len(set(kinds)) == 4  # with and without pairs, with and without a lone timestamp at the end
