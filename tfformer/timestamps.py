"""Whisper's timestamp tokens without TensorFlow (numpy only): what the Keras path (`tfformer.models.transcript`,
`tfformer.models.whisper_decode`) and the host loop on device (`tfformer.edge.Transcriber`) share.

Timestamp tokens `<|0.00|>`, `<|0.02|>`, ... `<|30.00|>` follow `<|notimestamps|>` in Whisper's vocabulary. A window
is decoded from its start sequence without `<|notimestamps|>` (`start_sequence`), after `<|startofprev|>` and the
previous text when it is conditioned on it: the first token is a timestamp of at most `max_initial_timestamp` seconds
(`first_step_bias`), then `timestamp_rules` (CTranslate2's `ApplyTimestampRules`, which faster-whisper decodes with)
keep the timestamps in pairs around the text; `split_by_timestamps` cuts the window's tokens into pieces and says
where the next window starts. `models.whisper_decode.timestamp_rules` is the same rules in TensorFlow, for the in-graph
loop. `long_form_segments` is faster-whisper's window loop over a recording, which the Keras path
(`models.transcript.segments`) and the edge (`edge.Transcriber.segments`) both run with their own window decoding
(`WindowLoop`). This module imports numpy and `tfformer.checks` only.
"""

import collections
import dataclasses

import numpy as np

from tfformer.checks import check_number

TIME_PRECISION = 0.02  # seconds per timestamp token: <|0.00|>, <|0.02|>, ... <|30.00|>
SAMPLES_PER_FRAME = 160  # a log-mel frame: Whisper's hop of 160 samples at 16 kHz
SECONDS_PER_FRAME = SAMPLES_PER_FRAME / 16000
WINDOW_FRAMES = 3000  # a window: 30 seconds
FRAMES_PER_TOKEN = 2  # the encoder's stride-2 convolution: one timestamp step (20 ms) is two 10 ms frames
# faster-whisper's defaults: a window whose <|nospeech|> probability is above NO_SPEECH_THRESHOLD and whose mean
# log-probability is not above LOG_PROB_THRESHOLD is silence; the first timestamp is at most MAX_INITIAL_TIMESTAMP.
NO_SPEECH_THRESHOLD = 0.6
LOG_PROB_THRESHOLD = -1.0
MAX_INITIAL_TIMESTAMP = 1.0
NONE = -1  # no token yet, in the timestamp rules' state

# The ids timestamp decoding needs: `no_timestamps` (never produced), `timestamp_begin` (<|0.00|>; the timestamps run
# to the last id of the vocabulary), `no_speech` (whose probability at the start of the transcript tells silence).
TimestampIds = collections.namedtuple("TimestampIds", "no_timestamps timestamp_begin no_speech")


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of a transcript: `start` and `end` in seconds from the start of the recording, its `text`, and with
    word timestamps its `words` (a tuple of `tfformer.models.transcript.Word`)."""
    start: float
    end: float
    text: str
    words: tuple = None


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One decoding of a window: its tokens (without the end), mean log-probability (faster-whisper's: the sum over
    the tokens and the end, divided by their count), temperature, compression ratio (None when not computed), and
    the probability of <|nospeech|>."""
    tokens: list
    avg_logprob: float
    temperature: float
    compression_ratio: float
    no_speech_prob: float


def timestamp_ids(vocabulary):
    """`TimestampIds` from a Whisper tokenizer's `token_to_id` dict, checked to hold the tokens timestamps need
    (`<|startofprev|>` too)."""
    vocabulary = vocabulary or {}
    no_speech = vocabulary.get("<|nospeech|>", vocabulary.get("<|nocaptions|>"))
    needed = ("<|notimestamps|>", "<|startofprev|>", "<|startoftranscript|>")
    if no_speech is None or any(token not in vocabulary for token in needed):
        raise ValueError(f"Timestamps need a Whisper tokenizer with the tokens {list(needed)} and <|nospeech|> or "
                         "<|nocaptions|>: Whisper's BytePairTokenizer (`WhisperModel.preprocessor`).")
    no_timestamps = vocabulary["<|notimestamps|>"]
    return TimestampIds(no_timestamps, no_timestamps + 1, no_speech)


def start_sequence(prompt, ids):
    """A window's start sequence for timestamps: the plain `prompt` (`<|startoftranscript|>` ... `<|notimestamps|>`)
    without `<|notimestamps|>`, as a list."""
    return [int(token) for token in prompt if token != ids.no_timestamps]


def window_prompt(start, previous, start_of_prev):
    """faster-whisper's prompt of a window: `<|startofprev|>` and the `previous` tokens when there are any, then the
    `start` sequence."""
    return ([start_of_prev, *previous] if previous else []) + list(start)


def first_step_bias(vocabulary_size, ids, max_initial_timestamp=MAX_INITIAL_TIMESTAMP):
    """`(V,)` float32 added to the first step's logits: only timestamps up to `max_initial_timestamp` seconds."""
    check_number("max_initial_timestamp", max_initial_timestamp, at_least=0)
    last = ids.timestamp_begin + int(round(max_initial_timestamp / TIME_PRECISION))
    bias = np.full([vocabulary_size], -np.inf, np.float32)  # (V,)
    bias[ids.timestamp_begin:last + 1] = 0.0
    return bias


