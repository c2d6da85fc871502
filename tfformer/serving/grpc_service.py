"""TF Serving's gRPC API: `tensorflow.serving.PredictionService` and `ModelService`.

The servicers subclass the generated ones from `tensorflow_serving.apis`, so
any TF Serving client (the `*_pb2_grpc` stubs, or another language's) talks to
them unchanged. Status codes are TF Serving's (absl codes are gRPC codes);
messages longer than 1024 characters are cut with `...TRUNCATED` as
`grpc_status_util.cc` does. Output tensors use the typed value fields
(`float_val`, `string_val`, ...), like TF Serving's default `AsProtoField`.
"""

import concurrent.futures
import logging
import time

import grpc
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from tfformer.serving.servable import Deferred, answer
from tfformer.serving.status import TIMEOUT_MESSAGE, Code, ServingError, invalid_argument

log = logging.getLogger("tfformer.serving")

SIGNATURE_DEF_FIELD = "signature_def"
MAX_MESSAGE_BYTES = 1024
# grpcio reports a call without a deadline (a stub called without `timeout`, gRPC's default) as about 9e18 seconds
# remaining, which `Future.result(timeout=)` cannot take (OverflowError). A remainder past this is no deadline.
NO_DEADLINE_SECONDS = 1e9
_GRPC_CODE = {code.value[0]: code for code in grpc.StatusCode}

_VALUE_FIELD = {
    np.dtype(np.float32): "float_val",
    np.dtype(np.float64): "double_val",
    np.dtype(np.int32): "int_val",
    np.dtype(np.int16): "int_val",
    np.dtype(np.int8): "int_val",
    np.dtype(np.uint8): "int_val",
    np.dtype(np.uint16): "int_val",
    np.dtype(np.int64): "int64_val",
    np.dtype(np.uint32): "uint32_val",
    np.dtype(np.uint64): "uint64_val",
    np.dtype(np.bool_): "bool_val",
}


def grpc_code(code):
    return _GRPC_CODE[int(code)]


