"""A client for TF Serving's REST and gRPC APIs (works against `tensorflow/serving` and `tfformer serve`).

    client = tfformer.serving.Client("http://127.0.0.1:8501")   # or "grpc://127.0.0.1:8500"
    client.predict("translator", ["Hello world"])               # {"translation": array([b"..."], dtype=object)}
    client.predict("dense", {"x": [[1.0, 2.0, 3.0]]}, signature_name="serving_default", version=2)
    client.status("translator")                                 # {"model_version_status": [...]}
    client.metadata("translator")                               # {"model_spec": ..., "metadata": {...}}

`predict` returns `{output_alias: np.ndarray}` over both transports. A list (or
array) of inputs is sent in row format (`{"instances": [...]}`), a dict in
columnar format (`{"inputs": {...}}`). Errors raise `ServingError` with TF
Serving's status code and message.
"""

import base64
import http.client
import json
import socket
import threading
import urllib.parse

import numpy as np

from tfformer.checks import check_number
from tfformer.serving.status import CODE_FOR_HTTP_STATUS, Code, ServingError

_JSON_DTYPES = {"DT_FLOAT": np.float32, "DT_DOUBLE": np.float64, "DT_INT32": np.int32, "DT_INT64": np.int64,
                "DT_INT16": np.int16, "DT_INT8": np.int8, "DT_UINT8": np.uint8, "DT_UINT32": np.uint32,
                "DT_UINT64": np.uint64, "DT_BOOL": np.bool_, "DT_STRING": object}


