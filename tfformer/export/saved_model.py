"""SavedModels in TensorFlow Serving's layout: `base_path/<version>/`, published atomically.

The export is written to a hidden sibling directory `base_path/.tmp-<version>-<pid>`,
fsynced, then renamed to `base_path/<version>`. TF Serving only picks up
numeric children, so a poller never sees a half-written version, and a version
number is never reused. If the export fails, the temporary directory is removed;
if the process is killed, it is left behind under its non-numeric name and
removed by the next export to the same base path.
"""

import os
import re
import shutil

import keras
import tensorflow as tf

from tfformer.checks import check_int, is_int
from tfformer.data import audio, placeholders
from tfformer.export import signatures as sig
from tfformer.export import speech_segments, warmup
from tfformer.generation.decode import decode_fn
from tfformer.models.whisper_decode import speech_decode_fn
from tfformer.models.presets import from_preset
from tfformer.models.sentence_encoder import SentenceEncoder
from tfformer.models.task import Task
from tfformer.models.whisper import WhisperModel
from tfformer.tokens import END_ID, PAD_ID, START_ID

_TMP = re.compile(r"^\.tmp-(\d+)-(\d+)$")


def _versions(base_path):
    return sorted(int(name) for name in os.listdir(base_path) if name.isdigit()) if os.path.isdir(base_path) else []


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(base_path):
    for name in os.listdir(base_path):
        match = _TMP.match(name)
        if match and not _pid_alive(int(match.group(2))):
            shutil.rmtree(os.path.join(base_path, name), ignore_errors=True)


def _fsync_tree(path):
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _clean_text(text):
    # Non-UTF-8 bytes become U+FFFD instead of failing the request.
    return tf.strings.unicode_transcode(text, "UTF-8", "UTF-8", errors="replace")


def _check_tokenizer(model, tokenizer):
    """A text-in signature's tokenizer: present, with `tokenize`/`detokenize`, ids inside the model's vocabulary."""
    if tokenizer is None:
        raise ValueError("`tokenizer` is required to export a text-in signature: the run's SubwordTokenizer, or a "
                         "BytePairTokenizer (e.g. `BytePairTokenizer.from_gguf(path)` for SmolLM2). Received: "
                         "tokenizer=None")
    if not (callable(getattr(tokenizer, "tokenize", None)) and callable(getattr(tokenizer, "detokenize", None))):
        raise ValueError("`tokenizer` must have `tokenize` and `detokenize` (a SubwordTokenizer or a "
                         f"BytePairTokenizer). Received: tokenizer={tokenizer!r}")
    size = getattr(tokenizer, "vocabulary_size", None)
    if size is not None and size > model.config.vocabulary_size:
        raise ValueError(f"`tokenizer` has {size} ids, more than the model's vocabulary_size="
                         f"{model.config.vocabulary_size}.")


def _end_ids(tokenizer):
    """The ids that end a causal LM's completion: a byte-pair tokenizer's `end_ids` (end of turn, end of text) and
    the padding id 0 (never a token the model continues from; SmolLM2's `<|endoftext|>`), else tfformer's END_ID."""
    ids = list(getattr(tokenizer, "end_ids", None) or [])
    return ids + [PAD_ID] if ids else [END_ID]


def decode_sizes(max_new_tokens):
    """The lengths the text signature's decode loops are compiled for: doubling from 16, up to `max_new_tokens`.

    A request runs the shortest loop that holds its largest `max_new_tokens`, so it costs at most twice the steps
    asked for (or 16), not always the cap."""
    sizes, size = [], 16
    while size < max_new_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_new_tokens]


def _cut(new_ids, end_ids, counts=None):
    """`new_ids` `(B, N)` with every id from a row's first end id on (or from its `counts[b]`-th) set to 0."""
    ended = tf.reduce_any(tf.equal(new_ids[:, :, None], tf.constant(end_ids, tf.int32)), axis=-1)  # (B, N)
    if counts is not None:
        ended |= tf.range(tf.shape(new_ids)[1])[None, :] >= counts[:, None]
    keep = tf.equal(tf.cumsum(tf.cast(ended, tf.int32), axis=1), 0)
    return tf.where(keep, new_ids, PAD_ID)


