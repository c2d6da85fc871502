"""Conformance: requests replayed with the status code and body / message TF Serving gives for them.

The expected messages are written out literally from TF Serving's sources
(`json_tensor.cc`, `http_rest_api_handler.cc`, `http_rest_api_util.cc`,
`server_core.cc`, `predict_util.cc`, `get_model_status_impl.cc`,
`get_model_metadata_impl.cc`, `classifier.cc`/`regressor.cc`), not computed
with the server's own helpers. The few cases where the embedded server can only
approximate TF Serving (the runtime's own shape errors) check the status code
and a fragment; they are marked `ours`.
"""

import base64
import gzip
import json

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from tests.serving.conftest import http_request


def b64(text):
    return base64.b64encode(text.encode()).decode()


def error(message):
    return {"error": message}


PARSE_ERROR = object()  # a malformed body: `{"error": "JSON Parse error: <python-rapidjson's message> ..."}`


def status_of(*versions):
    return {"model_version_status": [{"version": str(v), "state": "AVAILABLE",
                                      "status": {"error_code": "OK", "error_message": ""}} for v in versions]}


PREDICT = "/v1/models/dense:predict"
ELEM0 = "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: "

# (id, method, path, body, HTTP status, expected JSON (None: not checked), substrings of the raw body)
REST_CASES = [
    # --- predict: success, formats, number printing
    ("row", "POST", PREDICT, '{"instances": [[1, 1, 1], [0.5, 0.25, 0]]}', 200,
     {"predictions": [[3.0, 3.0], [0.75, 0.75]]}, ["[[3.0, 3.0], [0.75, 0.75]"]),
    ("columnar", "POST", PREDICT, '{"inputs": [[1, 2, 3]]}', 200, {"outputs": [[6.0, 6.0]]}, ["6.0"]),
    ("row-object-instances", "POST", PREDICT, '{"instances": [{"x": [1, 2, 3]}]}', 200,
     {"predictions": [[6.0, 6.0]]}, []),
    ("columnar-named", "POST", PREDICT, '{"inputs": {"x": [[1, 2, 3]], "ignored": 1}}', 200,
     {"outputs": [[6.0, 6.0]]}, []),
    ("extra-top-level-keys-ignored", "POST", PREDICT, '{"instances": [[1, 1, 1]], "foo": [1, 2]}', 200,
     {"predictions": [[3.0, 3.0]]}, []),
    ("version", "POST", "/v1/models/dense/versions/1:predict", '{"instances": [[1, 1, 1]]}', 200,
     {"predictions": [[3.0, 3.0]]}, []),
    ("case-insensitive-path", "POST", "/V1/MODELS/dense:predict", '{"instances": [[1, 1, 1]]}', 200,
     {"predictions": [[3.0, 3.0]]}, []),
    ("escaped-model-name", "POST", "/v1/models/%64ense:predict", '{"instances": [[1, 1, 1]]}', 200,
     {"predictions": [[3.0, 3.0]]}, []),
    ("query-string-ignored", "POST", PREDICT + "?debug=1", '{"instances": [[1, 1, 1]]}', 200,
     {"predictions": [[3.0, 3.0]]}, []),
    ("multi-output-row", "POST", "/v1/models/multi:predict",
     '{"instances": [{"x": [1, 2, 3], "ids": [1, 2, 3, 4]}, {"x": [0, 0, 1], "ids": [0, 0, 0, 1]}]}', 200,
     {"predictions": [{"idsum": [10], "total": [6.0, 6.0]}, {"idsum": [1], "total": [1.0, 1.0]}]}, []),
    ("multi-output-columnar", "POST", "/v1/models/multi:predict",
     '{"inputs": {"x": [[1, 2, 3]], "ids": [[1, 2, 3, 4]]}}', 200,
     {"outputs": {"idsum": [[10]], "total": [[6.0, 6.0]]}}, []),
    ("bytes-output-b64", "POST", "/v1/models/text:predict", '{"instances": ["a b"]}', 200,
     {"predictions": [{"upper_bytes": {"b64": b64("A B")}, "version": 2, "words": 2}]}, []),
    ("b64-string-input", "POST", "/v1/models/text:predict", json.dumps({"instances": [{"b64": b64("x y z")}]}), 200,
     {"predictions": [{"upper_bytes": {"b64": b64("X Y Z")}, "version": 2, "words": 3}]}, []),
    ("strings-columnar", "POST", "/v1/models/text:predict", '{"inputs": ["a", "b c"]}', 200,
     {"outputs": {"upper_bytes": [{"b64": b64("A")}, {"b64": b64("B C")}], "version": [2, 2], "words": [1, 2]}}, []),
    ("label-stable", "POST", "/v1/models/text/labels/stable:predict", '{"instances": ["a"]}', 200,
     {"predictions": [{"upper_bytes": {"b64": b64("A")}, "version": 1, "words": 1}]}, []),
    ("signature-name", "POST", "/v1/models/text:predict", '{"signature_name": "lengths", "instances": ["abc", ""]}',
     200, {"predictions": [3, 0]}, []),
    ("nan-infinity-tokens", "POST", "/v1/models/text:predict",
     '{"signature_name": "echo_float", "instances": [NaN, Infinity, -Infinity, 1, 0.1]}', 200, None,
     ["[NaN, Infinity, -Infinity, 1.0, 0.1"]),
    ("double-int64-bool-uint8", "POST", "/v1/models/text:predict",
     '{"signature_name": "types", "inputs": {"f64": [1.5, 2], "i64": [9007199254740993], "b": [false], '
     '"u8": [255]}}', 200,
     {"outputs": {"b_out": [True], "f64_out": [3.0, 4.0], "i64_out": [9007199254740994], "u8_out": [255]}},
     ["9007199254740994", "3.0"]),
    ("rank-0-output-columnar", "POST", "/v1/models/text:predict", '{"signature_name": "scalar", "inputs": [1, 2]}',
     200, {"outputs": 3.0}, []),
    # --- model, version, label lookup
    ("unknown-model", "POST", "/v1/models/nope:predict", '{"instances": [1]}', 404,
     error("Servable not found for request: Latest(nope)"), []),
    ("unknown-version", "POST", "/v1/models/dense/versions/50:predict", '{"instances": [[1, 1, 1]]}', 404,
     error("Servable not found for request: Specific(dense, 50)"), []),
    ("unknown-label", "POST", "/v1/models/text/labels/nope:predict", '{"instances": ["a"]}', 400,
     error("Unrecognized servable version label: nope"), []),
    ("version-too-large", "POST", "/v1/models/dense/versions/99999999999999999999:predict", '{"instances": [1]}', 400,
     error("Failed to convert version: 99999999999999999999 to numeric."), []),
    # --- JSON parsing (before the model is looked up)
    ("bad-json", "POST", PREDICT, '{"instances": [1,2}', 400,
     error("JSON Parse error: Missing a comma or ']' after an array element. at offset: 18"), []),
    ("bad-json-unknown-model", "POST", "/v1/models/nope:predict", "{", 400,
     error("JSON Parse error: Missing a name for object member. at offset: 1"), []),
    ("empty-body", "POST", PREDICT, "", 400, error("JSON Parse error: The document is empty"), []),
    ("whitespace-body", "POST", PREDICT, "  ", 400, error("JSON Parse error: The document is empty. at offset: 2"),
     []),
    ("invalid-value", "POST", PREDICT, '{"instances": [nul]}', 400,
     error("JSON Parse error: Invalid value. at offset: 18"), []),
    ("trailing-garbage", "POST", PREDICT, '{"instances": [[1,1,1]]} x', 400,
     error("JSON Parse error: The document root must not be followed by other values. at offset: 25"), []),
    # TF Serving's RapidJSON 1.1.0 reads on where python-rapidjson's newer one stops (raw bytes that are not UTF-8,
    # lone low surrogates, NaN/Infinity with a fraction, overflow to Infinity): malformed JSON, refused with TF
    # Serving's status and error shape and python-rapidjson's message. Doubles convert without full precision.
    ("invalid-utf8-outside-string", "POST", PREDICT, b'{"instances": [\xff]}', 400, PARSE_ERROR, []),
    ("raw-bytes-in-strings", "POST", "/v1/models/text:predict",
     b'{"signature_name": "lengths", "instances": ["a\xffb", "\\udc00"]}', 400, PARSE_ERROR, []),
    ("nan-with-fraction", "POST", "/v1/models/text:predict",
     '{"signature_name": "echo_float", "instances": [NaN.5, 10e308]}', 400, PARSE_ERROR, []),
    ("double-conversion", "POST", "/v1/models/text:predict",
     '{"signature_name": "types", "inputs": {"f64": [9.041138514025523], "i64": [1], "b": [true], "u8": [1]}}',
     200, None, ["18.082277028051049"]),
    ("not-an-object", "POST", PREDICT, "[1, 2]", 400, error("JSON Value: [\n    1,\n    2\n] Is not object"), []),
    ("signature-name-not-string", "POST", PREDICT, '{"signature_name": 5, "instances": [[1, 1, 1]]}', 400,
     error('JSON Value: {\n    "signature_name": 5,\n    "instances": [\n        [\n            1,\n'
           '            1,\n            1\n        ]\n    ]\n} not formatted correctly. '
           "'signature_name' key must be a string value."), []),
    ("unknown-signature", "POST", PREDICT, '{"signature_name": "nope", "instances": [[1, 1, 1]]}', 400,
     error('Serving signature name: "nope" not found in signature def'), []),
    # --- instances / inputs structure
    ("both-instances-and-inputs", "POST", PREDICT, '{"instances": [1], "inputs": [1]}', 400,
     error('JSON Value: {\n    "instances": [\n        1\n    ],\n    "inputs": [\n        1\n    ]\n} '
           "Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist "), []),
    ("neither-instances-nor-inputs", "POST", PREDICT, '{"signature_name": "serving_default"}', 400,
     error("Missing 'inputs' or 'instances' key"), []),
    ("instances-not-a-list", "POST", PREDICT, '{"instances": 5}', 400,
     error('JSON Value: {\n    "instances": 5\n} Excepting \'instances\' to be an list/array'), []),
    ("empty-instances", "POST", PREDICT, '{"instances": []}', 400,
     error('JSON Value: {\n    "instances": []\n} No values in \'instances\' array'), []),
    ("ragged-rows", "POST", PREDICT, '{"instances": [[1, 2, 3], [1, 2]]}', 400,
     error("Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: "
           "Expecting tensor size: 3 but got: 2"), []),
    ("ragged-columnar", "POST", PREDICT, '{"inputs": [[1, 2, 3], [1, 2]]}', 400,
     error("Encountered list at unexpected size: 2 at level: 1 expected size: 3"), []),
    ("list-too-deep", "POST", PREDICT, '{"instances": [[1, [2], 3]]}', 400,
     error(ELEM0 + "Encountered list at unexpected level: 1 expected < 1"), []),
    ("value-at-wrong-level", "POST", PREDICT, '{"inputs": [[[1, 2, 3], 4]]}', 400,
     error("JSON Value: 4 found at incorrect level: 3 in the JSON DOM. Expected at level: 3"), []),
    ("same-size-other-shape", "POST", "/v1/models/text:predict",
     '{"signature_name": "echo_float", "instances": [[1, 2], 3]}', 400,
     error("Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: "
           "Expecting tensor size: 2 but got: 1"), []),
    ("wrong-input-name", "POST", "/v1/models/multi:predict", '{"instances": [{"x": [1, 2, 3], "z": [1, 2, 3, 4]}]}',
     400, error("Failed to process element: 0 key: z of 'instances' list. Error: INVALID_ARGUMENT: "
                "JSON object: does not have named input: z"), []),
    ("missing-input-name-row", "POST", "/v1/models/multi:predict", '{"instances": [{"x": [1, 2, 3]}]}', 400,
     error("Failed to process element: 0 of 'instances' list. JSON object: {\n    \"x\": [\n        1,\n        2,\n"
           "        3\n    ]\n} keys must be equal to: ids,x"), []),
    ("plain-list-for-two-inputs", "POST", "/v1/models/multi:predict", '{"instances": [[1, 2, 3]]}', 400,
     error("instances is a plain list, but expecting list of objects as multiple input tensors required as per "
           "tensorinfo_map"), []),
    ("mixed-objects-and-lists", "POST", "/v1/models/multi:predict",
     '{"instances": [{"x": [1, 2, 3], "ids": [1, 2, 3, 4]}, [1]]}', 400,
     error("Expecting object but got list at item 1 of input list"), []),
    ("missing-input-columnar", "POST", "/v1/models/multi:predict", '{"inputs": {"x": [[1, 2, 3]]}}', 400,
     error("Missing named input: ids in 'inputs' object."), []),
    ("plain-inputs-for-two-inputs", "POST", "/v1/models/multi:predict", '{"inputs": [[1, 2, 3]]}', 400,
     error("inputs is a plain value/list, but expecting an object as multiple input tensors required as per "
           "tensorinfo_map"), []),
    # --- value types
    ("string-for-float", "POST", PREDICT, '{"instances": [["a", 1, 1]]}', 400,
     error(ELEM0 + 'JSON Value: "a" Type: String is not of expected type: float'), []),
    ("float-for-int", "POST", "/v1/models/multi:predict", '{"inputs": {"x": [[1, 2, 3]], "ids": [[1.0, 2, 3, 4]]}}',
     400, error("JSON Value: 1.0 Type: Number is not of expected type: int32"), []),
    ("b64-for-float", "POST", PREDICT, '{"instances": [[{"b64": "AAAA"}, 1, 1]]}', 400,
     error(ELEM0 + 'JSON Value: {\n    "b64": "AAAA"\n} Type: Object is not of expected type: float'), []),
    ("bad-b64", "POST", "/v1/models/text:predict", '{"instances": [{"b64": "@@@"}]}', 400,
     error(ELEM0 + "Unable to base64 decode"), []),
    ("b64-extra-key", "POST", "/v1/models/text:predict", '{"inputs": [{"b64": "QQ==", "x": 1}]}', 400,
     error('JSON Value: {\n    "b64": "QQ==",\n    "x": 1\n} not formatted correctly for base64 data'), []),
    ("null-for-string", "POST", "/v1/models/text:predict", '{"inputs": [null]}', 400,
     error("JSON Value: null Type: Null is not of expected type: string"), []),
    ("number-for-bool", "POST", "/v1/models/text:predict",
     '{"signature_name": "types", "instances": [{"f64": 1, "i64": 2, "b": 1, "u8": 3}]}', 400,
     error("Failed to process element: 0 key: b of 'instances' list. Error: INVALID_ARGUMENT: "
           "JSON Value: 1 Type: Number is not of expected type: bool"), []),
    ("int64-overflow", "POST", "/v1/models/text:predict",
     '{"signature_name": "types", "inputs": {"f64": [1], "i64": [9223372036854775808], "b": [true], "u8": [1]}}',
     400, error("JSON Value: 9223372036854775808 Type: Number is not of expected type: int64"), []),
    ("int-not-exact-as-float", "POST", PREDICT, '{"instances": [[16777217, 0, 0]]}', 400,
     error(ELEM0 + "Cannot convert JSON value: 16777217 to float without loss of precision."), []),
    ("rank-0-output-row", "POST", "/v1/models/text:predict", '{"signature_name": "scalar", "instances": [1, 2]}', 400,
     error("Tensor name: total has no shape information "), []),
    ("ours-shape-mismatch", "POST", PREDICT, '{"inputs": [[1, 2]]}', 400, None, ["shape [1,2]", "[-1,3]"]),
    # --- routing
    ("get-on-predict", "GET", PREDICT, None, 400, error("Malformed request: GET /v1/models/dense:predict"), []),
    ("post-on-metadata", "POST", "/v1/models/dense/metadata", "{}", 400,
     error("Malformed request: POST /v1/models/dense/metadata"), []),
    ("put", "PUT", "/v1/models/dense", "{}", 400, error("Malformed request: PUT /v1/models/dense"), []),
    ("uppercase-method-name", "POST", "/v1/models/dense:PREDICT", '{"instances": [[1, 1, 1]]}', 400,
     error("Malformed request: POST /v1/models/dense:PREDICT"), []),
    ("unknown-api", "POST", "/v1/models/dense:explain", "{}", 400,
     error("Malformed request: POST /v1/models/dense:explain"), []),
    ("v1-root", "GET", "/v1/", None, 400, error("Malformed request: GET /v1/"), []),
    ("missing-model-name", "GET", "/v1/models", None, 400, error("Missing model name in request."), []),
    ("version-too-large-status", "GET", "/v1/models/dense/versions/99999999999999999999", None, 400,
     error("Failed to convert version: 99999999999999999999 to numeric."), []),
    # --- status and metadata
    ("status", "GET", "/v1/models/dense", None, 200, status_of(1), []),
    ("status-version", "GET", "/v1/models/dense/versions/1", None, 200, status_of(1), []),
    ("status-all-versions", "GET", "/v1/models/text", None, 200, status_of(2, 1), []),
    ("status-ignores-label", "GET", "/v1/models/text/labels/nope", None, 200, status_of(2, 1), []),
    ("status-unknown-version", "GET", "/v1/models/dense/versions/7", None, 404,
     error("Could not find version 7 of model dense"), []),
    ("status-unknown-model", "GET", "/v1/models/nope", None, 404, error("Could not find any versions of model nope"),
     []),
    ("metadata-unknown-model", "GET", "/v1/models/nope/metadata", None, 404,
     error("Servable not found for request: Latest(nope)"), []),
    ("metadata-unknown-label", "GET", "/v1/models/text/labels/nope/metadata", None, 400,
     error("Unrecognized servable version label: nope"), []),
    ("metadata-unknown-version", "GET", "/v1/models/text/versions/3/metadata", None, 404,
     error("Servable not found for request: Specific(text, 3)"), []),
    # --- classify / regress
    ("classify", "POST", "/v1/models/classifier:classify", '{"examples": [{"x": 0.25}, {"x": [0.5]}]}', 200,
     {"results": [[["yes", 0.25], ["no", 0.75]], [["yes", 0.5], ["no", 0.5]]]}, []),
    ("classify-with-context", "POST", "/v1/models/classifier:classify", '{"context": {"x": 0.75}, "examples": [{}]}',
     200, {"results": [[["yes", 0.75], ["no", 0.25]]]}, []),
    ("regress", "POST", "/v1/models/classifier/versions/1:regress",
     '{"signature_name": "regress", "examples": [{"x": 0.25}, {"x": 2.0}]}', 200, {"results": [0.25, 2.0]},
     ["2.0"]),
    ("regress-classify-signature", "POST", "/v1/models/classifier:regress", '{"examples": [{"x": 1.0}]}', 400,
     error("Expected regression signature method_name to be tensorflow/serving/regress. "
           "Was: tensorflow/serving/classify"), []),
    ("ours-classify-int-feature", "POST", "/v1/models/classifier:classify", '{"examples": [{"x": 1}]}', 400, None,
     ["Data types don't match"]),
    ("classify-predict-signature", "POST", "/v1/models/dense:classify", '{"examples": [{"x": [1.0, 2.0, 3.0]}]}', 400,
     error("Expected classification signature method_name to be tensorflow/serving/classify. "
           "Was: tensorflow/serving/predict"), []),
    ("regress-predict-signature", "POST", "/v1/models/dense:regress", '{"examples": [{"x": 1}]}', 400,
     error("Expected regression signature method_name to be tensorflow/serving/regress. "
           "Was: tensorflow/serving/predict"), []),
    ("classify-unknown-signature", "POST", "/v1/models/dense:classify",
     '{"signature_name": "nope", "examples": [{"x": 1}]}', 400, error("No signature was found with the name: nope"),
     []),
    ("classify-unknown-model", "POST", "/v1/models/nope:classify", '{"examples": [{"x": 1}]}', 404,
     error("Servable not found for request: Latest(nope)"), []),
    ("classify-no-examples", "POST", "/v1/models/dense:classify", '{"instances": [1]}', 400,
     error('JSON Value: {\n    "instances": [\n        1\n    ]\n} When method is classify, key \'examples\' is '
           "expected and was not found"), []),
    ("classify-empty-examples", "POST", "/v1/models/dense:classify", '{"examples": []}', 400,
     error('JSON Value: {\n    "examples": []\n} \'examples\' value is an empty array'), []),
    ("classify-null-feature", "POST", "/v1/models/dense:classify", '{"examples": [{"a": null}]}', 400,
     error("Feature: a has element with unexpected JSON type: Null"), []),
    ("classify-mixed-feature", "POST", "/v1/models/dense:regress", '{"examples": [{"a": [1, 1.5]}]}', 400,
     error("Unexpected element type in feature: a expecting type: int64"), []),
    ("classify-example-not-object", "POST", "/v1/models/dense:classify", '{"examples": [[1]]}', 400,
     error("Example must be JSON object but got JSON Array"), []),
]


