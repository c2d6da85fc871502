"""One loaded model version: its SignatureDefs and how to run them.

Any process that loads our SavedModels must register the TF-Text ops first
(`Op type not registered 'FastWordpieceTokenizeWithOffsets'` otherwise), so
this module imports `tensorflow_text` before anything is loaded.
"""

import collections
import concurrent.futures
import logging
import os
import re

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the TF-Text ops our SavedModels use)
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import classification_pb2, get_model_metadata_pb2, regression_pb2

from tfformer.serving.json_tensor import DEFAULT_SIGNATURE, dtype_name
from tfformer.serving.status import ServingError, failed_precondition, internal, invalid_argument

log = logging.getLogger("tfformer.serving")

PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
# What TensorFlow's eager call of a signature adds around an op's error: "Graph execution error:", then for each node
# "Detected at node N defined at (most recent call last):" and the Python stack where this process traced it (or
# "<stack traces unavailable>"), and " [Op:__inference_...]" at the end. TF Serving's Session::Run reports the op's
# message alone ("<message>\n\t [[{{node N}}]]"); the stack would also show a client the server's files.
_EAGER_ERROR_HEAD = re.compile(r"Graph execution error:\n\n(?:Detected at node [^\n]* defined at \(most recent call "
                               r"last\):\n(?:<stack traces unavailable>\n|(?:(?:  [^\n]*)?\n)+))*")
_EAGER_ERROR_TAIL = re.compile(r" \[Op:[^\]\n]*\]$")


def has_saved_model(path):
    """A version directory is complete once its `saved_model.pb` (or `.pbtxt`) exists."""
    return os.path.isfile(os.path.join(path, "saved_model.pb")) or os.path.isfile(
        os.path.join(path, "saved_model.pbtxt"))


def read_signature_defs(path):
    """The `serve` MetaGraphDef's `signature_def` map, read from `saved_model.pb` (or `.pbtxt`)."""
    saved_model = saved_model_pb2.SavedModel()
    binary = os.path.join(path, "saved_model.pb")
    if os.path.isfile(binary):
        with open(binary, "rb") as handle:
            saved_model.ParseFromString(handle.read())
    else:
        from google.protobuf import text_format

        with open(os.path.join(path, "saved_model.pbtxt")) as handle:
            text_format.Parse(handle.read(), saved_model)
    for meta_graph in saved_model.meta_graphs:
        if "serve" in meta_graph.meta_info_def.tags:
            return dict(meta_graph.signature_def)
    raise ValueError(f"SavedModel at {path} has no MetaGraphDef tagged 'serve'.")


def _tf_dtype_of(array):
    if array.dtype == object or array.dtype.kind in "SU":
        return types_pb2.DT_STRING
    try:
        return tf.as_dtype(array.dtype).as_datatype_enum
    except TypeError:
        return types_pb2.DT_INVALID


def _shape_of(tensor_info):
    if tensor_info.tensor_shape.unknown_rank:
        return None
    return [dim.size for dim in tensor_info.tensor_shape.dim]


def _shape_string(shape):
    return "[" + ",".join(str(size) for size in shape) + "]"


def completed(fn, *args):
    """A finished `concurrent.futures.Future` of `fn(*args)`: its result, or the `ServingError` it raised."""
    future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except ServingError as error:
        future.set_exception(error)
    return future



def op_error_message(message):
    """An op's error message as TF Serving reports it: without `_EAGER_ERROR_HEAD` and `_EAGER_ERROR_TAIL`."""
    head = _EAGER_ERROR_HEAD.match(message)
    return _EAGER_ERROR_TAIL.sub("", message[head.end():] if head else message)

class Deferred(collections.namedtuple("Deferred", ["future", "finish"])):
    """An answer that waits for a batch: `finish(future.result())` makes it once `future` is done."""


def answer(future, finish):
    """`finish(future.result())` if `future` is done (then no one waits), else a `Deferred` of them."""
    return finish(future.result()) if future.done() else Deferred(future, finish)