def _causal_lm_endpoints(model, tokenizer, max_new_tokens, beam_size):
    """serving_default (text), generate_text (text + max_new_tokens per row), predict_ids, generate_ids."""
    limit = model.config.max_sequence_length
    end_ids = _end_ids(tokenizer)
    sizes = decode_sizes(max_new_tokens)
    decoders = {n: decode_fn(model, n, beam_size=beam_size, end_id=end_ids[0]) for n in sizes}

    def prompts(text):
        ragged = tokenizer.tokenize(_clean_text(text))
        ragged = tf.ragged.boolean_mask(ragged, tf.not_equal(ragged, PAD_ID))  # id 0 is padding to the model
        ragged = ragged[:, -(limit - max_new_tokens):]  # the last tokens: room for the new ones
        lengths = ragged.row_lengths()
        ids = ragged.to_tensor()  # right-padded prompts (B, L)
        ids = tf.pad(ids, [[0, 0], [0, tf.maximum(0, 1 - tf.shape(ids)[1])]])
        # An empty prompt gets a placeholder token so the batch still decodes; its output is blanked.
        first = tf.equal(tf.range(tf.shape(ids)[1]), 0)[None, :]
        ids = tf.where(tf.equal(lengths, 0)[:, None] & first, START_ID, ids)
        return ids, tf.equal(lengths, 0)

    def completions(new_ids, empty, counts=None):
        ids = tf.RaggedTensor.from_tensor(_cut(new_ids, end_ids, counts), padding=PAD_ID)
        return tf.where(empty, "", tokenizer.detokenize(ids))

    def serve_text(text):
        ids, empty = prompts(text)
        return {sig.CONTINUATION: completions(decoders[max_new_tokens](ids), empty)}

    def generate_text(text, counts):  # counts: the `max_new_tokens` input, (B,)
        checks = [
            tf.debugging.assert_equal(tf.size(counts), tf.size(text), message=(
                f"`{sig.MAX_NEW_TOKENS}` must hold one count per text")),
            tf.debugging.assert_positive(counts, message=f"`{sig.MAX_NEW_TOKENS}` must be >= 1"),
            tf.debugging.assert_less_equal(counts, max_new_tokens, message=(
                f"`{sig.MAX_NEW_TOKENS}` must be <= {max_new_tokens}, the cap this model was exported with")),
        ]
        with tf.control_dependencies(checks):
            ids, empty = prompts(text)
        # The shortest compiled loop that holds the longest request; every branch pads to the cap.
        branch = tf.reduce_sum(tf.cast(tf.constant(sizes) < tf.reduce_max(counts), tf.int32))
        new_ids = tf.switch_case(branch, [
            (lambda n=n: tf.pad(decoders[n](ids), [[0, 0], [0, max_new_tokens - n]])) for n in sizes])  # (B, cap)
        return {sig.CONTINUATION: completions(new_ids, empty, counts)}

    def predict_ids(inputs):
        return {sig.LOGITS: model(inputs)}

    def generate(inputs):
        return {sig.TOKEN_IDS: decoders[max_new_tokens](inputs[sig.TOKEN_IDS])}

    return {
        sig.SERVING_DEFAULT: (serve_text, [sig.text_spec()]),
        sig.GENERATE_TEXT: (generate_text, [sig.text_spec(), sig.count_spec()]),
        sig.PREDICT_IDS: (predict_ids, [{sig.TOKEN_IDS: sig.ids_spec(sig.TOKEN_IDS)}]),
        sig.GENERATE_IDS: (generate, [{sig.TOKEN_IDS: sig.ids_spec(sig.TOKEN_IDS)}]),
    }, [tokenizer]


def speech_max_new_tokens(model):
    """The default tokens per window of a Whisper export: all the decoder holds after the prompt."""
    return model.config.max_sequence_length - len(model.prompt)