def _loads(data):
    return json.loads(data, parse_constant=float)


@pytest.mark.parametrize("case", REST_CASES, ids=[case[0] for case in REST_CASES])
def test_rest(server, case):
    _, method, path, body, status, expected, fragments = case
    if isinstance(body, str):
        body = body.encode("utf-8")
    code, headers, data = http_request(server.rest_url, method, path, body)
    assert code == status, data
    assert headers.get("content-type") == "application/json"
    if expected is PARSE_ERROR:
        (message,) = _loads(data).values()
        assert list(_loads(data)) == ["error"]
        assert message.startswith("JSON Parse error: ") and " at offset: " in message
    elif expected is not None:
        assert _loads(data) == expected
    for fragment in fragments:
        assert fragment in data.decode("utf-8")


def test_an_op_error_is_the_ops_message_alone(server):
    # TensorFlow's eager error added "Graph execution error:", the Python stack where the server traced the function
    # (its file paths) and " [Op:__inference_...]"; TF Serving's Session::Run reports the op's message alone.
    code, _, data = http_request(server.rest_url, "POST", "/v1/models/classifier:predict", b'{"instances": ["x"]}')
    assert code == 400
    message = _loads(data)["error"]
    assert message.startswith("Could not parse example input, value: 'x'\n\t [[{{node "), message
    assert message.endswith("}}]]") and "Graph execution" not in message and "File " not in message, message