def log_softmax(logits):
    """`log_softmax` over the last axis of float32 `logits` (-inf entries stay -inf), as `tf.nn.log_softmax`."""
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _logsumexp(values):
    """`log(sum(exp(values)))` over the last axis, -inf for a row of -inf only (as `tf.reduce_logsumexp`)."""
    peak = np.max(values, axis=-1)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        return peak + np.log(np.sum(np.exp(values - peak[..., None]), axis=-1))


def timestamp_rules(logits, last, penultimate, last_timestamp, end_id, ids):
    """Whisper's timestamp rules after the first generated token, on `logits` `(B, V)` (suppressions applied): the
    numpy form of `models.whisper_decode.timestamp_rules`, for a host loop.

    `last`, `penultimate` `(B,)`: the last two generated tokens (`penultimate` is `last` after one token);
    `last_timestamp` `(B,)`: the latest timestamp generated (`NONE` before one). `<|notimestamps|>` never comes;
    timestamps come in pairs (after a pair, text or the end; after a lone timestamp, a timestamp or the end); they
    never decrease, and after text the next one is past the latest (a segment ends after it starts: CTranslate2's
    "Prevent generating segments with zero duration", openai-whisper's "nonzero length" rule; without it a window
    could end at its start and never move `seek`); and when the timestamps' total probability beats every other
    token's, a timestamp must come. Returns a float32 copy of the logits with what these rules forbid at -inf.
    """
    logits = np.array(logits, np.float32)  # (B, V), a copy
    begin = ids.timestamp_begin
    last, penultimate, last_timestamp = (np.asarray(v).reshape(-1) for v in (last, penultimate, last_timestamp))
    last_ts = last >= begin  # (B,)
    pair = last_ts & (penultimate >= begin)
    logits[:, ids.no_timestamps] = -np.inf
    logits[pair, begin:] = -np.inf  # after a pair: text or the end
    logits[last_ts & ~pair, :end_id] = -np.inf  # after a lone timestamp: a timestamp or the end
    stamps = logits[:, begin:]  # (B, V - begin), a view
    lowest = np.where(last_ts, last_timestamp, last_timestamp + 1)  # (B,): after text, past the latest timestamp
    stamps[np.arange(begin, logits.shape[-1])[None, :] < lowest[:, None]] = -np.inf  # never decreasing
    log_probs = log_softmax(logits)  # (B, V)
    timestamp = _logsumexp(log_probs[:, begin:])  # (B,)
    text = np.max(log_probs[:, :begin], axis=-1)  # (B,)
    logits[~pair & (timestamp > text), :begin] = -np.inf
    return logits


def is_silence(no_speech_prob, avg_logprob, no_speech_threshold=NO_SPEECH_THRESHOLD,
               log_prob_threshold=LOG_PROB_THRESHOLD):
    """faster-whisper's test of a window for silence: <|nospeech|> above `no_speech_threshold` and the mean
    log-probability not above `log_prob_threshold` (either threshold None: not applied)."""
    if no_speech_threshold is None or no_speech_prob <= no_speech_threshold:
        return False
    return not (log_prob_threshold is not None and avg_logprob > log_prob_threshold)


def split_by_timestamps(tokens, timestamp_begin, seek, window_frames):
    """faster-whisper's cut of a window's `tokens` into `(start, end, tokens)` pieces (seconds), and the next `seek`.

    Pieces end at each pair of consecutive timestamps; an unfinished piece after the last pair is dropped and the
    next window starts at its last timestamp, unless the tokens end with a lone timestamp (nothing more was said:
    the next window starts after this one). Without a pair, the whole window is one piece up to its last timestamp.
    The next `seek` is always past `seek` (see `next_seek`).
    """
    offset = seek * SECONDS_PER_FRAME
    is_ts = [token >= timestamp_begin for token in tokens]
    single_ending = len(tokens) >= 2 and not is_ts[-2] and is_ts[-1]
    pairs = [i for i in range(1, len(tokens)) if is_ts[i] and is_ts[i - 1]]
    if not pairs:
        duration = window_frames * SECONDS_PER_FRAME
        stamps = [token for token in tokens if token >= timestamp_begin]
        if stamps and stamps[-1] != timestamp_begin:
            duration = (stamps[-1] - timestamp_begin) * TIME_PRECISION
        return [(offset, offset + duration, list(tokens))], seek + window_frames
    cuts = pairs + [len(tokens)] if single_ending else pairs
    pieces, first = [], 0
    for cut in cuts:
        piece = list(tokens[first:cut])
        start, end = ((piece[i] - timestamp_begin) * TIME_PRECISION + offset for i in (0, -1))
        pieces.append((start, end, piece))
        first = cut
    if single_ending:
        return pieces, seek + window_frames
    return pieces, next_seek(seek, seek + (tokens[first - 1] - timestamp_begin) * FRAMES_PER_TOKEN, window_frames)


