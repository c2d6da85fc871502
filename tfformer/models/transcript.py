"""Timestamped transcripts of recordings of any length, as faster-whisper makes them (`WhisperModel.segments`).

A 30-second window starts at `seek`; the model writes `<|t0|> text <|t1|>` pairs (`models.whisper_decode`'s timestamp
rules); the window's complete segments are yielded and the next window starts at the last complete segment's end
(or after the window, when it ends with a lone timestamp: nothing more was said). Each window is conditioned on the
text so far (`<|startofprev|>` + at most `max_sequence_length // 2 - 1` previous tokens), and decoded again at
higher temperatures when its text repeats itself (zlib compression ratio above `compression_ratio_threshold`) or
its mean log-probability is below `log_prob_threshold`. Only one window's features are held at a time. The window
loop and its TensorFlow-free pieces (the cut at timestamps, the prompt, the silence test, `Segment`, `Decoded`) are
`tfformer.timestamps`', shared with `tfformer.edge.Transcriber`'s host loop; this module gives the loop its window
decoding (the temperature fallback) and word timestamps.
"""

import dataclasses
import zlib

import numpy as np
import tensorflow as tf

from tfformer import timestamps
from tfformer.checks import check_int, check_number
from tfformer.data import audio as audio_io
from tfformer.generation import samplers
from tfformer.models import whisper_decode as speech
from tfformer.timestamps import (  # noqa: F401 (re-exported: transcript.Segment, transcript.Decoded, ...)
    FRAMES_PER_TOKEN,
    LOG_PROB_THRESHOLD,
    MAX_INITIAL_TIMESTAMP,
    NO_SPEECH_THRESHOLD,
    SECONDS_PER_FRAME,
    Decoded,
    Segment,
    split_by_timestamps,
    start_sequence,
)
from tfformer.tokens import cut_at_end


@dataclasses.dataclass(frozen=True)
class TranscriptOptions:
    """faster-whisper's long-form options (its defaults), checked.

    Args:
        condition_on_previous_text: bool. Prompt each window with the text so far.
        temperature: float or tuple of floats >= 0. Decoding temperatures tried in turn (0: greedy).
        compression_ratio_threshold: float or None. A window whose text compresses better is decoded again.
        log_prob_threshold: float or None. A window whose mean token log-probability is lower is decoded again.
        no_speech_threshold: float or None. A window whose `<|nospeech|>` probability is higher (and whose mean
            log-probability is below `log_prob_threshold`) is skipped as silence.
        prompt_reset_on_temperature: float. After a window decoded above this temperature the prompt starts over.
        max_initial_timestamp: float. The first timestamp of a window is at most this many seconds.
        best_of: int. Samples drawn at a temperature above 0; the one with the best mean log-probability wins.
        max_new_tokens: int or None. Tokens per window (None: `max_sequence_length // 2`, CTranslate2's limit).
        seed: int. Seed of the draws at temperatures above 0.
        word_timestamps: bool. Word times from cross-attention alignment (`Segment.words`); a window then
            ends at its last word rather than its last timestamp, as faster-whisper's.
        jit_compile: bool. Decode with XLA: the decode loop compiles once per batch size (a few seconds, at the
            first window) and runs about 1.4x faster on CPU; the same tokens up to the order of float sums
            (`models.whisper_decode.transcribe_timestamp_ids`).
    """
    condition_on_previous_text: bool = True
    temperature: tuple = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float = 2.4
    log_prob_threshold: float = LOG_PROB_THRESHOLD
    no_speech_threshold: float = NO_SPEECH_THRESHOLD
    prompt_reset_on_temperature: float = 0.5
    max_initial_timestamp: float = MAX_INITIAL_TIMESTAMP
    best_of: int = 5
    max_new_tokens: int = None
    seed: int = 0
    word_timestamps: bool = False
    jit_compile: bool = True

    def __post_init__(self):
        if not isinstance(self.condition_on_previous_text, bool):
            raise ValueError("`condition_on_previous_text` must be a bool. Received: "
                             f"condition_on_previous_text={self.condition_on_previous_text!r}")
        temperatures = self.temperature if isinstance(self.temperature, (list, tuple)) else (self.temperature,)
        for value in temperatures:
            check_number("temperature", value, at_least=0, expected="a number >= 0 or a tuple of them")
        if not temperatures:
            raise ValueError("`temperature` must hold at least one temperature. Received: temperature=()")
        object.__setattr__(self, "temperature", tuple(float(t) for t in temperatures))
        for name in ("compression_ratio_threshold", "log_prob_threshold", "no_speech_threshold"):
            check_number(name, getattr(self, name), allow_none=True)
        check_number("prompt_reset_on_temperature", self.prompt_reset_on_temperature)
        check_number("max_initial_timestamp", self.max_initial_timestamp, at_least=0)
        check_int("best_of", self.best_of)
        check_int("max_new_tokens", self.max_new_tokens, allow_none=True)
        check_int("seed", self.seed, minimum=None)
        for name in ("word_timestamps", "jit_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool. Received: {name}={getattr(self, name)!r}")

    @classmethod
    def from_kwargs(cls, **options):
        """Options by name; an unknown name is a ValueError naming it."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"Unknown transcription option(s) {unknown}; the options are {names}.")
        return cls(**options)


def compression_ratio(text):
    """Bytes of `text` (UTF-8) over bytes of its zlib compression: high for text that repeats itself."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