def _waveform_checks(waveform, lengths):
    """The checks of a speech signature's `waveform` `(B, N)` and `lengths` `(B,)`: assert ops to run first."""
    return [
        tf.debugging.assert_equal(tf.size(lengths), tf.shape(waveform)[0], message=(
            f"`{sig.LENGTHS}` must hold one sample count per `{sig.WAVEFORM}` row")),
        tf.debugging.assert_non_negative(lengths, message=f"`{sig.LENGTHS}` must be >= 0"),
        tf.debugging.assert_less_equal(lengths, tf.shape(waveform)[1], message=(
            f"`{sig.LENGTHS}` must be <= the `{sig.WAVEFORM}` width (samples per row)")),
        tf.debugging.assert_all_finite(waveform, f"`{sig.WAVEFORM}` must hold finite samples (no NaN or inf)"),
    ]


def _speech_endpoints(model, tokenizer, max_new_tokens, beam_size):
    """serving_default (waveform + lengths -> text), segments (-> timestamped segments), generate_ids (log-mel
    features -> ids), predict_ids (logits)."""
    if beam_size is not None:
        raise ValueError(f"A Whisper export decodes greedily; beam search runs in `WhisperModel.transcribe("
                         f"beam_size=...)`. Received: beam_size={beam_size!r}")
    _check_tokenizer(model, tokenizer)
    limit = speech_max_new_tokens(model)
    if max_new_tokens > limit:
        raise ValueError(f"`max_new_tokens` must be at most {limit}: the decoder's max_sequence_length="
                         f"{model.config.max_sequence_length} minus the {len(model.prompt)} prompt ids. Received: "
                         f"max_new_tokens={max_new_tokens}")
    config = model.config
    end_id = model.end_id
    decode = speech_decode_fn(model, max_new_tokens, model.prompt, model.suppress_ids, model.suppress_ids_begin, end_id)
    num_frames = 2 * config.max_source_positions  # the encoder's window: 3000 frames, 30 s

    def transcripts(ids):
        # As `WhisperModel.ids_to_text`: the ids before the first end id, without special tokens (>= end_id).
        before_end = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, end_id), tf.int32), axis=1), 0)  # (B, N)
        text_ids = tf.ragged.boolean_mask(ids, before_end & (ids < end_id))  # (B, None)
        return tf.strings.strip(tokenizer.detokenize(text_ids))

    def serve(waveform, lengths):
        with tf.control_dependencies(_waveform_checks(waveform, lengths)):
            # One 30-second window per row, normalised over that window as `WhisperModel.transcribe` does.
            window = waveform[:, :audio.WINDOW_SAMPLES]  # (B, min(N, 480000))
            lengths = tf.minimum(lengths, audio.WINDOW_SAMPLES)
        features, _ = audio.log_mel_spectrogram(window, lengths, num_frames=num_frames)  # (B, 3000, M)
        text = transcripts(decode(features))
        return {sig.TEXT: tf.where(tf.equal(lengths, 0), "", text)}  # no audio, no words

    def generate(inputs):
        return {sig.TOKEN_IDS: decode(inputs[sig.INPUT_FEATURES])}

    def predict_ids(inputs):
        return {sig.LOGITS: model(inputs)}

    features = sig.features_spec(num_frames, config.num_mel_bins)
    return {
        sig.SERVING_DEFAULT: (serve, [sig.waveform_spec(), sig.count_spec(sig.LENGTHS)]),
        sig.SEGMENTS: speech_segments.segments_endpoint(model, tokenizer, max_new_tokens, _waveform_checks),
        sig.GENERATE_IDS: (generate, [{sig.INPUT_FEATURES: features}]),
        sig.PREDICT_IDS: (predict_ids, [{sig.INPUT_FEATURES: features,
                                         sig.DECODER_TOKEN_IDS: sig.ids_spec(sig.DECODER_TOKEN_IDS)}]),
    }, [tokenizer]