def _to_json(value):
    """numpy/bytes -> JSON-ready values (bytes that are not UTF-8 go as `{"b64": ...}`)."""
    if isinstance(value, np.ndarray):
        return _to_json(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json(value, dtype):
    """A JSON output (with `{"b64"}` objects) -> numpy array of `dtype` (None: let numpy decide)."""
    def decode(item):
        if isinstance(item, list):
            return [decode(element) for element in item]
        if _is_base64(item):
            return base64.b64decode(item["b64"])
        if isinstance(item, str):
            return item.encode("utf-8")
        return item

    decoded = decode(value)
    if dtype is object or (dtype is None and _is_strings(decoded)):
        array = np.array(decoded, dtype=object)
        return array
    return np.array(decoded, dtype=dtype)


def _is_base64(value):
    return isinstance(value, dict) and set(value) == {"b64"}


def _single(output_dtypes):
    if len(output_dtypes) != 1:
        raise ServingError(Code.INTERNAL, f"Expected one output, the signature has {sorted(output_dtypes)}.")
    return next(iter(output_dtypes))


def _is_strings(value):
    while isinstance(value, list) and value:
        value = value[0]
    return isinstance(value, bytes)


def _json_loads(text):
    return json.loads(text, parse_constant=float)


class _RestTransport:
    def __init__(self, url, timeout):
        parsed = urllib.parse.urlsplit(url)
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname
        self.port = parsed.port or (443 if self.https else 80)
        self.prefix = parsed.path.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self):
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            connection = kind(self.host, self.port, timeout=self.timeout)
            self._local.connection = connection
        return connection

    def request(self, method, path, body=None):
        """Returns the parsed JSON reply; raises ServingError for an error status, and as the gRPC transport does
        when no reply comes: UNAVAILABLE for a server that cannot be reached, DEADLINE_EXCEEDED after `timeout`."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in range(2):  # one retry on a keep-alive connection the server closed
            connection = self._connection()
            try:
                connection.request(method, self.prefix + path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                break
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                self._local.connection = None
                if isinstance(error, TimeoutError):
                    raise ServingError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from error
                if attempt or not isinstance(error, (ConnectionError, http.client.BadStatusLine,
                                                     http.client.CannotSendRequest)):
                    unreached = isinstance(error, (ConnectionRefusedError, socket.gaierror))
                    raise ServingError(Code.UNAVAILABLE, f"{'failed to connect to' if unreached else 'no reply from'} "
                                                         f"{self.host}:{self.port}: "
                                                         f"{getattr(error, 'strerror', None) or error}") from error
        if response.status == 200:
            return _json_loads(data)
        try:
            message = _json_loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            message = data.decode("utf-8", "replace")
        raise ServingError(CODE_FOR_HTTP_STATUS.get(response.status, Code.UNKNOWN), message,
                           http_status=response.status)

    def close(self):
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()


def _model_path(model, version=None, label=None):
    path = "/v1/models/" + urllib.parse.quote(model, safe="")
    if version is not None:
        path += f"/versions/{int(version)}"
    elif label is not None:
        path += "/labels/" + urllib.parse.quote(label, safe="")
    return path


class Client:
    """TF Serving client over REST (`http://host:port`) or gRPC (`grpc://host:port`).

    Args:
        url: str. `http://127.0.0.1:8501` (REST) or `grpc://127.0.0.1:8500` (gRPC).
        timeout: float. Seconds per request.

    Thread-safe: REST keeps one keep-alive connection per thread, gRPC one channel.
    """

    def __init__(self, url, timeout=30.0):
        check_number("timeout", timeout, above=0, expected="a number of seconds > 0")
        scheme = urllib.parse.urlsplit(url).scheme
        self.url = url
        self.timeout = timeout
        self._signatures = {}
        if scheme in ("http", "https"):
            self.protocol = "rest"
            self._rest = _RestTransport(url, timeout)
        elif scheme == "grpc":
            import grpc
            from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc

            target = url.split("://", 1)[1].rstrip("/")
            self.protocol = "grpc"
            self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1),
                                                                   ("grpc.max_send_message_length", -1)])
            self._prediction = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)
            self._models = model_service_pb2_grpc.ModelServiceStub(self._channel)
        else:
            raise ValueError(f"`url` must start with http://, https:// or grpc://. Received: {url!r}")

    # ---------------------------------------------------------------------------------------

    def predict(self, model, inputs, signature_name=None, version=None, label=None):
        """Runs a signature.

        Args:
            model: str. Model name.
            inputs: a list/array (one element per example, row format: single-input signatures, or dicts
                of named inputs) or a dict `{input_alias: value}` (columnar format).
            signature_name: str. Defaults to `serving_default`.
            version: int. A specific version (default: the latest).
            label: str. A version label (instead of `version`).

        Returns:
            `{output_alias: np.ndarray}`; strings come back as `bytes` in object arrays.
        """
        if version is not None and label is not None:
            raise ValueError("Give `version` or `label`, not both.")
        if self.protocol == "rest":
            return self._rest_predict(model, inputs, signature_name, version, label)
        return self._grpc_predict(model, inputs, signature_name, version, label)

    def status(self, model, version=None):
        """The model's version states, as TF Serving's REST API returns them."""
        if self.protocol == "rest":
            return self._rest.request("GET", _model_path(model, version))
        from google.protobuf import json_format
        from tensorflow_serving.apis import get_model_status_pb2

        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = model
        if version is not None:
            request.model_spec.version.value = int(version)
        response = self._call(self._models.GetModelStatus, request)
        return json_format.MessageToDict(response, always_print_fields_with_no_presence=True)

    def metadata(self, model, version=None, label=None):
        """`{"model_spec": ..., "metadata": {"signature_def": {"signature_def": {...}}}}` (the REST layout)."""
        if self.protocol == "rest":
            return self._rest.request("GET", _model_path(model, version, label) + "/metadata")
        from google.protobuf import json_format
        from tensorflow_serving.apis import get_model_metadata_pb2

        request = get_model_metadata_pb2.GetModelMetadataRequest()
        self._fill_spec(request.model_spec, model, None, version, label)
        request.metadata_field.append("signature_def")
        response = self._call(self._prediction.GetModelMetadata, request)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        response.metadata["signature_def"].Unpack(signatures)
        options = dict(preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        return {"model_spec": json_format.MessageToDict(response.model_spec, **options),
                "metadata": {"signature_def": json_format.MessageToDict(signatures, **options)}}

    def close(self):
        if self.protocol == "rest":
            self._rest.close()
        else:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # ---------------------------------------------------------------------------------------

    def _signature(self, model, signature_name, version, label, refresh=False):
        """`({input alias: dtype name}, {output alias: dtype name})` of the signature, from the model's metadata,
        cached. `refresh` asks again: latest (or a label) moves to a new version when one loads, and its signature
        may differ. A signature the model lacks is the error the server gives a predict that names it."""
        key = (model, signature_name or "serving_default", version, label)
        if refresh or key not in self._signatures:
            signature = self.metadata(model, version, label)["metadata"]["signature_def"]["signature_def"].get(key[1])
            if signature is None:
                raise (ServingError(Code.INVALID_ARGUMENT, f'Serving signature name: "{key[1]}" not found in '
                                                           "signature def") if self.protocol == "rest" else
                       ServingError(Code.FAILED_PRECONDITION, f'Serving signature key "{key[1]}" not found.'))
            self._signatures[key] = tuple({alias: info.get("dtype") for alias, info in signature[kind].items()}
                                          for kind in ("inputs", "outputs"))
        return self._signatures[key]

    def _rest_predict(self, model, inputs, signature_name, version, label):
        body = {} if signature_name is None else {"signature_name": signature_name}
        if isinstance(inputs, dict):
            body["inputs"] = _to_json(inputs)
        else:
            body["instances"] = _to_json(list(inputs) if isinstance(inputs, (tuple, np.ndarray)) else inputs)
        reply = self._rest.request("POST", _model_path(model, version, label) + ":predict",
                                   json.dumps(body).encode("utf-8"))
        if "outputs" in reply:
            outputs = reply["outputs"]
            named = isinstance(outputs, dict) and not _is_base64(outputs)
            items = list(outputs.items()) if named else [(None, outputs)]
        else:
            predictions = reply["predictions"]
            named = bool(predictions) and isinstance(predictions[0], dict) and not _is_base64(predictions[0])
            items = ([(alias, [row[alias] for row in predictions]) for alias in predictions[0]] if named
                     else [(None, predictions)])
        # The cached signature, unless the reply does not fit it: then another version answered, and it is asked
        # again (its outputs were read with the old version's dtypes).
        for refresh in (False, True):
            output_dtypes = self._signature(model, signature_name, version, label, refresh)[1]
            if (set(output_dtypes) >= {alias for alias, _ in items}) if named else len(output_dtypes) == 1:
                break
        if not named:
            items = [(_single(output_dtypes), items[0][1])]
        return {alias: _from_json(value, _JSON_DTYPES.get(output_dtypes.get(alias))) for alias, value in items}

    @staticmethod
    def _fill_spec(spec, model, signature_name, version, label):
        spec.name = model
        if signature_name:
            spec.signature_name = signature_name
        if version is not None:
            spec.version.value = int(version)
        elif label is not None:
            spec.version_label = label

    def _call(self, method, request):
        import grpc

        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as error:
            raise ServingError(error.code().value[0], error.details() or "") from None

    def _grpc_predict(self, model, inputs, signature_name, version, label):
        cached = (model, signature_name or "serving_default", version, label) in self._signatures
        try:
            return self._grpc_predict_once(model, inputs, signature_name, version, label)
        except ServingError as error:
            if not cached or error.code != Code.INVALID_ARGUMENT:
                raise
        # Refused with a cached signature: latest (or the label) may name a new version since, with other inputs.
        return self._grpc_predict_once(model, inputs, signature_name, version, label, refresh=True)

    def _grpc_predict_once(self, model, inputs, signature_name, version, label, refresh=False):
        import tensorflow as tf
        from tensorflow.core.framework import types_pb2
        from tensorflow_serving.apis import predict_pb2

        from tfformer.serving import json_tensor

        input_dtypes = self._signature(model, signature_name, version, label, refresh)[0]
        if not isinstance(inputs, dict):
            if len(input_dtypes) != 1:
                raise ValueError(f"The signature has inputs {sorted(input_dtypes)}; pass a dict {{alias: value}}.")
            inputs = {next(iter(input_dtypes)): inputs}
        request = predict_pb2.PredictRequest()
        self._fill_spec(request.model_spec, model, signature_name, version, label)
        for alias, value in inputs.items():
            dtype = input_dtypes.get(alias)
            if isinstance(value, np.ndarray) or dtype not in _JSON_DTYPES:
                array = np.asarray(value)  # sent as given
            else:
                # Python values are checked and converted as the server converts them from JSON over REST: 1.7 or
                # True for an int32 input is INVALID_ARGUMENT there, not a silent 1.
                body = json.dumps({"inputs": {alias: _to_json(value)}}).encode("utf-8")
                dtypes = {alias: types_pb2.DataType.Value(dtype)}
                array = json_tensor.parse_predict_request(body, lambda _: dtypes)[1][alias]
            request.inputs[alias].CopyFrom(tf.make_tensor_proto(array))
        response = self._call(self._prediction.Predict, request)
        return {alias: tf.make_ndarray(proto) for alias, proto in response.outputs.items()}


def predict_texts(url, model, texts, signature_name=None, version=None, label=None, timeout=30.0):
    """What `tfformer predict` prints: one line per text (a string output as is, anything else as JSON).

    Sends `{"instances": [text, ...]}` to the signature (REST) or the same strings as a `[N]` string
    tensor (gRPC).
    """
    with Client(url, timeout=timeout) as client:
        outputs = client.predict(model, list(texts), signature_name=signature_name, version=version, label=label)
    lines = []
    for row in range(len(texts)):
        values = {alias: array[row] for alias, array in outputs.items()}
        if len(values) == 1 and isinstance(next(iter(values.values())), bytes):
            lines.append(next(iter(values.values())).decode("utf-8", "replace"))
        else:
            lines.append(json.dumps(_to_json(values), ensure_ascii=False))
    return lines
