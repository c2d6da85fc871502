"""TF Serving's REST payloads <-> tensors (`tensorflow_serving/util/json_tensor.cc`, re-implemented).

Predict requests come in row (`instances`) or columnar (`inputs`) format and
are converted to numpy arrays of the signature's dtypes; outputs go back as
`predictions` (row) or `outputs` (columnar). Classify/regress requests become
`tf.train.Example`s. Every check, and every error message, follows TF Serving.
"""

import base64
import binascii
import math

import numpy as np
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import types_pb2

from tfformer.checks import is_int, is_number
from tfformer.serving import rapidjson
from tfformer.serving.rapidjson import JsonObject, PrettyWriter, format_decimal, value_to_string
from tfformer.serving.status import Code, ServingError, invalid_argument

ROW, COLUMNAR = "row", "columnar"
DEFAULT_SIGNATURE = "serving_default"

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_UINT32 = (0, 2**32 - 1)
_UINT64 = (0, 2**64 - 1)
_FLOAT_MAX_INT = {types_pb2.DT_FLOAT: 2**24 - 1, types_pb2.DT_DOUBLE: 2**53 - 1}
_FLOAT_LIMIT = {types_pb2.DT_FLOAT: float(np.finfo(np.float32).max),
                types_pb2.DT_DOUBLE: float(np.finfo(np.float64).max)}

NUMPY_DTYPE = {
    types_pb2.DT_FLOAT: np.float32,
    types_pb2.DT_DOUBLE: np.float64,
    types_pb2.DT_INT32: np.int32,
    types_pb2.DT_INT16: np.int16,
    types_pb2.DT_INT8: np.int8,
    types_pb2.DT_UINT8: np.uint8,
    types_pb2.DT_INT64: np.int64,
    types_pb2.DT_UINT32: np.uint32,
    types_pb2.DT_UINT64: np.uint64,
    types_pb2.DT_BOOL: np.bool_,
    types_pb2.DT_STRING: object,
}


def dtype_name(dtype):
    """TF's `DataTypeString`: `float`, `double`, `int32`, `string`, ..."""
    try:
        return types_pb2.DataType.Name(dtype)[3:].lower()
    except ValueError:
        return f"unknown dtype enum ({dtype})"


def _type_error(value, dtype):
    return invalid_argument(
        "JSON Value: ", value_to_string(value), " Type: ", rapidjson.type_string(value),
        " is not of expected type: ", dtype_name(dtype),
    )


def _is_int_in(value, bounds):
    return is_int(value) and bounds[0] <= value <= bounds[1]


def _lossless(value, dtype):
    if isinstance(value, float):
        if not math.isfinite(value):
            return True
        return -_FLOAT_LIMIT[dtype] <= value <= _FLOAT_LIMIT[dtype]
    return abs(value) <= _FLOAT_MAX_INT[dtype]


def _convert_value(value, dtype):
    """`AddValueToTensor`: one JSON scalar to a Python value of `dtype`."""
    if dtype in (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE):
        if not is_number(value):
            raise _type_error(value, dtype)
        if not _lossless(value, dtype):
            target = "float" if dtype == types_pb2.DT_FLOAT else "double"
            raise invalid_argument("Cannot convert JSON value: ", value_to_string(value), " to ", target,
                                   " without loss of precision.")
        return float(value)
    if dtype in (types_pb2.DT_INT32, types_pb2.DT_INT16, types_pb2.DT_INT8, types_pb2.DT_UINT8):
        if not _is_int_in(value, _INT32):
            raise _type_error(value, dtype)
        return value
    if dtype == types_pb2.DT_STRING:
        if not isinstance(value, str):
            raise _type_error(value, dtype)
        return rapidjson.to_bytes(value)
    if dtype == types_pb2.DT_INT64:
        if not _is_int_in(value, _INT64):
            raise _type_error(value, dtype)
        return value
    if dtype == types_pb2.DT_BOOL:
        if not isinstance(value, bool):
            raise _type_error(value, dtype)
        return value
    if dtype == types_pb2.DT_UINT32:
        if not _is_int_in(value, _UINT32):
            raise _type_error(value, dtype)
        return value
    if dtype == types_pb2.DT_UINT64:
        if not _is_int_in(value, _UINT64):
            raise _type_error(value, dtype)
        return value
    raise ServingError(Code.UNIMPLEMENTED,
                       f"Conversion of JSON Value: {value_to_string(value)} to type: {dtype_name(dtype)}")