class Servable:
    """A SavedModel version loaded with `tf.saved_model.load` (tag `serve`).

    Args:
        name: str. The model name.
        version: int. The version number.
        path: str. The version directory (`base_path/<version>`).
    """

    def __init__(self, name, version, path):
        self.name, self.version, self.path = name, int(version), path
        self.signature_defs = read_signature_defs(path)
        self._loaded = tf.saved_model.load(path, tags=["serve"])
        self._functions = {key: self._loaded.signatures[key] for key in self._loaded.signatures.keys()}

    # ---------------------------------------------------------------------------------------
    # Metadata

    def signature_def_map(self):
        """`SignatureDefMap` holding every signature of the MetaGraphDef (as TF Serving returns it)."""
        result = get_model_metadata_pb2.SignatureDefMap()
        for key, signature in self.signature_defs.items():
            result.signature_def[key].CopyFrom(signature)
        return result

    def input_dtypes(self, signature_name):
        """{alias: DataType} of a signature's inputs (the REST `GetInfoMap`)."""
        key = signature_name or DEFAULT_SIGNATURE
        if key not in self.signature_defs:
            raise invalid_argument(f'Serving signature name: "{key}" not found in signature def')
        return {alias: info.dtype for alias, info in self.signature_defs[key].inputs.items()}

    # ---------------------------------------------------------------------------------------
    # Predict

    def predict(self, signature_name, inputs, output_filter=()):
        """Runs a signature (`RunPredict`).

        Args:
            signature_name: str. Empty means `serving_default`.
            inputs: {alias: np.ndarray}.
            output_filter: aliases to return (all outputs when empty).

        Returns:
            `(resolved_signature_name, {alias: np.ndarray})`.
        """
        key, arrays, selected = self.check_predict(signature_name, inputs, output_filter)
        return key, self.run_predict(key, arrays, selected)

    def submit(self, signature_name, inputs, output_filter=()):
        """`predict`, run now, as a finished `Future` (a `batching.BatchingServable` queues it instead)."""
        return completed(self.predict, signature_name, inputs, output_filter)

    def check_predict(self, signature_name, inputs, output_filter=()):
        """The checks of `predict` before the run: `(signature key, {alias: np.ndarray}, [output aliases])`.

        Raises:
            ServingError: as TF Serving answers an unknown signature, missing or extra inputs, a wrong dtype, or an
                unknown or repeated output alias; and a shape the signature does not accept.
        """
        key = signature_name or DEFAULT_SIGNATURE
        signature = self.signature_defs.get(key)
        if signature is None:
            raise failed_precondition(f'Serving signature key "{key}" not found.')
        if signature.method_name not in (PREDICT_METHOD, CLASSIFY_METHOD, REGRESS_METHOD):
            raise internal(f"Expected prediction signature method_name to be one of {{{PREDICT_METHOD}, "
                           f"{CLASSIFY_METHOD}, {REGRESS_METHOD}}}. Was: {signature.method_name}")
        expected = sorted(signature.inputs)
        sent = sorted(inputs)
        if len(sent) != len(expected):
            extra = sorted(set(sent) - set(expected))
            missing = sorted(set(expected) - set(sent))
            raise invalid_argument(
                f"input size does not match signature: {len(sent)}!={len(expected)} len({{{','.join(sent)}}}) "
                f"!= len({{{','.join(expected)}}}). Sent extra: {{{','.join(extra)}}}. "
                f"Missing but required: {{{','.join(missing)}}}.")
        arrays = {}
        for alias in sent:
            if alias not in signature.inputs:
                raise invalid_argument(f"input tensor alias not found in signature: {alias}. Inputs expected to be "
                                       f"in the set {{{','.join(expected)}}}.")
            info, array = signature.inputs[alias], np.asarray(inputs[alias])
            given = _tf_dtype_of(array)
            if given != info.dtype:
                raise invalid_argument(f"Expects arg[{expected.index(alias)}] to be {dtype_name(info.dtype)} but "
                                       f"{dtype_name(given)} is provided")
            shape = _shape_of(info)
            if shape is not None and (len(shape) != array.ndim or any(
                    size >= 0 and size != actual for size, actual in zip(shape, array.shape))):
                raise invalid_argument(f"input tensor alias: {alias} has shape {_shape_string(array.shape)}, which is "
                                       f"not compatible with the signature shape {_shape_string(shape)}")
            arrays[alias] = array
        selected = list(output_filter) or sorted(signature.outputs)
        seen = set()
        for alias in selected:
            if alias not in signature.outputs:
                raise invalid_argument(f"output tensor alias not found in signature: {alias} Outputs expected to be in "
                                       f"the set {{{','.join(sorted(signature.outputs))}}}.")
            if alias in seen:
                raise invalid_argument(f"duplicate output tensor alias: {alias}")
            seen.add(alias)
        return key, arrays, selected

    def run_predict(self, key, arrays, selected):
        """Runs signature `key` on checked inputs (`check_predict`); returns `{alias: np.ndarray}` of `selected`."""
        inputs = self.signature_defs[key].inputs
        tensors = {alias: tf.constant(array, dtype=tf.as_dtype(inputs[alias].dtype)) for alias, array in arrays.items()}
        outputs = self._call(key, tensors)
        return {alias: outputs[alias] for alias in selected}

    def _call(self, key, tensors):
        function = self._functions.get(key)
        if function is None:
            raise internal(f"Signature {key} has no function in the loaded SavedModel.")
        try:
            outputs = function(**tensors)
        except tf.errors.OpError as error:
            raise ServingError(error.error_code, op_error_message(error.message)) from None
        except (TypeError, ValueError) as error:
            raise invalid_argument(str(error)) from None
        if not isinstance(outputs, dict):
            outputs = {"output_0": outputs}
        return {alias: np.asarray(value.numpy() if hasattr(value, "numpy") else value)
                for alias, value in outputs.items()}

    # ---------------------------------------------------------------------------------------
    # Classify / Regress

    def _example_signature(self, signature_name, method, kind, examples):
        key = signature_name or DEFAULT_SIGNATURE
        signature = self.signature_defs.get(key)
        if signature is None:
            raise invalid_argument(f"No signature was found with the name: {key}")
        if signature.method_name != method:
            raise invalid_argument(f"Expected {kind} signature method_name to be {method}. "
                                   f"Was: {signature.method_name}")
        if len(signature.inputs) != 1:
            raise invalid_argument("Expected one input Tensor.")
        if not examples:
            raise invalid_argument("Input is empty.")
        return key, signature

    @staticmethod
    def _serialized(examples, context):
        records = []
        for example in examples:
            if context is not None:
                merged = type(context)()
                merged.CopyFrom(context)
                merged.MergeFrom(example)
                example = merged
            records.append(example.SerializeToString())
        return np.array(records, dtype=object)

    def classify(self, signature_name, examples, context=None):
        """Runs a `tensorflow/serving/classify` signature; returns a `ClassificationResult`."""
        key, signature = self._example_signature(signature_name, CLASSIFY_METHOD, "classification", examples)
        if len(signature.outputs) not in (1, 2) or not set(signature.outputs) <= {"classes", "scores"}:
            raise invalid_argument(f"Expected one or two output Tensors, found {len(signature.outputs)}")
        alias = next(iter(signature.inputs))
        outputs = self._call(key, {alias: tf.constant(self._serialized(examples, context))})
        classes, scores = outputs.get("classes"), outputs.get("scores")
        batch = len(examples)
        result = classification_pb2.ClassificationResult()
        for row in range(batch):
            classification = result.classifications.add()
            count = (classes if classes is not None else scores).reshape(batch, -1).shape[1]
            for column in range(count):
                item = classification.classes.add()
                if classes is not None:
                    label = classes.reshape(batch, -1)[row, column]
                    item.label = label.decode("utf-8", "replace") if isinstance(label, bytes) else str(label)
                if scores is not None:
                    item.score = float(scores.reshape(batch, -1)[row, column])
        return result

    def regress(self, signature_name, examples, context=None):
        """Runs a `tensorflow/serving/regress` signature; returns a `RegressionResult`."""
        key, signature = self._example_signature(signature_name, REGRESS_METHOD, "regression", examples)
        if len(signature.outputs) != 1:
            raise invalid_argument("Expected one output Tensor.")
        alias = next(iter(signature.inputs))
        outputs = self._call(key, {alias: tf.constant(self._serialized(examples, context))})
        values = next(iter(outputs.values())).reshape(len(examples), -1)
        if values.shape[1] != 1:
            raise invalid_argument(f"Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but "
                                   f"got {_shape_string(values.shape)}")
        result = regression_pb2.RegressionResult()
        for value in values[:, 0]:
            result.regressions.add().value = float(value)
        return result
