"""SavedModel warm-up on load: TF Serving's `RunSavedModelWarmup` (servables/tensorflow/saved_model_warmup{,_util}.cc).

A version directory may hold `assets.extra/tf_serving_warmup_requests`, a TFRecord of `PredictionLog` protos
(`tfformer export` writes one: `tfformer.export.warmup`). The manager replays it on the loaded servable before it
marks the version AVAILABLE, so the first client request finds every signature's graph built and optimised. As in
TF Serving:

- No file: nothing to do (logged). Records run one after the other, in file order, each
  `num_request_iterations` times (`--num_request_iterations_for_warmup`; default 1).
- `predict_log`, `classify_log`, `regress_log` and `multi_inference_log` records run their request. A
  `session_run_log` or `predict_streamed_log` record is UNIMPLEMENTED `Unsupported log_type for warmup: N`; a record
  with no log type is skipped.
- A failing request fails the warm-up with the request's status, and so the load (which the manager then retries
  like any failed load). A record that is not a `PredictionLog` is INVALID_ARGUMENT `Failed to parse warmup record:
  ...`; a file that is not a TFRecord is DATA_LOSS `... Please verify your warmup data is in TFRecord format.`; a
  1001st record is INVALID_ARGUMENT `Number of warmup records exceeds the maximum (1000) at <path>` (after it ran).
"""

import logging
import os
import time

import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow_serving.apis import prediction_log_pb2

from tfformer.export.warmup import MAX_RECORDS, WARMUP_FILE
from tfformer.serving.servable import CLASSIFY_METHOD, REGRESS_METHOD
from tfformer.serving.status import Code, ServingError, invalid_argument

log = logging.getLogger("tfformer.serving")

_UNSUPPORTED = ("session_run_log", "predict_streamed_log")


def _examples(model_input):
    """`(examples, context)` of an `tensorflow.serving.Input` (a plain list, or a list with a context)."""
    kind = model_input.WhichOneof("kind")
    if kind == "example_list":
        return list(model_input.example_list.examples), None
    if kind == "example_list_with_context":
        return list(model_input.example_list_with_context.examples), model_input.example_list_with_context.context
    raise invalid_argument("Input is empty.")


def run_request(servable, record):
    """Runs one warm-up `PredictionLog` on `servable` (`RunWarmupRequest`); the responses are dropped."""
    kind = record.WhichOneof("log_type")
    if kind == "predict_log":
        request = record.predict_log.request
        inputs = {alias: tf.make_ndarray(proto) for alias, proto in request.inputs.items()}
        servable.predict(request.model_spec.signature_name, inputs, list(request.output_filter))
    elif kind in ("classify_log", "regress_log"):
        request = getattr(record, kind).request
        run = servable.classify if kind == "classify_log" else servable.regress
        run(request.model_spec.signature_name, *_examples(request.input))
    elif kind == "multi_inference_log":
        request = record.multi_inference_log.request
        for task in request.tasks:
            run = {CLASSIFY_METHOD: servable.classify, REGRESS_METHOD: servable.regress}.get(task.method_name)
            if run is None:
                raise ServingError(Code.UNIMPLEMENTED, f"Unsupported signature method_name: {task.method_name}")
            run(task.model_spec.signature_name, *_examples(request.input))
    elif kind in _UNSUPPORTED:
        field = prediction_log_pb2.PredictionLog.DESCRIPTOR.fields_by_name[kind]
        raise ServingError(Code.UNIMPLEMENTED, f"Unsupported log_type for warmup: {field.number}")


def _records(path):
    """The raw records of the TFRecord file at `path`; a file that is not one raises DATA_LOSS."""
    try:
        for record in tf.data.TFRecordDataset(path):
            yield record.numpy()
    except tf.errors.DataLossError as error:
        raise ServingError(Code.DATA_LOSS, f"{error.message}. Please verify your warmup data is in TFRecord "
                                           "format.") from None


def run_warmup(servable, path, num_request_iterations=1):
    """Replays `path/assets.extra/tf_serving_warmup_requests` on `servable`; returns the number of records.

    Args:
        servable: the loaded version (`tfformer.serving.servable.Servable`: `predict`, `classify`, `regress`).
        path: str. The version directory.
        num_request_iterations: int. Runs of each record.

    Raises:
        ServingError: a record's failure, or a bad file (see the module docstring).
    """
    warmup_path = os.path.join(path, WARMUP_FILE)
    if not os.path.isfile(warmup_path):
        log.info("No warmup data file found at %s", warmup_path)
        return 0
    log.info("Starting to read warmup data for model at %s", warmup_path)
    start, count = time.monotonic(), 0
    for data in _records(warmup_path):
        try:
            record = prediction_log_pb2.PredictionLog.FromString(data)
        except DecodeError:
            raise invalid_argument(f"Failed to parse warmup record: {data.decode('utf-8', 'replace')} from "
                                   f"{warmup_path}") from None
        for _ in range(max(1, num_request_iterations)):
            run_request(servable, record)
        count += 1
        if count > MAX_RECORDS:
            raise invalid_argument(f"Number of warmup records exceeds the maximum ({MAX_RECORDS}) at {warmup_path}")
    elapsed = int((time.monotonic() - start) * 1e6)
    log.info("Finished reading warmup data for model at %s. Number of warmup records read: %d. Elapsed time "
             "(microseconds): %d.", warmup_path, count, elapsed)
    return count