def test_a_gzip_body_is_inflated(server):
    # TF Serving's HTTP server inflates a body sent with Content-Encoding: gzip (auto_uncompress_input, on by
    # default); one that does not inflate is read as empty. Before, both were "JSON Parse error: Invalid encoding".
    body = b'{"instances": [[1, 1, 1]]}'
    headers = {"Content-Encoding": "gzip"}
    assert http_request(server.rest_url, "POST", PREDICT, gzip.compress(body), headers)[::2] == (
        200, http_request(server.rest_url, "POST", PREDICT, body)[2])
    code, _, data = http_request(server.rest_url, "POST", PREDICT, body, headers)
    assert (code, _loads(data)) == (400, {"error": "JSON Parse error: The document is empty"})


@pytest.mark.parametrize("origin, status", [("https://app.example", 200), ("", 400)])
def test_a_cors_preflight_gets_tf_servings_answer(server, origin, status):
    # TF Serving answers OPTIONS on /v1/ paths before its handler: 200 with an Origin of http(s)://, else
    # FAILED_PRECONDITION, both with an empty body (it was 400 "Malformed request").
    code, _, data = http_request(server.rest_url, "OPTIONS", PREDICT, headers={"Origin": origin} if origin else {})
    assert (code, data) == (status, b"")


def test_rest_case_count():
    assert len(REST_CASES) >= 40