def _endpoints(model, tokenizer, max_new_tokens, beam_size):
    """{name: (fn, input_signature)} for the model's architecture."""
    if isinstance(model, WhisperModel):
        return _speech_endpoints(model, tokenizer, max_new_tokens, beam_size)
    if isinstance(model, SentenceEncoder):
        tokenizer = tokenizer or model.tokenizer

        def serve_text(text):
            return {sig.EMBEDDING: model(tokenizer(_clean_text(text)))}

        ids = {sig.TOKEN_IDS: sig.ids_spec(sig.TOKEN_IDS), "padding_mask": sig.ids_spec("padding_mask")}
        return {
            sig.SERVING_DEFAULT: (serve_text, [sig.text_spec()]),
            sig.PREDICT_IDS: (lambda inputs: {sig.EMBEDDING: model(inputs)}, [ids]),
        }, [tokenizer]

    architecture = model.config.architecture
    limit = model.config.max_sequence_length
    if architecture == "speech_seq2seq":
        raise ValueError(f"A speech_seq2seq model is exported through `tfformer.models.WhisperModel` (its prompt, "
                         f"suppression and end id). Received: model={type(model).__name__}")
    if architecture not in ("seq2seq", "causal_lm"):
        raise ValueError(f"No string signature for architecture {architecture!r}; export seq2seq, causal_lm or a "
                         "SentenceEncoder.")
    _check_tokenizer(model, tokenizer)
    if architecture == "causal_lm":
        if max_new_tokens >= limit:
            raise ValueError(f"`max_new_tokens` must be below the model's max_sequence_length={limit} (the cache holds "
                             f"the prompt and the new tokens). Received: max_new_tokens={max_new_tokens}")
        return _causal_lm_endpoints(model, tokenizer, max_new_tokens, beam_size)
    if max_new_tokens > limit and model.config.position == "learned":
        raise ValueError(f"`max_new_tokens` must be at most the model's max_sequence_length={limit} (learned "
                         f"positions). Received: max_new_tokens={max_new_tokens}")
    decode = decode_fn(model, max_new_tokens, beam_size=beam_size)
    names = ("encoder_token_ids", "decoder_token_ids")
    ids_inputs = {name: sig.ids_spec(name) for name in names}

    def serve_text(text):
        # Placeholders, edge whitespace and accelerators are masked, then restored.
        masked = placeholders.mask_tf(_clean_text(text))
        ragged = tokenizer.tokenize(masked["text"])[:, :limit]  # source truncated to the model
        lengths = ragged.row_lengths()
        ids = tf.pad(ragged.to_tensor(), [[0, 0], [0, 1]])  # (B, L+1): one padding column keeps L >= 1
        new_ids = decode(ids)
        text_out = tf.where(tf.equal(lengths, 0), "", tokenizer.detokenize(new_ids))
        return {sig.TRANSLATION: placeholders.restore_tf(masked, text_out)}

    def predict_ids(inputs):
        return {sig.LOGITS: model(inputs)}

    def generate(inputs):
        return {sig.TOKEN_IDS: decode(inputs[names[0]])}

    return {
        sig.SERVING_DEFAULT: (serve_text, [sig.text_spec()]),
        sig.PREDICT_IDS: (predict_ids, [ids_inputs]),
        sig.GENERATE_IDS: (generate, [{names[0]: sig.ids_spec(names[0])}]),
    }, [tokenizer]


def _warmup_records(model, path, max_new_tokens, batch_sizes):
    """The warm-up records of the SavedModel written at `path` (`warmup.requests`): every signature at each of
    `batch_sizes`, a causal LM's `generate_text` at every compiled decode length."""
    config = model.transformer_config
    causal = config.architecture == "causal_lm"
    ids_length = min(warmup.IDS_LENGTH, config.max_sequence_length - (max_new_tokens if causal else 0))
    return warmup.requests(warmup.signature_defs(path), config.vocabulary_size, batch_sizes, ids_length,
                           counts=decode_sizes(max_new_tokens) if causal else ())


