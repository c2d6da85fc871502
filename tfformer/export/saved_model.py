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

from tfformer.data import placeholders
from tfformer.export import signatures as sig
from tfformer.generation.decode import decode_fn
from tfformer.models.sentence_encoder import SentenceEncoder

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


def _endpoints(model, tokenizer, max_new_tokens, beam_size):
    """{name: (fn, input_signature)} for the model's architecture."""
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
    if architecture == "seq2seq":
        decode = decode_fn(model, max_new_tokens, beam_size=beam_size)
        names = ("encoder_token_ids", "decoder_token_ids")
        ids_inputs = {name: sig.ids_spec(name) for name in names}
        output_name, keep = sig.TRANSLATION, lambda ids: ids[:, :limit]  # noqa: E731  (source truncated to the model)
    elif architecture == "causal_lm":
        decode = decode_fn(model, max_new_tokens, beam_size=beam_size)
        ids_inputs = {sig.TOKEN_IDS: sig.ids_spec(sig.TOKEN_IDS)}
        output_name, keep = sig.CONTINUATION, lambda ids: ids[:, -(limit - max_new_tokens):]  # noqa: E731  (last tokens)
    else:
        raise ValueError(f"No string signature for architecture {architecture!r}; export seq2seq, causal_lm or a SentenceEncoder.")
    if tokenizer is None:
        raise ValueError("`tokenizer` is required to export a text-in signature (the run's SubwordTokenizer).")

    def serve_text(text):
        text = _clean_text(text)
        if architecture == "seq2seq":  # placeholders, edge whitespace and accelerators are masked, then restored
            masked = placeholders.mask_tf(text)
            text = masked["text"]
        ragged = keep(tokenizer.tokenize(text))
        lengths = ragged.row_lengths()
        if architecture == "seq2seq":
            ids = tf.pad(ragged.to_tensor(), [[0, 0], [0, 1]])  # (B, L+1): one padding column keeps L >= 1
        else:
            ids = ragged.to_tensor()  # right-padded prompts (B, L)
            ids = tf.pad(ids, [[0, 0], [0, tf.maximum(0, 1 - tf.shape(ids)[1])]])
            # An empty prompt gets a start token so the batch still decodes; its output is blanked below.
            first = tf.equal(tf.range(tf.shape(ids)[1]), 0)[None, :]
            ids = tf.where(tf.equal(lengths, 0)[:, None] & first, 2, ids)
        new_ids = decode(ids)
        text_out = tf.where(tf.equal(lengths, 0), "", tokenizer.detokenize(new_ids))
        if architecture == "seq2seq":
            text_out = placeholders.restore_tf(masked, text_out)
        return {output_name: text_out}

    def predict_ids(inputs):
        return {sig.LOGITS: model(inputs)}

    def generate(inputs):
        return {sig.TOKEN_IDS: decode(inputs[next(iter(inputs))])}

    first = next(iter(ids_inputs))
    return {
        sig.SERVING_DEFAULT: (serve_text, [sig.text_spec()]),
        sig.PREDICT_IDS: (predict_ids, [ids_inputs]),
        sig.GENERATE_IDS: (generate, [{first: sig.ids_spec(first)}]),
    }, [tokenizer]


def saved_model(model, base_path, version=None, tokenizer=None, max_new_tokens=64, beam_size=None):
    """Export `model` for TF Serving as `base_path/<version>/`; returns that path.

    Signatures (each returns a dict): `serving_default` takes raw strings `text`
    `(B,)` and returns `translation` (seq2seq), `continuation` (causal LM) or
    `embedding` (SentenceEncoder), tokenizer and decode loop inside the graph;
    `predict_ids` takes token ids and returns `logits` (`embedding` for a
    SentenceEncoder, whose ids come with `padding_mask`); `generate_ids` returns
    generated ids. Loading needs only `tensorflow` and `tensorflow_text`. A seq2seq `serving_default` masks
    placeholders, edge whitespace and accelerator marks before the model and restores them after, in graph ops
    (`tfformer.data.placeholders.mask_tf`/`restore_tf`): the same strings as `translation.translate_texts`.

    Args:
        model: a tfformer model, or a run directory (`model.keras` + `tokenizer.model`).
        base_path: the model's base path (TF Serving's `--model_base_path`).
        version: int. Defaults to one more than the highest existing version.
            An existing version is never overwritten.
        tokenizer: the `SubwordTokenizer` for text signatures (read from the run directory if omitted).
        max_new_tokens: int. Generation length of the text signatures.
        beam_size: int. Beam search instead of greedy in the text signatures.
    """
    if isinstance(model, (str, os.PathLike)):
        from tfformer.data.tokenizers import SubwordTokenizer

        run_dir = os.fspath(model)
        if not os.path.exists(os.path.join(run_dir, "model.keras")):
            raise ValueError(f"No model.keras in run directory {run_dir!r}.")
        model = keras.models.load_model(os.path.join(run_dir, "model.keras"), safe_mode=True)
        if tokenizer is None and os.path.exists(os.path.join(run_dir, "tokenizer.model")):
            tokenizer = SubwordTokenizer.load(os.path.join(run_dir, "tokenizer.model"))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"`max_new_tokens` must be a positive integer. Received: max_new_tokens={max_new_tokens!r}")
    os.makedirs(base_path, exist_ok=True)
    _remove_stale_temporaries(base_path)
    existing = _versions(base_path)
    if version is None:
        version = (existing[-1] if existing else 0) + 1
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"`version` must be a non-negative integer. Received: version={version!r}")
    final = os.path.join(base_path, str(version))
    if os.path.exists(final):
        raise ValueError(f"Version {version} already exists at {final}; versions are never overwritten. Existing: {existing}")

    endpoints, resources = _endpoints(model, tokenizer, max_new_tokens, beam_size)
    archive = keras.export.ExportArchive()
    archive.track(model)
    for resource in resources:
        archive.track(resource)
    for name, (fn, spec) in endpoints.items():
        archive.add_endpoint(name, fn, input_signature=spec)
    tmp = os.path.join(base_path, f".tmp-{version}-{os.getpid()}")
    try:
        archive.write_out(tmp, verbose=False)
        _fsync_tree(tmp)
        if os.path.exists(final):  # another exporter won the race for this number
            raise ValueError(f"Version {version} appeared at {final} during export; not overwritten.")
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
