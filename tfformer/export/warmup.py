"""TF Serving's SavedModel warm-up records: `assets.extra/tf_serving_warmup_requests` in a version directory.

The file is a TFRecord of `tensorflow.serving.PredictionLog` protos. When TF Serving loads a version, it replays each
record (predict, classify, regress and multi-inference ones; at most 1000 records) against the new version and only
then marks it AVAILABLE (servables/tensorflow/saved_model_warmup{,_util}.cc; `tfformer serve` does the same, in
`tfformer.serving.warmup`). The first call of a SavedModel signature builds and optimises its graph: a decode loop
takes seconds (SmolLM2-135M: 17 s for a first 64-token request against 1.9 s warm), so without warm-up the first
client pays for it.

`saved_model` writes one `predict_log` record per signature and batch size (`BATCH_SIZES` by default), with
representative inputs: sample sentences for `text`, token ids of the model's vocabulary, a one-second tone for a
waveform and its log-mel features. `generate_text` gets one record per compiled decode length
(`saved_model.decode_sizes`), so every `max_new_tokens` branch runs once.
"""

import os

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import prediction_log_pb2

from tfformer.checks import check_int, is_int
from tfformer.data import audio
from tfformer.export import signatures as sig
from tfformer.files import atomic_path
from tfformer.tokens import END_ID

WARMUP_DIRECTORY = "assets.extra"  # tensorflow/cc/saved_model/constants.h kSavedModelAssetsExtraDirectory
WARMUP_FILE_NAME = "tf_serving_warmup_requests"  # WarmupConsts::kRequestsFileName
WARMUP_FILE = os.path.join(WARMUP_DIRECTORY, WARMUP_FILE_NAME)
MAX_RECORDS = 1000  # WarmupConsts::kMaxNumRecords: TF Serving fails the load of a version with more
# The batch sizes each signature is warmed up with: one request alone, and a batch as the server's batcher forms
# them under load (TF Serving pads a merged batch up to one of its `allowed_batch_sizes`).
BATCH_SIZES = (1, 8)
IDS_LENGTH = 16  # token ids per row in the ids signatures' records (fewer if the model holds fewer)
SAMPLE_TEXTS = (
    "Open the file.",
    "The document could not be saved: %s",
    "Do you want to close all windows?",
    "Hello world",
    "Click the button below to restart the application now.",
    "Error",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Where is the nearest train station?",
)
TONE_SECONDS = 1.0  # the waveform of a speech model's records: a one-second tone at 16 kHz


def signature_defs(path):
    """`{key: SignatureDef}` of the `serve` MetaGraphDef in `path/saved_model.pb`, without the init op."""
    saved_model = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as handle:
        saved_model.ParseFromString(handle.read())
    for meta_graph in saved_model.meta_graphs:
        if "serve" in meta_graph.meta_info_def.tags:
            return {key: value for key, value in meta_graph.signature_def.items() if value.method_name}
    raise ValueError(f"SavedModel at {path} has no MetaGraphDef tagged 'serve'.")


def predict_log(signature_name, inputs, model_name=""):
    """A `PredictionLog` whose `predict_log.request` runs `signature_name` on `inputs` ({alias: array})."""
    record = prediction_log_pb2.PredictionLog()
    request = record.predict_log.request
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    for alias, value in inputs.items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return record


def _tone(rows, samples):
    """`(rows, samples)` float32: a quiet 440 Hz tone with a rising second partial, a different phase per row."""
    t = np.arange(samples, dtype=np.float64) / audio.SAMPLE_RATE
    phase = np.arange(rows, dtype=np.float64)[:, None]
    wave = 0.1 * np.sin(2 * np.pi * 440 * t + phase) + 0.05 * np.sin(2 * np.pi * (600 + 400 * t) * t)
    return wave.astype(np.float32)  # (rows, samples)