def timestamp_ids(model):
    """`tfformer.timestamps.TimestampIds` of a Whisper `model`, from its tokenizer's special tokens."""
    return timestamps.timestamp_ids(getattr(model.preprocessor, "token_to_id", None))


def decode_text(model, tokens):
    """The text of `tokens` (a list of ids; special tokens and timestamps, ids >= `end_id`, left out), unstripped."""
    return decode_texts(model, [tokens])[0]


def decode_texts(model, rows):
    """`decode_text` of each list of ids in `rows`, in one call of the tokenizer (an eager call costs about 4 ms)."""
    text_ids = [[i for i in tokens if i < model.end_id] for tokens in rows]
    if not text_ids:
        return []
    ragged = tf.ragged.constant(text_ids, dtype=tf.int32, ragged_rank=1)  # (R, None)
    return [text.decode("utf-8") for text in model.preprocessor.detokenize(ragged).numpy()]


def _decode_once(model, features, prompt, ids, options, temperature, held=None):
    """The window decoded at `temperature` (greedy at 0, else the best of `best_of` draws by mean log-probability).
    `held`: a dict that keeps the greedy pass's kernels under XLA (`whisper_decode.timestamp_kernels(model, 1)`,
    laid out at its first use) for the next windows, or None."""
    limit = model.config.max_sequence_length
    new_tokens = min(limit // 2, limit + 1 - len(prompt))
    if options.max_new_tokens is not None:
        new_tokens = min(new_tokens, options.max_new_tokens)
    rows = 1 if temperature == 0 else options.best_of
    sampler = None if temperature == 0 else samplers.TemperatureSampler(temperature, seed=options.seed)
    greedy_xla = held is not None and rows == 1 and options.jit_compile
    if greedy_xla and "kernels" not in held:
        held["kernels"] = speech.timestamp_kernels(model, 1)
    tokens, sums, no_speech = speech.transcribe_timestamp_ids(
        model, np.repeat(features, rows, axis=0), np.array([prompt] * rows, np.int32), ids, new_tokens,
        suppress_ids=model.suppress_ids, suppress_ids_begin=model.suppress_ids_begin, end_id=model.end_id,
        sampler=sampler, max_initial_timestamp=options.max_initial_timestamp, jit_compile=options.jit_compile,
        kernels=held["kernels"] if greedy_xla else None)
    candidates = []
    for row, total in zip(tokens.tolist(), sums.tolist()):
        row = cut_at_end(row, model.end_id)
        # CTranslate2 ranks hypotheses by score / length; faster-whisper's mean counts the end token too.
        candidates.append((total / max(len(row), 1), total / (len(row) + 1), row))
    _, avg_logprob, row = max(candidates, key=lambda candidate: candidate[0])
    text = decode_text(model, row).strip()
    return Decoded(row, avg_logprob, temperature, compression_ratio(text), float(no_speech[0]))


def decode_with_fallback(model, features, prompt, ids, options, held=None):
    """faster-whisper's `generate_with_fallback`: the first temperature whose text passes the thresholds; when none
    does, the best mean log-probability among those under the compression threshold (or all), at the last
    temperature (which decides the prompt reset). `held`: as `_decode_once`'s."""
    tried, passed = [], []
    for temperature in options.temperature:
        result = _decode_once(model, features, prompt, ids, options, temperature, held)
        tried.append(result)
        fallback = False
        if options.compression_ratio_threshold is not None:
            if result.compression_ratio > options.compression_ratio_threshold:
                fallback = True  # too repetitive
            else:
                passed.append(result)
        low = options.log_prob_threshold is not None and result.avg_logprob < options.log_prob_threshold
        fallback = fallback or low
        if options.no_speech_threshold is not None and result.no_speech_prob > options.no_speech_threshold and low:
            fallback = False  # silence
        if not fallback:
            return result
    best = max(passed or tried, key=lambda result: result.avg_logprob)
    return dataclasses.replace(best, temperature=options.temperature[-1])


def segments(model, waveform, options):
    """Yields the `Segment`s of a 16 kHz mono `waveform` (float32 numpy or `audio.open_wav`'s) as each window is decoded
    (`tfformer.timestamps.long_form_segments` with `decode_with_fallback`, and word timestamps). Under XLA the
    greedy passes read kernels laid out once, at the first window, for the whole recording."""
    ids = timestamp_ids(model)
    if options.word_timestamps and not model.alignment_heads:
        raise ValueError("`word_timestamps=True` needs the model's `alignment_heads` (a checkpoint's cross-attention "
                         "heads for word timing); this model has none.")

    def words(features, pieces, window_frames, seek, next_seek, tokens, last_speech):
        return _words_and_seek(model, features, pieces, window_frames, seek, next_seek, tokens, ids.timestamp_begin,
                               last_speech)

    held = {}  # the greedy pass's kernels, laid out at the first window that needs them
    loop = timestamps.WindowLoop(
        features=lambda samples: audio_io.window_log_mel(samples[None, :], [len(samples)]).numpy(),  # (1, 3000, M)
        decode=lambda features, prompt: decode_with_fallback(model, features, prompt, ids, options, held),
        texts=lambda rows: [text.strip() for text in decode_texts(model, rows)],
        start_ids=start_sequence(model.prompt, ids),
        start_of_prev=model.preprocessor.token_to_id["<|startofprev|>"], timestamp_begin=ids.timestamp_begin,
        max_previous=model.config.max_sequence_length // 2 - 1, window_frames=audio_io.NUM_FRAMES,
        condition_on_previous_text=options.condition_on_previous_text,
        prompt_reset_on_temperature=options.prompt_reset_on_temperature,
        no_speech_threshold=options.no_speech_threshold, log_prob_threshold=options.log_prob_threshold,
        words=words if options.word_timestamps else None)
    yield from timestamps.long_form_segments(waveform, loop)


# === Transcript files ===
FORMATS = ("txt", "srt", "vtt", "json")


def _clock(seconds, decimal):
    """`HH:MM:SS<decimal>mmm` of `seconds` >= 0, rounded to the millisecond."""
    millis = int(round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{decimal}{millis % 1000:03d}"


def format_transcript(segments, format):
    """The text of a transcript file of `segments` (`Segment`s) in `format`: "txt" (a line per segment), "srt"
    (SubRip: numbered cues, `00:00:01,000 --> 00:00:02,500`), "vtt" (WebVTT: a `WEBVTT` header, cues with `.`
    milliseconds) or "json" (`{"segments": [{"start", "end", "text"}]}`, seconds; with word timestamps each
    segment's `"words": [{"start", "end", "word"}]` too)."""
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}. Received: format={format!r}")
    segments = list(segments)
    if format == "txt":
        return "".join(f"{s.text}\n" for s in segments)
    if format == "json":
        import json  # only for this format

        items = [{"start": s.start, "end": s.end, "text": s.text} for s in segments]
        for item, s in zip(items, segments):
            if s.words is not None:
                item["words"] = [{"start": w.start, "end": w.end, "word": w.word} for w in s.words]
        return json.dumps({"segments": items}, indent=2, ensure_ascii=False) + "\n"
    # A cue's text must not hold an empty line (it would end the cue), nor "-->".
    texts = [" ".join(s.text.replace("-->", "->").split()) for s in segments]
    if format == "srt":
        return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{text}\n\n"
                       for i, (s, text) in enumerate(zip(segments, texts), start=1))
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{text}\n\n"
                                  for s, text in zip(segments, texts))