def next_seek(seek, proposed, window_frames):
    """The next window's start after the window `seek` of `window_frames` frames: `proposed`, or after the whole
    window when `proposed` is not past `seek` (a loop would decode the same window again, for ever).

    Tokens decoded with `timestamp_rules` never propose that: a segment ends after it starts, so the last complete
    one ends after the window's start; and a word's end after the window's start, in hundredths of a second (a
    frame), is a later frame but for float rounding. Neither faster-whisper's `generate_segments` nor
    openai-whisper's `transcribe` has a guard of its own: their rules are the guard (CTranslate2's since v3.12.0,
    openai-whisper's "nonzero length"). This one keeps tokens or word times from elsewhere (another decoder, a rule
    changed) from stalling the loop, and moves on as after a window that ended with a lone timestamp.
    """
    return proposed if proposed > seek else seek + window_frames


@dataclasses.dataclass(frozen=True)
class WindowLoop:
    """How `long_form_segments` decodes the windows of a recording, and faster-whisper's options it reads.

    Args:
        features: callable `(samples (n,) float32) -> features`: a window's features (what `decode` and `words`
            take), for its `n` <= `window_frames * SAMPLES_PER_FRAME` samples.
        decode: callable `(features, prompt) -> Decoded`: the window decoded after `prompt` (a list of ids).
        texts: callable `(rows) -> list of str`: the stripped texts of a window's pieces' tokens (a list of lists
            of ids), in one call (a tokenizer's call can cost more than its text).
        start_ids: list of ints. A window's start sequence (`start_sequence`).
        start_of_prev: int. `<|startofprev|>`'s id.
        timestamp_begin: int. `<|0.00|>`'s id.
        max_previous: int. The previous tokens a prompt keeps at most (the last ones).
        window_frames: int. Frames of a window.
        condition_on_previous_text: bool. Prompt each window with the text so far.
        prompt_reset_on_temperature: float. After a window decoded above this temperature the prompt starts over.
        no_speech_threshold, log_prob_threshold: float or None. `is_silence`'s.
        words: None, or callable `(features, pieces, window_frames, seek, next_seek, tokens, last_speech) ->
            (pieces, next_seek, last_speech)`: word timestamps for a window's `(start, end, tokens)` pieces (each
            then `(start, end, tokens, words)`), the next window's start (past `seek`: `next_seek`) and the end of
            the last speech.
    """
    features: object
    decode: object
    texts: object
    start_ids: list
    start_of_prev: int
    timestamp_begin: int
    max_previous: int
    window_frames: int = WINDOW_FRAMES
    condition_on_previous_text: bool = True
    prompt_reset_on_temperature: float = 0.5
    no_speech_threshold: float = NO_SPEECH_THRESHOLD
    log_prob_threshold: float = LOG_PROB_THRESHOLD
    words: object = None


def long_form_segments(waveform, loop):
    """Yields the `Segment`s of a 16 kHz mono `waveform` (float32 numpy, or what `len()` and `[start:stop]` read,
    as `data.audio.open_wav`'s) as each window is decoded: faster-whisper's `generate_segments` (without its clip
    timestamps, prefix, hotwords or hallucination skip), with `loop`'s (`WindowLoop`) decoding.

    A window of at most `loop.window_frames` frames starts at `seek`; it is decoded after `<|startofprev|>` and the
    text so far (`window_prompt`); a window `is_silence` calls silence is skipped; otherwise its complete pieces
    (`split_by_timestamps`, then `loop.words`) are yielded, save those of no length or no text, and the next window
    starts where the cut (or `loop.words`) says, always past `seek` (`next_seek`). The text so far is dropped after
    a window without `condition_on_previous_text` or decoded above `prompt_reset_on_temperature`. Only one window's
    features are held at a time.
    """
    content_frames = len(waveform) // SAMPLES_PER_FRAME
    previous = collections.deque(maxlen=loop.max_previous)  # the prompt's previous tokens: all that is kept of them
    seek, last_speech = 0, 0.0
    while seek < content_frames:
        window_frames = min(loop.window_frames, content_frames - seek)
        features = loop.features(waveform[seek * SAMPLES_PER_FRAME:(seek + window_frames) * SAMPLES_PER_FRAME])
        result = loop.decode(features, window_prompt(loop.start_ids, previous, loop.start_of_prev))
        if is_silence(result.no_speech_prob, result.avg_logprob, loop.no_speech_threshold, loop.log_prob_threshold):
            seek += window_frames  # silence: on to the next window
            continue
        window_seek = seek
        pieces, seek = split_by_timestamps(result.tokens, loop.timestamp_begin, seek, window_frames)
        if loop.words is not None:
            pieces, seek, last_speech = loop.words(features, pieces, window_frames, window_seek, seek, result.tokens,
                                                   last_speech)
        for (start, end, tokens, *words), text in zip(pieces, loop.texts([piece[2] for piece in pieces])):
            if start == end or not text:
                continue
            previous.extend(tokens)
            yield Segment(round(start, 3), round(end, 3), text, words[0] if words else None)
        if not loop.condition_on_previous_text or result.temperature > loop.prompt_reset_on_temperature:
            previous.clear()