def test_rest_metadata_layout(server):
    code, _, data = http_request(server.rest_url, "GET", "/v1/models/dense/metadata")
    assert code == 200
    reply = json.loads(data)
    assert reply["model_spec"] == {"name": "dense", "signature_name": "", "version": "1"}
    signature = reply["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["method_name"] == "tensorflow/serving/predict"
    assert signature["inputs"]["x"] == {
        "dtype": "DT_FLOAT", "name": "serving_default_x:0",
        "tensor_shape": {"dim": [{"size": "-1", "name": ""}, {"size": "3", "name": ""}], "unknown_rank": False}}
    assert set(signature["outputs"]) == {"output_0"}
    for path, version in [("/v1/models/text/labels/canary/metadata", "2"), ("/v1/models/text/versions/1/metadata", "1"),
                          ("/v1/models/text/metadata", "2")]:
        assert json.loads(http_request(server.rest_url, "GET", path)[2])["model_spec"]["version"] == version


def test_rest_outside_v1_is_a_plain_404(server):
    for path in ("/", "/v1", "/healthz", "/models/dense:predict"):
        code, headers, data = http_request(server.rest_url, "GET", path)
        assert code == 404
        assert headers.get("content-type", "").startswith("text/html")
        assert b"Not Found" in data


# ------------------------------------------------------------------------------------------------
# gRPC


def _spec(request, name, version=None, label=None, signature_name=None):
    request.model_spec.name = name
    if version is not None:
        request.model_spec.version.value = version
    if label is not None:
        request.model_spec.version_label = label
    if signature_name is not None:
        request.model_spec.signature_name = signature_name
    return request


def _predict(name, inputs, **spec):
    request = _spec(predict_pb2.PredictRequest(), name, **spec)
    for alias, value in inputs.items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return request


def _metadata(name, *fields):
    request = _spec(get_model_metadata_pb2.GetModelMetadataRequest(), name)
    request.metadata_field.extend(fields)
    return request


def _status(name, version=None):
    return _spec(get_model_status_pb2.GetModelStatusRequest(), name, version=version)


def _classify(name, cls=classification_pb2.ClassificationRequest):
    request = _spec(cls(), name)
    request.input.example_list.examples.add().features.feature["x"].float_list.value.extend([1.0, 2.0, 3.0])
    return request


X = np.ones((1, 3), np.float32)
LONG = "z" * 2000

# (id, service, method, request, expected code, expected message)
GRPC_CASES = [
    ("unknown-model", "prediction", "Predict", _predict("nope", {"x": X}), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request: Latest(nope)"),
    ("unknown-version", "prediction", "Predict", _predict("dense", {"x": X}, version=50), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request: Specific(dense, 50)"),
    ("unknown-label", "prediction", "Predict", _predict("text", {"text": np.array([b"a"])}, label="nope"),
     grpc.StatusCode.INVALID_ARGUMENT, "Unrecognized servable version label: nope"),
    ("no-model-name", "prediction", "Predict", _predict("", {"x": X}), grpc.StatusCode.INVALID_ARGUMENT,
     "ModelSpec has no name specified."),
    ("missing-model-spec", "prediction", "Predict", predict_pb2.PredictRequest(), grpc.StatusCode.INVALID_ARGUMENT,
     "Missing ModelSpec"),
    ("unknown-signature", "prediction", "Predict", _predict("dense", {"x": X}, signature_name="nope"),
     grpc.StatusCode.FAILED_PRECONDITION, 'Serving signature key "nope" not found.'),
    ("missing-input", "prediction", "Predict", _predict("multi", {"x": X}), grpc.StatusCode.INVALID_ARGUMENT,
     "input size does not match signature: 1!=2 len({x}) != len({ids,x}). Sent extra: {}. "
     "Missing but required: {ids}."),
    ("wrong-input-name", "prediction", "Predict", _predict("dense", {"z": X}), grpc.StatusCode.INVALID_ARGUMENT,
     "input tensor alias not found in signature: z. Inputs expected to be in the set {x}."),
    ("wrong-dtype", "prediction", "Predict", _predict("dense", {"x": np.ones((1, 3), np.int64)}),
     grpc.StatusCode.INVALID_ARGUMENT, "Expects arg[0] to be float but int64 is provided"),
    ("unknown-output-filter", "prediction", "Predict", None, grpc.StatusCode.INVALID_ARGUMENT,
     "output tensor alias not found in signature: nope Outputs expected to be in the set {output_0}."),
    ("truncated-message", "prediction", "Predict", _predict("dense", {LONG: X}), grpc.StatusCode.INVALID_ARGUMENT,
     ("input tensor alias not found in signature: " + LONG)[:1024] + "...TRUNCATED"),
    # TF Serving cuts at 1024 bytes of UTF-8, not characters (it cut at 1024 characters: 2,000 bytes here).
    ("truncated-utf8-message", "prediction", "Predict", _predict("dense", {"é" * 1000: X}),
     grpc.StatusCode.INVALID_ARGUMENT,
     ("input tensor alias not found in signature: " + "é" * 1000).encode()[:1024].decode(errors="ignore")
     + "...TRUNCATED"),
    ("metadata-no-field", "prediction", "GetModelMetadata", _metadata("dense"), grpc.StatusCode.INVALID_ARGUMENT,
     "GetModelMetadataRequest must specify at least one metadata_field"),
    ("metadata-bad-field", "prediction", "GetModelMetadata", _metadata("dense", "foo"),
     grpc.StatusCode.INVALID_ARGUMENT, "Metadata field foo is not supported"),
    ("metadata-unknown-model", "prediction", "GetModelMetadata", _metadata("nope", "signature_def"),
     grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"),
    ("status-unknown-model", "model", "GetModelStatus", _status("nope"), grpc.StatusCode.NOT_FOUND,
     "Could not find any versions of model nope"),
    ("status-unknown-version", "model", "GetModelStatus", _status("dense", 7), grpc.StatusCode.NOT_FOUND,
     "Could not find version 7 of model dense"),
    ("status-missing-spec", "model", "GetModelStatus", get_model_status_pb2.GetModelStatusRequest(),
     grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec"),
    ("classify-predict-signature", "prediction", "Classify", _classify("dense"), grpc.StatusCode.INVALID_ARGUMENT,
     "Expected classification signature method_name to be tensorflow/serving/classify. "
     "Was: tensorflow/serving/predict"),
    ("regress-predict-signature", "prediction", "Regress", _classify("dense", regression_pb2.RegressionRequest),
     grpc.StatusCode.INVALID_ARGUMENT,
     "Expected regression signature method_name to be tensorflow/serving/regress. Was: tensorflow/serving/predict"),
    ("reload-duplicate-model", "model", "HandleReloadConfigRequest", None, grpc.StatusCode.INVALID_ARGUMENT,
     "Illegal to list model dense multiple times in config list"),
    ("reload-custom-config", "model", "HandleReloadConfigRequest", None, grpc.StatusCode.INVALID_ARGUMENT,
     "ServerModelConfig type not supported by HandleReloadConfigRequest. Only ModelConfigList is currently "
     "supported"),
    # TF Serving's model_service_impl.cc refuses every config but a ModelConfigList, an empty one too (it answered OK).
    ("reload-empty-config", "model", "HandleReloadConfigRequest", model_management_pb2.ReloadConfigRequest(),
     grpc.StatusCode.INVALID_ARGUMENT,
     "ServerModelConfig type not supported by HandleReloadConfigRequest. Only ModelConfigList is currently "
     "supported"),
]


def _request_for(case):
    name, request = case[0], case[3]
    if name == "unknown-output-filter":
        request = _predict("dense", {"x": X})
        request.output_filter.append("nope")
    elif name == "reload-duplicate-model":
        request = model_management_pb2.ReloadConfigRequest()
        for _ in range(2):
            model = request.config.model_config_list.config.add()
            model.name, model.base_path, model.model_platform = "dense", "/tmp/dense", "tensorflow"
    elif name == "reload-custom-config":
        request = model_management_pb2.ReloadConfigRequest()
        request.config.custom_model_config.Pack(get_model_status_pb2.GetModelStatusRequest())
    return request


@pytest.fixture(scope="module")
def stubs(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.ports.grpc}")
    yield {"prediction": prediction_service_pb2_grpc.PredictionServiceStub(channel),
           "model": model_service_pb2_grpc.ModelServiceStub(channel)}
    channel.close()


@pytest.mark.parametrize("case", GRPC_CASES, ids=[case[0] for case in GRPC_CASES])
def test_grpc_errors(stubs, case):
    _, service, method, _, code, message = case
    with pytest.raises(grpc.RpcError) as raised:
        getattr(stubs[service], method)(_request_for(case), timeout=30)
    assert raised.value.code() == code
    assert raised.value.details() == message


def test_grpc_predict(stubs):
    response = stubs["prediction"].Predict(_predict("multi", {"x": X, "ids": np.array([[1, 2, 3, 4]], np.int32)}),
                                           timeout=30)
    assert response.model_spec.name == "multi"
    assert response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"
    total = response.outputs["total"]
    assert list(total.float_val) == [3.0, 3.0] and not total.tensor_content  # typed fields, like AsProtoField
    assert [dim.size for dim in total.tensor_shape.dim] == [1, 2]
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["idsum"]), [[10]])
    request = _predict("multi", {"x": X, "ids": np.zeros((1, 4), np.int32)})
    request.output_filter.append("idsum")
    assert set(stubs["prediction"].Predict(request, timeout=30).outputs) == {"idsum"}
    response = stubs["prediction"].Predict(_predict("text", {"text": np.array([b"a b"])}, label="stable"), timeout=30)
    assert response.model_spec.version.value == 1
    assert list(response.outputs["upper_bytes"].string_val) == [b"A B"]


def test_grpc_calls_without_a_deadline(stubs):
    # A stub called without `timeout` (gRPC's default): grpcio reports about 9e18 s remaining, which failed every
    # call with INTERNAL "OverflowError: timestamp out of range". TF Serving takes it as no deadline.
    request = _predict("multi", {"x": X, "ids": np.array([[1, 2, 3, 4]], np.int32)})
    response = stubs["prediction"].Predict.future(request).result(timeout=60)  # the wait is bounded, not the call
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["idsum"]), [[10]])
    status = stubs["model"].GetModelStatus.future(_status("text")).result(timeout=60)
    assert status.model_version_status


def test_grpc_classify_and_regress(stubs):
    request = _spec(classification_pb2.ClassificationRequest(), "classifier")
    request.input.example_list.examples.add().features.feature["x"].float_list.value.append(0.25)
    response = stubs["prediction"].Classify(request, timeout=30)
    assert [(c.label, c.score) for c in response.result.classifications[0].classes] == [("yes", 0.25), ("no", 0.75)]
    assert (response.model_spec.name, response.model_spec.version.value) == ("classifier", 1)
    request = _spec(regression_pb2.RegressionRequest(), "classifier", signature_name="regress")
    request.input.example_list_with_context.context.features.feature["x"].float_list.value.append(0.5)
    request.input.example_list_with_context.examples.add()
    assert [r.value for r in stubs["prediction"].Regress(request, timeout=30).result.regressions] == [0.5]
    request = _spec(regression_pb2.RegressionRequest(), "classifier", signature_name="regress")
    with pytest.raises(grpc.RpcError) as raised:
        stubs["prediction"].Regress(request, timeout=30)
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "Input is empty.")


def test_grpc_metadata_and_status(stubs):
    response = stubs["prediction"].GetModelMetadata(_metadata("text", "signature_def"), timeout=30)
    assert response.model_spec.name == "text" and response.model_spec.version.value == 2
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    assert {"serving_default", "lengths", "echo_float", "scalar", "types"} <= set(signatures.signature_def)
    status = stubs["model"].GetModelStatus(_status("text"), timeout=30)
    assert [(s.version, s.state) for s in status.model_version_status] == [
        (2, get_model_status_pb2.ModelVersionStatus.AVAILABLE), (1, get_model_status_pb2.ModelVersionStatus.AVAILABLE)]