# === Word timestamps (faster-whisper's add_word_timestamps) ===
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_ENDS = ".。!！?？"


@dataclasses.dataclass(frozen=True)
class Word:
    """A word of a `Segment`: `start` and `end` in seconds from the start of the recording, and its text (with its
    leading space and attached punctuation, as faster-whisper's)."""
    start: float
    end: float
    word: str


def merge_punctuations(alignment):
    """Opening punctuation joins the word after it, closing punctuation the word before (in place)."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous["word"].startswith(" ") and previous["word"].strip() in PREPEND_PUNCTUATIONS:
            following["word"], following["tokens"] = previous["word"] + following["word"], previous["tokens"] + \
                following["tokens"]
            previous["word"], previous["tokens"] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous["word"].endswith(" ") and following["word"] in APPEND_PUNCTUATIONS:
            previous["word"], previous["tokens"] = previous["word"] + following["word"], previous["tokens"] + \
                following["tokens"]
            following["word"], following["tokens"] = "", []
        else:
            i = j
        j += 1


def _aligned_words(model, features, pieces, window_frames):
    """The window's words as dicts (word, start, end, tokens; seconds from the window's start), long words at
    sentence ends cut to twice the median word duration, punctuation merged; and that median (at most 0.7 s)."""
    from tfformer.models import alignment  # only with word timestamps

    text_tokens = [token for _, _, tokens in pieces for token in tokens if token < model.end_id]
    found = alignment.word_times(model, features, text_tokens, window_frames, model.alignment_heads,
                                 lambda ids: decode_text(model, ids))
    words = [dict(word=w, start=s, end=e, tokens=list(t)) for w, s, e, t in found]
    durations = np.array([w["end"] - w["start"] for w in words])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):
        for i in range(1, len(words)):
            if words[i]["end"] - words[i]["start"] > longest:
                if words[i]["word"] in SENTENCE_ENDS:
                    words[i]["end"] = words[i]["start"] + longest
                elif words[i - 1]["word"] in SENTENCE_ENDS:
                    words[i]["start"] = words[i]["end"] - longest
    merge_punctuations(words)
    return words, median


def add_word_timestamps(model, features, pieces, window_frames, seek, last_speech):
    """faster-whisper's word timestamps of a window's `pieces` `(start, end, tokens)`: returns the pieces as
    `(start, end, tokens, words)` (a piece's ends moved to its words' unless they stray by over 0.5 s) and the
    end of the last speech."""
    words, median = _aligned_words(model, features, pieces, window_frames)
    longest, offset, index, result = median * 2, seek * SECONDS_PER_FRAME, 0, []
    for start, end, tokens in pieces:
        count, saved, chosen = len([t for t in tokens if t < model.end_id]), 0, []
        while index < len(words) and saved < count:
            timing = words[index]
            if timing["word"]:
                chosen.append(dict(word=timing["word"], start=round(offset + timing["start"], 2),
                                   end=round(offset + timing["end"], 2)))
            saved, index = saved + len(timing["tokens"]), index + 1
        if chosen:
            first = chosen[0]
            if first["end"] - last_speech > median * 4 and (first["end"] - first["start"] > longest or (
                    len(chosen) > 1 and chosen[1]["end"] - first["start"] > longest * 2)):
                if len(chosen) > 1 and chosen[1]["end"] - chosen[1]["start"] > longest:
                    first["end"] = chosen[1]["start"] = max(chosen[1]["end"] / 2, chosen[1]["end"] - longest)
                first["start"] = max(0, first["end"] - longest)
            if start < first["end"] and start - 0.5 > first["start"]:
                first["start"] = max(0, min(first["end"] - median, start))
            else:
                start = first["start"]
            if end > chosen[-1]["start"] and end + 0.5 < chosen[-1]["end"]:
                chosen[-1]["end"] = max(chosen[-1]["start"] + median, end)
            else:
                end = chosen[-1]["end"]
            last_speech = end
        result.append((start, end, tokens, tuple(Word(w["start"], w["end"], w["word"]) for w in chosen)))
    return result, last_speech


def _words_and_seek(model, features, pieces, window_frames, seek, next_seek, tokens, timestamp_begin, last_speech):
    """With word timestamps: the pieces with their words, the next window's start (the last word's end unless the
    window ended with a lone timestamp) and the end of the last speech."""
    pieces, _ = add_word_timestamps(model, features, pieces, window_frames, seek, last_speech)
    single_ending = len(tokens) >= 2 and tokens[-2] < timestamp_begin <= tokens[-1]
    last_end = next((w.end for piece in reversed(pieces) for w in reversed(piece[3])),
                    pieces[-1][1] if pieces else None)
    if not single_ending and last_end is not None and last_end > seek * SECONDS_PER_FRAME:
        next_seek = timestamps.next_seek(seek, round(last_end / SECONDS_PER_FRAME), window_frames)
    return pieces, next_seek, last_speech if last_end is None else last_end
