"""TF Serving's JSON details: RapidJSON parse errors, float printing, pretty layout (no server needed)."""

import math

import numpy as np
import pytest

from tfformer.serving import rapidjson
from tfformer.serving.json_tensor import COLUMNAR, ROW, make_json_from_tensors
from tfformer.serving.status import Code, ServingError


@pytest.mark.parametrize("body, message", [
    (b"", "JSON Parse error: The document is empty"),
    (b" \n", "JSON Parse error: The document is empty. at offset: 2"),
    (b"{", "JSON Parse error: Missing a name for object member. at offset: 1"),
    (b'{"a" 1}', "JSON Parse error: Missing a colon after a name of object member. at offset: 5"),
    (b'{"a": 1 "b": 2}', "JSON Parse error: Missing a comma or '}' after an object member. at offset: 8"),
    (b'{"a": 1,}', "JSON Parse error: Missing a name for object member. at offset: 8"),
    (b"[1, 2", "JSON Parse error: Missing a comma or ']' after an array element. at offset: 5"),
    (b"[1.]", "JSON Parse error: Miss fraction part in number. at offset: 3"),
    (b"[1e+]", "JSON Parse error: Miss exponent in number. at offset: 4"),
    (b"[1e400]", "JSON Parse error: Number too big to be stored in double. at offset: 1"),
    (b"[tru]", "JSON Parse error: Invalid value. at offset: 4"),
    (b"[Infinit]", "JSON Parse error: Invalid value. at offset: 8"),
    (b'["\\q"]', "JSON Parse error: Invalid escape character in string. at offset: 2"),
    (b'["\\u12G4"]', "JSON Parse error: Incorrect hex digit after \\u escape in string. at offset: 2"),
    (b'["\\ud800"]', "JSON Parse error: The surrogate pair in string is invalid. at offset: 2"),
    (b'["a\nb"]', "JSON Parse error: Invalid encoding in string. at offset: 3"),  # 1.1.0: "Invalid escape ..."
    (b'["abc', "JSON Parse error: Missing a closing quotation mark in string. at offset: 5"),
    (b"{} []", "JSON Parse error: The document root must not be followed by other values. at offset: 3"),
])
def test_parse_errors_match_rapidjson(body, message):
    with pytest.raises(ServingError) as raised:
        rapidjson.parse(body)
    assert raised.value.message == message