def truncate(message):
    """`ToGRPCStatus`: messages over 1024 bytes (UTF-8, as TF Serving's std::string) are cut there and end in
    `...TRUNCATED` (a character the cut splits is dropped)."""
    data = message.encode("utf-8")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    return data[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore") + "...TRUNCATED"


def to_tensor_proto(array):
    """numpy -> `TensorProto` with typed value fields (TF's `Tensor::AsProtoField`)."""
    array = np.asarray(array)
    proto = tensor_pb2.TensorProto()
    for size in array.shape:
        proto.tensor_shape.dim.add().size = size
    if array.dtype == object or array.dtype.kind in "SU":
        proto.dtype = types_pb2.DT_STRING
        proto.string_val.extend(value if isinstance(value, bytes) else str(value).encode("utf-8")
                                for value in array.ravel().tolist())
        return proto
    field = _VALUE_FIELD.get(array.dtype)
    if field is None:
        return tf.make_tensor_proto(array)
    proto.dtype = tf.as_dtype(array.dtype).as_datatype_enum
    getattr(proto, field).extend(array.ravel().tolist())
    return proto


def from_tensor_proto(alias, proto):
    """`TensorProto` -> numpy (`Tensor::FromProto`); INVALID_ARGUMENT `tensor parsing error: <alias>`."""
    try:
        return tf.make_ndarray(proto)
    except Exception:  # any malformed proto is a client error
        raise invalid_argument(f"tensor parsing error: {alias}") from None


def _examples(request_input):
    kind = request_input.WhichOneof("kind")
    if kind == "example_list":
        examples, context = list(request_input.example_list.examples), None
    elif kind == "example_list_with_context":
        examples = list(request_input.example_list_with_context.examples)
        context = request_input.example_list_with_context.context
    else:
        examples, context = [], None
    return examples, context


class _Base:
    def __init__(self, manager, executor, access_log=None):
        self.manager = manager
        self.executor = executor
        self.access_log = access_log

    def _run(self, context, api, model, fn):
        """Runs `fn` in the worker pool within the client's deadline; aborts the RPC on error.

        A `Deferred` answer (a predict waiting in a batching queue) is waited for in this RPC's thread, so the
        worker is free meanwhile; if the deadline passes first, the queued request is cancelled."""
        start = time.perf_counter()
        remaining = context.time_remaining()
        remaining = None if remaining is None or remaining > NO_DEADLINE_SECONDS else remaining
        deadline = None if remaining is None else time.monotonic() + remaining

        def job():
            if deadline is not None and time.monotonic() > deadline:
                raise ServingError(Code.DEADLINE_EXCEEDED, TIMEOUT_MESSAGE)
            return fn()

        error, result = None, None
        try:
            result = self.executor.submit(job).result(timeout=remaining)
            if isinstance(result, Deferred):
                result = _finish(result, deadline)
        except concurrent.futures.TimeoutError:
            error = ServingError(Code.DEADLINE_EXCEEDED, TIMEOUT_MESSAGE)
        except ServingError as caught:
            error = caught
        except Exception as caught:
            log.exception("Error in %s", api)
            error = ServingError(Code.INTERNAL, f"{type(caught).__name__}: {caught}")
        if self.access_log is not None:
            self.access_log.write(
                protocol="grpc", method=api, path=f"/tensorflow.serving.{self.SERVICE}/{api}",
                status=(error.code if error else Code.OK).name, code=(error.code if error else Code.OK).name,
                model=model, api=api, duration_ms=(time.perf_counter() - start) * 1000,
                client=context.peer(), error=error.message if error else None)
        if error is not None:
            context.abort(grpc_code(error.code), truncate(error.message))
        return result


def _finish(deferred, deadline):
    """The answer of a `Deferred` once its batch has run (before `deadline`, else the queued request is cancelled)."""
    try:
        value = deferred.future.result(None if deadline is None else max(deadline - time.monotonic(), 0.0))
    except concurrent.futures.TimeoutError:
        deferred.future.cancel()
        raise
    return deferred.finish(value)


class PredictionServicer(_Base, prediction_service_pb2_grpc.PredictionServiceServicer):
    """`tensorflow.serving.PredictionService`: Predict, GetModelMetadata, Classify, Regress."""

    SERVICE = "PredictionService"

    def Predict(self, request, context):
        return self._run(context, "Predict", request.model_spec.name, lambda: self._predict(request))

    def _predict(self, request):
        if not request.HasField("model_spec"):
            raise invalid_argument("Missing ModelSpec")
        servable = self.manager.get_servable_for_spec(request.model_spec)
        inputs = {alias: from_tensor_proto(alias, proto) for alias, proto in request.inputs.items()}
        future = servable.submit(request.model_spec.signature_name, inputs, list(request.output_filter))
        return answer(future, lambda result: self._predict_response(servable, *result))

    @staticmethod
    def _predict_response(servable, signature_name, outputs):
        response = predict_pb2.PredictResponse()
        response.model_spec.name = servable.name
        response.model_spec.version.value = servable.version
        response.model_spec.signature_name = signature_name
        for alias, array in outputs.items():
            response.outputs[alias].CopyFrom(to_tensor_proto(array))
        return response

    def GetModelMetadata(self, request, context):
        return self._run(context, "GetModelMetadata", request.model_spec.name, lambda: self._metadata(request))

    def _metadata(self, request):
        if not request.HasField("model_spec"):
            raise invalid_argument("Missing ModelSpec")
        if not request.metadata_field:
            raise invalid_argument("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != SIGNATURE_DEF_FIELD:
                raise invalid_argument(f"Metadata field {field} is not supported")
        servable = self.manager.get_servable_for_spec(request.model_spec)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = servable.name
        response.model_spec.version.value = servable.version
        response.metadata[SIGNATURE_DEF_FIELD].Pack(servable.signature_def_map())
        return response

    def Classify(self, request, context):
        return self._run(context, "Classify", request.model_spec.name, lambda: self._classify(request))

    def _classify(self, request):
        servable = self.manager.get_servable_for_spec(request.model_spec)
        result = servable.classify(request.model_spec.signature_name, *_examples(request.input))
        response = classification_pb2.ClassificationResponse()
        response.model_spec.name, response.model_spec.version.value = servable.name, servable.version
        response.model_spec.signature_name = request.model_spec.signature_name or "serving_default"
        response.result.CopyFrom(result)
        return response

    def Regress(self, request, context):
        return self._run(context, "Regress", request.model_spec.name, lambda: self._regress(request))

    def _regress(self, request):
        servable = self.manager.get_servable_for_spec(request.model_spec)
        result = servable.regress(request.model_spec.signature_name, *_examples(request.input))
        response = regression_pb2.RegressionResponse()
        response.model_spec.name, response.model_spec.version.value = servable.name, servable.version
        response.model_spec.signature_name = request.model_spec.signature_name or "serving_default"
        response.result.CopyFrom(result)
        return response


class ModelServicer(_Base, model_service_pb2_grpc.ModelServiceServicer):
    """`tensorflow.serving.ModelService`: GetModelStatus, HandleReloadConfigRequest."""

    SERVICE = "ModelService"

    def GetModelStatus(self, request, context):
        return self._run(context, "GetModelStatus", request.model_spec.name, lambda: self._status(request))

    def _status(self, request):
        if not request.HasField("model_spec"):
            raise invalid_argument("Missing ModelSpec")
        spec = request.model_spec
        return self.manager.model_status(spec.name, spec.version.value if spec.HasField("version") else None)

    def HandleReloadConfigRequest(self, request, context):
        return self._run(context, "HandleReloadConfigRequest", None, lambda: self._reload(request))

    def _reload(self, request):
        if request.config.WhichOneof("config") != "model_config_list":  # an empty config too (the file's is no-op)
            raise invalid_argument("ServerModelConfig type not supported by HandleReloadConfigRequest. Only "
                                   "ModelConfigList is currently supported")
        self.manager.reload_config(request.config)
        response = model_management_pb2.ReloadConfigResponse()
        response.status.error_code = 0
        return response


def add_servicers(server, manager, executor, access_log=None):
    """Registers both services on a `grpc.Server`."""
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionServicer(manager, executor, access_log), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(manager, executor, access_log), server)