class _Inputs:
    """The inputs of one record for `rows` rows, by alias and TensorInfo (dtype, shape)."""

    def __init__(self, vocabulary_size, ids_length, rows, count):
        self.vocabulary_size, self.ids_length, self.rows, self.count = vocabulary_size, ids_length, rows, count
        self.samples = int(TONE_SECONDS * audio.SAMPLE_RATE)

    def value(self, alias, info):
        dims = [dim.size for dim in info.tensor_shape.dim]
        if info.dtype == types_pb2.DT_STRING and len(dims) == 1:
            return np.array([SAMPLE_TEXTS[row % len(SAMPLE_TEXTS)].encode() for row in range(self.rows)], object)
        if info.dtype == types_pb2.DT_INT32 and len(dims) == 1 and alias == sig.MAX_NEW_TOKENS and self.count:
            return np.full([self.rows], self.count, np.int32)
        if info.dtype == types_pb2.DT_INT32 and len(dims) == 1 and alias == sig.LENGTHS:  # samples per waveform row
            return np.full([self.rows], self.samples, np.int32)
        if info.dtype == types_pb2.DT_INT32 and len(dims) == 2:
            if alias == "padding_mask":
                return np.ones([self.rows, self.ids_length], np.int32)
            # Ids of the vocabulary past the special ones, spread over it, different in each row.
            first = min(END_ID + 1, self.vocabulary_size - 1)
            steps = np.arange(self.rows * self.ids_length).reshape(self.rows, self.ids_length) * 7919
            return (first + steps % (self.vocabulary_size - first)).astype(np.int32)  # (rows, ids_length)
        if info.dtype == types_pb2.DT_FLOAT and len(dims) == 2:  # a waveform
            return _tone(self.rows, self.samples)
        if info.dtype == types_pb2.DT_FLOAT and len(dims) == 3 and dims[2] == audio.NUM_MEL_BINS:  # log-mel features
            features, _ = audio.log_mel_spectrogram(_tone(self.rows, self.samples), num_frames=dims[1])
            return features.numpy()  # (rows, frames, mel bins)
        raise ValueError(f"No warm-up value for input {alias!r} of dtype "
                         f"{types_pb2.DataType.Name(info.dtype)} and shape {dims}; pass `warmup_batch_sizes=()` to "
                         "export without warm-up records.")


def requests(signatures, vocabulary_size, batch_sizes=BATCH_SIZES, ids_length=IDS_LENGTH, counts=(),
             model_name=""):
    """The warm-up records of a SavedModel: `PredictionLog`s, batch size 1 first.

    Args:
        signatures: `{key: SignatureDef}` (`signature_defs`).
        vocabulary_size: int. Token ids in the records are below it.
        batch_sizes: ints. One record per signature and batch size.
        ids_length: int. Token ids per row.
        counts: ints. The values of a `max_new_tokens` input: one record each at the first batch size (every
            compiled decode length), the smallest at the others (a graph is built once for every batch size: the
            larger batches need not pay for the longest loop again).
        model_name: str. The `model_spec.name` of the requests (TF Serving ignores it in warm-up).
    """
    check_int("vocabulary_size", vocabulary_size, minimum=2)
    check_int("ids_length", ids_length)
    if not batch_sizes or not all(is_int(size) and size >= 1 for size in batch_sizes):
        raise ValueError(f"`batch_sizes` must be ints >= 1. Received: batch_sizes={batch_sizes!r}")
    if not all(is_int(count) and count >= 1 for count in counts):
        raise ValueError(f"`counts` must be ints >= 1. Received: counts={counts!r}")
    plan = []  # (signature key, rows, max_new_tokens or None) of each record
    for index, rows in enumerate(batch_sizes):
        for key in sorted(signatures, key=lambda key: (key != sig.SERVING_DEFAULT, key)):
            variants = [None]
            if sig.MAX_NEW_TOKENS in signatures[key].inputs and counts:
                variants = list(counts) if index == 0 else [min(counts)]  # every count alone, the shortest batched
            plan += [(key, rows, count) for count in variants]
    if len(plan) > MAX_RECORDS:  # checked before any input is made: a batch of features is large
        raise ValueError(f"{len(plan)} warm-up records; TF Serving accepts at most {MAX_RECORDS}. Pass fewer "
                         f"`warmup_batch_sizes`. Received: batch_sizes={batch_sizes!r}")
    records = []
    for key, rows, count in plan:
        maker = _Inputs(vocabulary_size, ids_length, rows, count)
        inputs = {alias: maker.value(alias, info) for alias, info in sorted(signatures[key].inputs.items())}
        records.append(predict_log(key, inputs, model_name))
    return records


def write(version_dir, records):
    """Writes `records` (`PredictionLog`s) to `version_dir/assets.extra/tf_serving_warmup_requests` (a TFRecord,
    written whole or not at all); returns its path."""
    if len(records) > MAX_RECORDS:
        raise ValueError(f"TF Serving accepts at most {MAX_RECORDS} warm-up records. Received: {len(records)}")
    os.makedirs(os.path.join(version_dir, WARMUP_DIRECTORY), exist_ok=True)
    path = os.path.join(version_dir, WARMUP_FILE)
    with atomic_path(path) as tmp:
        with tf.io.TFRecordWriter(tmp) as writer:
            for record in records:
                writer.write(record.SerializeToString())
    return path


def read(version_dir):
    """The `PredictionLog`s of `version_dir`'s warm-up file, in order ([] without one)."""
    path = os.path.join(version_dir, WARMUP_FILE)
    if not os.path.isfile(path):
        return []
    return [prediction_log_pb2.PredictionLog.FromString(record.numpy()) for record in tf.data.TFRecordDataset(path)]