def saved_model(model, base_path, version=None, tokenizer=None, max_new_tokens=None, beam_size=None,
                warmup_batch_sizes=None):
    """Export `model` for TF Serving as `base_path/<version>/`; returns that path.

    Signatures (each returns a dict): `serving_default` takes raw strings `text`
    `(B,)` and returns `translation` (seq2seq), `continuation` (causal LM) or
    `embedding` (SentenceEncoder), tokenizer and decode loop inside the graph;
    `predict_ids` takes token ids and returns `logits` (`embedding` for a
    SentenceEncoder, whose ids come with `padding_mask`); `generate_ids` returns
    generated ids. Loading needs only `tensorflow` and `tensorflow_text`. A seq2seq `serving_default` masks
    placeholders, edge whitespace and accelerator marks before the model and restores them after, in graph ops
    (`tfformer.data.placeholders.mask_tf`/`restore_tf`): the same strings as `translation.translate_texts`.

    A causal LM also gets `generate_text`: `text` `(B,)` and `max_new_tokens` `(B,)` int32 (one count per text,
    each in `[1, max_new_tokens]` of this export) -> `continuation`. Its decode loops are compiled for
    `max_new_tokens` and for shorter lengths doubling from 16 (`decode_sizes`); a request runs the shortest that
    holds its largest count and each row is cut to its own. A completion ends before the first end id: a
    `BytePairTokenizer`'s `end_ids` (SmolLM2: `<|im_end|>`) and id 0 (padding to the model; SmolLM2's
    `<|endoftext|>`), or END_ID for a `SubwordTokenizer`; ids 0 in a prompt are dropped. Prompts keep their last
    `max_sequence_length - max_new_tokens` tokens. Over REST: `{"signature_name": "generate_text",
    "instances": [{"text": "...", "max_new_tokens": 8}]}`, or the columnar `inputs` form with two lists.

    A `WhisperModel` (speech to text) gets `serving_default`: `waveform` `(B, N)` float32 16 kHz mono samples
    (rows right-padded) and `lengths` `(B,)` int32 (valid samples per row) -> `text` `(B,)`, with Whisper's log-mel
    front end, encoder, greedy decode loop (the model's `prompt`, `suppress_ids`, `suppress_ids_begin`, `end_id`) and
    the byte-level BPE detokenizer all in the graph, the same transcript as `WhisperModel.transcribe` gives a
    waveform of at most 30 seconds. Each row is ONE 30-second window: samples past 30 s are ignored (cut long audio
    into windows before, as `transcribe` does with `tfformer.data.audio.split_windows`); a row of length 0 gives "".
    Also `generate_ids` (`input_features` `(B, 3000, 80)` log-mel features -> `token_ids` `(B, max_new_tokens)`,
    `end_id`-filled after the end) and `predict_ids` (`input_features`, `decoder_token_ids` -> `logits`).

    A `WhisperModel` also gets `segments`, the timestamped transcript: the inputs of its `serving_default` ->
    `segment_text` `(B, S)` string (stripped), `segment_start` and `segment_end` `(B, S)` float32 seconds from the
    row's first sample, `num_segments` `(B,)` int32, and per row `avg_logprob` (the mean log-probability of the
    window's tokens, the end token counted) and `no_speech_prob` (of `<|nospeech|>`) `(B,)` float32. `S` is the
    batch's largest `num_segments`; a row's slots past its count hold "" and 0.0. Each row is ONE 30-second window
    (its first 30 s, in whole 10-ms frames), decoded greedily with Whisper's timestamp rules from the start sequence
    (the `prompt` without `<|notimestamps|>`), at most `max_new_tokens` and half the decoder's positions (224 ids for
    tiny.en), and cut in the graph as `WhisperModel.transcribe(..., timestamps=True)` cuts a window that starts the
    recording (`tfformer.models.transcript.split_by_timestamps`, faster-whisper's cut): a segment per pair of
    timestamps, times on the 0.02-s grid; without a pair, one segment from 0 to the last timestamp. A row's ids
    that end after the last pair without a closing timestamp make a last segment ending at the row's end (the
    Python path drops it and decodes that audio again in a new window). A row of fewer than 160 samples, or a
    window that is silence by faster-whisper's test (`no_speech_prob` > 0.6 and `avg_logprob` <= -1), gives no
    segments; so does a segment without text. What it does not do, and `transcribe(..., timestamps=True)` does:
    windows past the first 30 s, conditioning a window on the text before it, the temperature fallback for a
    window that repeats itself or has `avg_logprob` < -1, and word timestamps. For a row of at most 30 s whose
    window needs none of these, the segments are the Python path's. With `segments` over REST, each row of
    `predictions` is `{"segment_text": [...], "segment_start": [...], ...}`: `{"signature_name": "segments",
    "instances": [{"waveform": [...], "lengths": n}]}`.

    Args:
        model: a tfformer task, or a preset (run) directory.
        base_path: the model's base path (TF Serving's `--model_base_path`).
        version: int. Defaults to one more than the highest existing version.
            An existing version is never overwritten.
        tokenizer: the `SubwordTokenizer` or `BytePairTokenizer` of the text signatures; defaults to the task's
            `preprocessor`.
        max_new_tokens: int or None. Generation length of `serving_default` and `generate_ids`, and the largest
            `max_new_tokens` `generate_text` accepts. A causal LM needs it below `max_sequence_length`. None: 64,
            or for a Whisper model every position the decoder has after its prompt (446 for tiny.en); its loop
            stops when every row has ended.
        beam_size: int. Beam search instead of greedy in the text signatures (not for a Whisper model).
        warmup_batch_sizes: ints. The batch sizes of the TF Serving warm-up records written to
            `assets.extra/tf_serving_warmup_requests` (`tfformer.export.warmup`): one request per signature and
            batch size (and per decode length of `generate_text`), replayed by TF Serving and `tfformer serve`
            before the version serves. None (the default): `warmup.BATCH_SIZES`, (1, 8); `()` writes no warm-up
            file.
    """
    if isinstance(model, (str, os.PathLike)):
        run_dir = os.fspath(model)
        if not os.path.exists(os.path.join(run_dir, "model.keras")):
            raise ValueError(f"No model.keras in run directory {run_dir!r}.")
        model = from_preset(run_dir)  # a preset directory: the task with its preprocessor
    if not isinstance(model, Task):
        raise ValueError(f"`model` must be a tfformer task (`tfformer.models`) or a preset directory. "
                         f"Received: model={type(model).__name__}")
    if tokenizer is None:
        tokenizer = getattr(model, "preprocessor", None)
    if max_new_tokens is None:
        max_new_tokens = speech_max_new_tokens(model) if isinstance(model, WhisperModel) else 64
    check_int("max_new_tokens", max_new_tokens)
    if warmup_batch_sizes is None:
        warmup_batch_sizes = warmup.BATCH_SIZES
    if not isinstance(warmup_batch_sizes, (tuple, list)) or not all(
            is_int(size) and size >= 1 for size in warmup_batch_sizes):
        raise ValueError(f"`warmup_batch_sizes` must be a tuple of ints >= 1 (or () for no warm-up records). "
                         f"Received: warmup_batch_sizes={warmup_batch_sizes!r}")
    os.makedirs(base_path, exist_ok=True)
    _remove_stale_temporaries(base_path)
    existing = _versions(base_path)
    if version is None:
        version = (existing[-1] if existing else 0) + 1
    check_int("version", version, minimum=0)
    final = os.path.join(base_path, str(version))
    if os.path.exists(final):
        raise ValueError(f"Version {version} already exists at {final}; versions are never overwritten. Existing: "
                         f"{existing}")

    endpoints, resources = _endpoints(model, tokenizer, max_new_tokens, beam_size)
    archive = keras.export.ExportArchive()
    # Not `track(model)`: the archive saves the variables the endpoints use; tracking the model as well saves every
    # weight a second time (its Keras variables beside their TensorFlow variables), twice the size on disk.
    for resource in resources:
        archive.track(resource)
    for name, (fn, spec) in endpoints.items():
        archive.add_endpoint(name, fn, input_signature=spec)
    tmp = os.path.join(base_path, f".tmp-{version}-{os.getpid()}")
    try:
        archive.write_out(tmp, verbose=False)
        if warmup_batch_sizes:
            warmup.write(tmp, _warmup_records(model, tmp, max_new_tokens, tuple(warmup_batch_sizes)))
        _fsync_tree(tmp)
        if os.path.exists(final):  # another exporter won the race for this number
            raise ValueError(f"Version {version} appeared at {final} during export; not overwritten.")
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