def is_base64_object(value):
    """`{"b64": "<string>"}` with exactly one member."""
    return isinstance(value, JsonObject) and value.member_count == 1 and isinstance(value.get("b64"), str)


def _b64decode(text):
    data = rapidjson.to_bytes(text)
    try:
        stripped = data.rstrip(b"=")
        if len(data) - len(stripped) > 2 or len(stripped) % 4 == 1:
            raise binascii.Error()
        return base64.b64decode(stripped + b"=" * (-len(stripped) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise invalid_argument("Unable to base64 decode") from None


def _decode_base64_object(value):
    if not is_base64_object(value):
        raise invalid_argument("JSON Value: ", value_to_string(value), " not formatted correctly for base64 data")
    return _b64decode(value["b64"])


def _dense_shape(value):
    """`GetDenseTensorShape`: the shape implied by following first elements."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _shape_string(shape):
    return "[" + ",".join(str(size) for size in shape) + "]"


def _fill(value, level, dtype, shape, out):
    """`FillTensorProto`: checks that `value` is a dense tensor of `shape`, appending its leaves."""
    rank = len(shape)
    if not isinstance(value, list):
        if level != rank:
            raise invalid_argument("JSON Value: ", value_to_string(value), " found at incorrect level: ", level + 1,
                                   " in the JSON DOM. Expected at level: ", rank)
        if isinstance(value, dict):
            if dtype != types_pb2.DT_STRING:
                raise _type_error(value, dtype)
            out.append(_decode_base64_object(value))
        else:
            out.append(_convert_value(value, dtype))
        return
    if level >= rank:
        raise invalid_argument("Encountered list at unexpected level: ", level, " expected < ", rank)
    if len(value) != shape[level]:
        raise invalid_argument("Encountered list at unexpected size: ", len(value), " at level: ", level,
                               " expected size: ", shape[level])
    for item in value:
        _fill(item, level + 1, dtype, shape, out)


def to_array(values, dtype, shape):
    """Leaf values of `dtype` (enum) -> numpy array of `shape`."""
    target = NUMPY_DTYPE[dtype]
    if target is object:
        array = np.empty(len(values), dtype=object)
        array[:] = values
    elif dtype in (types_pb2.DT_INT16, types_pb2.DT_INT8, types_pb2.DT_UINT8):
        array = np.array(values, dtype=np.int64).astype(target)  # TF narrows int_val like a C cast
    else:
        array = np.array(values, dtype=target)
    return array.reshape(shape)


def _json_to_array(value, dtype):
    shape = _dense_shape(value)
    out = []
    _fill(value, 0, dtype, shape, out)
    return to_array(out, dtype, shape)


def _from_instances(instances, input_dtypes):
    names = sorted(input_dtypes)
    if not isinstance(instances[0], dict) and len(names) > 1:
        raise invalid_argument("instances is a plain list, but expecting list of objects as multiple input "
                               "tensors required as per tensorinfo_map")

    def is_element_object(value):
        return isinstance(value, dict) and not is_base64_object(value)

    elements_are_objects = is_element_object(instances[0])
    values, shapes, sizes = {}, {}, {}

    def add_item(item, name):
        if name not in input_dtypes:
            raise invalid_argument("JSON object: does not have named input: ", name)
        shape = _dense_shape(item)
        out = []
        _fill(item, 0, input_dtypes[name], shape, out)
        if name not in sizes:
            sizes[name], shapes[name] = len(out), shape
        elif sizes[name] != len(out):
            raise invalid_argument("Expecting tensor size: ", sizes[name], " but got: ", len(out))
        elif shapes[name] != shape:
            raise invalid_argument("Expecting shape ", _shape_string(shapes[name]), " but got: ", _shape_string(shape))
        values.setdefault(name, []).extend(out)

    for index, element in enumerate(instances):
        if elements_are_objects:
            if not is_element_object(element):
                raise invalid_argument("Expecting object but got list at item ", index, " of input list")
            for name, item in element.items():
                try:
                    add_item(item, name)
                except ServingError as error:
                    raise invalid_argument("Failed to process element: ", index, " key: ", name,
                                           " of 'instances' list. Error: ", error.to_string()) from None
            if set(element) != set(names):
                raise invalid_argument("Failed to process element: ", index, " of 'instances' list. JSON object: ",
                                       value_to_string(element), " keys must be equal to: ", ",".join(names))
        else:
            if is_element_object(element):
                raise invalid_argument("Expecting value/list but got object at item ", index, " of input list")
            try:
                add_item(element, names[0])
            except ServingError as error:
                raise invalid_argument("Failed to process element: ", index, " of 'instances' list. Error: ",
                                       error.to_string()) from None
    return {
        name: to_array(values[name], input_dtypes[name], [len(instances)] + shapes[name])
        for name in values
    }


def _from_inputs(value, input_dtypes):
    names = sorted(input_dtypes)
    if not isinstance(value, dict) or is_base64_object(value):
        if len(names) > 1:
            raise invalid_argument("inputs is a plain value/list, but expecting an object as multiple input "
                                   "tensors required as per tensorinfo_map")
        return {names[0]: _json_to_array(value, input_dtypes[names[0]])}
    tensors = {}
    for name in names:
        if name not in value:
            raise invalid_argument("Missing named input: ", name, " in 'inputs' object.")
        tensors[name] = _json_to_array(value[name], input_dtypes[name])
    return tensors


def _format_error(document, *parts):
    return invalid_argument("JSON Value: ", value_to_string(document), " ", *parts)


def _parse_document(body):
    document = rapidjson.parse(body)
    if not isinstance(document, dict):
        raise _format_error(document, "Is not object")
    return document


def _signature_name(document):
    if "signature_name" in document:
        if not isinstance(document["signature_name"], str):
            raise invalid_argument("JSON Value: ", value_to_string(document),
                                   " not formatted correctly. 'signature_name' key must be a string value.")
        return document["signature_name"]
    return ""


def parse_predict_request(body, get_input_dtypes):
    """`FillPredictRequestFromJson`.

    Args:
        body: bytes. The request body.
        get_input_dtypes: callable(signature_name) -> {alias: DataType enum}; may raise `ServingError`
            (unknown model 404, unknown signature 400), which is raised after the JSON itself is checked.

    Returns:
        `(signature_name, {alias: np.ndarray}, format)` with format `ROW` or `COLUMNAR`.
    """
    document = _parse_document(body)
    signature_name = _signature_name(document)
    input_dtypes = get_input_dtypes(signature_name)
    if not input_dtypes:
        raise invalid_argument("Failed to get input map for signature: ", signature_name or "DEFAULT")
    try:
        if "instances" in document:
            if "inputs" in document:
                raise _format_error(document, "Not formatted correctly expecting only one of 'inputs' or "
                                              "'instances' keys to exist ")
            instances = document["instances"]
            if not isinstance(instances, list):
                raise _format_error(document, "Excepting 'instances' to be an list/array")
            if not instances:
                raise _format_error(document, "No values in 'instances' array")
            return signature_name, _from_instances(instances, input_dtypes), ROW
        if "inputs" in document:
            return signature_name, _from_inputs(document["inputs"], input_dtypes), COLUMNAR
    except RecursionError:
        raise invalid_argument("JSON Value: nested too deeply to convert to a tensor") from None
    raise invalid_argument("Missing 'inputs' or 'instances' key")


# --------------------------------------------------------------------------------------------
# Tensors -> JSON


def _writer_for(array, name):
    """A function writing one leaf value of `array` (the `AddSingleValueAndAdvance` switch)."""
    kind = array.dtype
    if kind == np.float32:
        return lambda writer, value: writer.raw(format_decimal(value, single=True))
    if kind == np.float64:
        return lambda writer, value: writer.raw(format_decimal(value, single=False))
    if kind in (np.int8, np.int16, np.int32, np.uint8, np.int64, np.uint32, np.uint64):
        return lambda writer, value: writer.raw(str(int(value)))
    if kind == np.bool_:
        return lambda writer, value: writer.raw("true" if value else "false")
    if kind.kind in "OSU":
        as_bytes = name.endswith("_bytes")

        def write_string(writer, value):
            data = value if isinstance(value, bytes) else str(value).encode("utf-8")
            if as_bytes:
                writer.start_object()
                writer.key("b64")
                writer.string(base64.b64encode(data).decode("ascii"))
                writer.end_object()
            else:
                # TF Serving writes the raw bytes; invalid UTF-8 becomes U+FFFD so the body stays valid JSON.
                writer.string(data.decode("utf-8", "replace"))

        return write_string
    tf_name = {np.float16: "half", np.uint16: "uint16", np.complex64: "complex64", np.complex128: "complex128"}
    raise invalid_argument("Failed to write JSON value for tensor type: ", tf_name.get(kind.type, str(kind)))


def _write_values(writer, value, write_leaf):
    """`AddTensorValues` on a nested list (`ndarray.tolist()`)."""
    if not isinstance(value, list):
        write_leaf(writer, value)
        return
    writer.start_array()
    for item in value:
        _write_values(writer, item, write_leaf)
    writer.end_array()


def make_json_from_tensors(outputs, request_format):
    """`MakeJsonFromTensors`: `{"predictions": ...}` (row) or `{"outputs": ...}` (columnar), as str."""
    if not outputs:
        raise invalid_argument("Cannot convert empty tensor map to JSON")
    names = sorted(outputs)
    arrays = {name: np.asarray(outputs[name]) for name in names}
    leaf_writers = {name: _writer_for(arrays[name], name) for name in names}
    writer = PrettyWriter()
    writer.start_object()
    if request_format == ROW:
        batch_size = 0
        for name in names:
            if arrays[name].ndim == 0:
                raise invalid_argument("Tensor name: ", name, " has no shape information ")
            size = arrays[name].shape[0]
            if size < 1:
                raise invalid_argument("Tensor name: ", name, " has invalid batch size: ", size)
            if batch_size and size != batch_size:
                raise invalid_argument("Tensor name: ", name, " has inconsistent batch size: ", size,
                                       " expecting: ", batch_size)
            batch_size = size
        lists = {name: arrays[name].tolist() for name in names}
        writer.key("predictions")
        writer.start_array()
        many = len(names) > 1
        for item in range(batch_size):
            if many:
                writer.start_object()
            writer.single_line_array = True
            for name in names:
                if many:
                    writer.key(name)
                _write_values(writer, lists[name][item], leaf_writers[name])
            writer.single_line_array = False
            if many:
                writer.end_object()
        writer.end_array()
    else:
        writer.key("outputs")
        many = len(names) > 1
        if many:
            writer.start_object()
        for name in names:
            if many:
                writer.key(name)
            _write_values(writer, arrays[name].tolist(), leaf_writers[name])
        if many:
            writer.end_object()
    writer.end_object()
    return writer.getvalue()


# --------------------------------------------------------------------------------------------
# Classify / Regress


def _kind_error(name, feature):
    kind = {"bytes_list": "bytes", "float_list": "float", "int64_list": "int64"}.get(feature.WhichOneof("kind"),
                                                                                     "UNKNOWN")
    return invalid_argument("Unexpected element type in feature: ", name, " expecting type: ", kind)


def _check_kind(name, feature, kind):
    current = feature.WhichOneof("kind")
    if current is not None and current != kind:
        raise _kind_error(name, feature)


def _add_value_to_feature(value, name, feature):
    if value is None or isinstance(value, list) or (isinstance(value, dict) and not is_base64_object(value)):
        raise invalid_argument("Feature: ", name, " has element with unexpected JSON type: ",
                               rapidjson.type_string(value))
    if isinstance(value, bool):
        _check_kind(name, feature, "int64_list")
        feature.int64_list.value.append(1 if value else 0)
    elif isinstance(value, dict):
        _check_kind(name, feature, "bytes_list")
        feature.bytes_list.value.append(_decode_base64_object(value))
    elif isinstance(value, str):
        _check_kind(name, feature, "bytes_list")
        feature.bytes_list.value.append(rapidjson.to_bytes(value))
    elif isinstance(value, float):
        _check_kind(name, feature, "float_list")
        if not _lossless(value, types_pb2.DT_FLOAT):
            raise invalid_argument("Cannot convert JSON value: ", value_to_string(value),
                                   " to float without loss of precision.")
        feature.float_list.value.append(value)
    else:
        _check_kind(name, feature, "int64_list")
        if value > _INT64[1]:
            raise invalid_argument("Feature: ", name, " has uint64 element. Only int64 is supported.")
        feature.int64_list.value.append(value)


def _make_example(value):
    if not isinstance(value, dict):
        raise invalid_argument("Example must be JSON object but got JSON ", rapidjson.type_string(value))
    example = example_pb2.Example()
    for name, content in value.items():
        feature = feature_pb2.Feature()
        for item in content if isinstance(content, list) else [content]:
            _add_value_to_feature(item, name, feature)
        example.features.feature[name].CopyFrom(feature)
    return example


def parse_classify_regress_request(body):
    """`FillClassificationRequestFromJson` / `FillRegressionRequestFromJson`.

    Returns:
        `(signature_name, examples, context)`: a list of `tf.train.Example` and an optional context Example.
    """
    document = _parse_document(body)
    signature_name = _signature_name(document)
    context = _make_example(document["context"]) if "context" in document else None
    if "examples" not in document:
        raise _format_error(document, "When method is classify, key 'examples' is expected and was not found")
    examples = document["examples"]
    if not isinstance(examples, list):
        raise _format_error(document, "Expecting 'examples' value to be an list/array")
    if not examples:
        raise _format_error(document, "'examples' value is an empty array")
    return signature_name, [_make_example(item) for item in examples], context


def make_json_from_classification_result(result):
    """`{"results": [[[label, score], ...], ...]}` from a `ClassificationResult`."""
    if not result.classifications:
        raise invalid_argument("Cannot convert empty ClassificationResults to JSON")
    writer = PrettyWriter()
    writer.start_object()
    writer.key("results")
    writer.start_array()
    for classifications in result.classifications:
        writer.single_line_array = True
        writer.start_array()
        for item in classifications.classes:
            writer.start_array()
            writer.string(item.label)
            writer.raw(format_decimal(item.score, single=True))
            writer.end_array()
        writer.end_array()
        writer.single_line_array = False
    writer.end_array()
    writer.end_object()
    return writer.getvalue()


def make_json_from_regression_result(result):
    """`{"results": [v1, v2, ...]}` from a `RegressionResult`."""
    if not result.regressions:
        raise invalid_argument("Cannot convert empty RegressionResults to JSON")
    writer = PrettyWriter()
    writer.start_object()
    writer.key("results")
    writer.single_line_array = True
    writer.start_array()
    for regression in result.regressions:
        writer.raw(format_decimal(regression.value, single=True))
    writer.end_array()
    writer.end_object()
    return writer.getvalue()