def test_parse_accepts_what_rapidjson_accepts():
    value = rapidjson.parse(b'{"a": [NaN, Inf, -Infinity, -Inf, 18446744073709551615, 18446744073709551616, 1.0], '
                            b'"s": "\\ud83d\\ude00\xc3\xa9", "a": 2}\x00trailing')
    numbers = value["a"]
    assert math.isnan(numbers[0]) and numbers[1] == math.inf and numbers[2] == numbers[3] == -math.inf
    assert numbers[4] == 2**64 - 1 and isinstance(numbers[4], int)
    assert isinstance(numbers[5], float) and isinstance(numbers[6], float)  # past uint64: a double
    assert rapidjson.to_bytes(value["s"]) == "\U0001F600\u00e9".encode()
    assert value.member_count == 3  # the first duplicate wins, as FindMember does
    assert rapidjson.parse(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a UTF-8 byte order mark is skipped
    assert rapidjson.parse(b"\xbb[1]") == [1]  # each byte of a BOM is skipped on its own


# TF Serving's RapidJSON 1.1.0 reads on where python-rapidjson's newer RapidJSON stops: raw bytes that are not
# UTF-8, lone low surrogates, NaN/Infinity with a fraction, overflow to Infinity. These are malformed JSON: they get
# TF Serving's error (INVALID_ARGUMENT, `JSON Parse error: ... at offset: N`) with python-rapidjson's message.
@pytest.mark.parametrize("body, message", [
    (b'["\\udc00"]', "The surrogate pair in string is invalid. at offset: 2"),
    (b'["a\xffb"]', "Invalid encoding: byte 0xff is not UTF-8. at offset: 3"),
    (b"\xef\xbb\xbf[\xff]", "Invalid encoding: byte 0xff is not UTF-8. at offset: 4"),
    (b"[NaN.5]", "Missing a comma or ']' after an array element. at offset: 4"),
    (b"[10e308]", "Number too big to be stored in double. at offset: 1"),
    (b"[0e309]", "Number too big to be stored in double. at offset: 1"),
    (b"\xef\xbb\xbf  ", "The document is empty. at offset: 5"),
    (b"[" * 100_000, "Terminate parsing due to Handler error."),
])
def test_bodies_rapidjson_1_1_0_read_on_are_refused(body, message):
    with pytest.raises(ServingError) as raised:
        rapidjson.parse(body)
    assert raised.value.code == Code.INVALID_ARGUMENT
    assert raised.value.message.startswith("JSON Parse error: " + message)


def test_doubles_are_rapidjsons_conversion():
    # Without kParseFullPrecisionFlag RapidJSON does not always return the nearest double; TF Serving gets this one.
    value = rapidjson.parse(b"[9.041138514025523]")[0]
    assert value == 9.0411385140255245 and value != float("9.041138514025523")


@pytest.mark.parametrize("value, single, text", [
    (3.0, True, "3.0"), (0.1, True, "0.1"), (1 / 3, True, "0.333333343"), (1 / 3, False, "0.33333333333333331"),
    (1e-5, True, "1e-05"), (9e6, True, "9e+06"), (1234567.0, True, "1234567.0"), (100000.0, True, "100000.0"),
    (-0.0, True, "-0.0"), (math.nan, True, "NaN"), (math.inf, True, "Infinity"), (-math.inf, False, "-Infinity"),
])
def test_format_decimal(value, single, text):
    assert rapidjson.format_decimal(value, single) == text


def test_value_to_string_is_rapidjson_pretty():
    value = rapidjson.parse(b'{"a": [1, 2.5, "x\\n\\u0001"], "b": {}, "c": [], "d": 1e21}')
    assert rapidjson.value_to_string(value) == (
        '{\n    "a": [\n        1,\n        2.5,\n        "x\\n\\u0001"\n    ],\n    "b": {},\n    "c": [],\n'
        '    "d": 1e21\n}')
    assert rapidjson.value_to_string(1.0) == "1.0"
    assert rapidjson.value_to_string(rapidjson.parse(b"[1.0, NaN, 2]")) == "[\n    1.0,\n    "  # Writer stops at NaN


def test_value_to_string_writes_doubles_as_rapidjson_1_1_0():
    # Writer::Double prints Grisu2's digits, not always Python's shortest ones; expected from a C++ build of 1.1.0.
    value = rapidjson.parse(b"[4.445845492335538e16, 2.6193268631901468e16, 9.708339688384588e-09, 0.3, 5e-324, "
                            b"1.7976931348623157e308]")
    assert rapidjson.value_to_string(value) == (
        "[\n    44458454923355379.0,\n    26193268631901469.0,\n    9.708339688384589e-9,\n    0.3,\n    5e-324,\n"
        "    1.7976931348623157e308\n]")


def test_prediction_layout():
    outputs = {"a": np.array([[1.0, 2.5]], np.float32), "b": np.array([7], np.int64)}
    assert make_json_from_tensors(outputs, ROW) == (
        '{\n    "predictions": [\n        {\n            "a": [1.0, 2.5],\n            "b": 7\n        }\n    ]\n}')
    assert make_json_from_tensors({"a": outputs["a"]}, ROW) == '{\n    "predictions": [[1.0, 2.5]\n    ]\n}'
    assert make_json_from_tensors({"a": outputs["a"]}, COLUMNAR) == (
        '{\n    "outputs": [\n        [\n            1.0,\n            2.5\n        ]\n    ]\n}')
    strings = {"out_bytes": np.array([b"\x00\xff"], object), "text": np.array([b"caf\xc3\xa9"], object)}
    assert make_json_from_tensors(strings, ROW) == (
        '{\n    "predictions": [\n        {\n            "out_bytes": {\n                "b64": "AP8="\n'
        '            },\n            "text": "caf\u00e9"\n        }\n    ]\n}')
    with pytest.raises(ServingError, match="inconsistent batch size: 2 expecting: 1"):
        make_json_from_tensors({"a": np.zeros((1,)), "b": np.zeros((2,))}, ROW)
