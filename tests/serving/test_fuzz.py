"""Fuzzing: generated request bodies never get a 5xx and never take the server down."""

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.conftest import http_request

# Everything but `slow` (its input is a duration: a fuzzed 1e9 would legitimately run for ever).
PATHS = [
    "/v1/models/dense:predict", "/v1/models/multi:predict", "/v1/models/text:predict",
    "/v1/models/text/versions/1:predict", "/v1/models/text/labels/canary:predict", "/v1/models/nope:predict",
    "/v1/models/dense:classify", "/v1/models/text:regress", "/v1/models/dense/versions/2:predict",
]
SIGNATURES = ["serving_default", "lengths", "echo_float", "scalar", "types", "nope", ""]
KEYS = ["instances", "inputs", "signature_name", "examples", "context", "x", "ids", "text", "b64", "f64", "i64", "b",
        "u8"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 255, 256, 2**31, 2**63, 2**64, 16777217, 0.5, 1e38, 1e39, -0.0, "NaN"]),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=4)), children, max_size=4),
        st.builds(lambda text: {"b64": text}, st.text(alphabet="QUFBQQ==+/@", max_size=8)),
    ),
    max_leaves=24,
)
documents = st.fixed_dictionaries(
    {},
    optional={
        "signature_name": st.one_of(st.sampled_from(SIGNATURES), values),
        "instances": values,
        "inputs": values,
        "examples": values,
        "context": values,
    },
)


numbers = st.one_of(st.integers(min_value=-300, max_value=300), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([2**31, 2**63, 2**64, 16777217, True, "a"]))
rows = st.lists(st.one_of(numbers, st.lists(numbers, min_size=2, max_size=4)), min_size=1, max_size=4)
strings = st.one_of(st.text(max_size=6), st.builds(lambda text: {"b64": text}, st.sampled_from(["QQ==", "QUI", "@"])),
                    numbers)
# Near-valid requests: the right structure for a model, with values and shapes varied.
tensor_requests = st.one_of(
    st.builds(lambda r: {"instances": r}, st.lists(st.lists(numbers, min_size=2, max_size=4), min_size=1, max_size=3)),
    st.builds(lambda r: {"inputs": r}, rows),
    st.builds(lambda r, sig: {"signature_name": sig, "instances": r}, st.lists(strings, min_size=1, max_size=3),
              st.sampled_from(SIGNATURES)),
    st.builds(lambda r, sig: {"signature_name": sig, "inputs": r}, rows, st.sampled_from(["echo_float", "scalar"])),
    st.builds(lambda items: {"instances": items},
              st.lists(st.dictionaries(st.sampled_from(["x", "ids", "z"]), st.lists(numbers, min_size=3, max_size=4),
                                       min_size=1, max_size=3), min_size=1, max_size=3)),
    st.builds(lambda inputs: {"signature_name": "types", "inputs": inputs},
              st.dictionaries(st.sampled_from(["f64", "i64", "b", "u8"]), st.lists(numbers, min_size=1, max_size=3),
                              min_size=3, max_size=4)),
)


def _splice(parts):
    body, position, junk = parts
    position %= len(body) + 1
    return body[:position] + junk + body[position:]


def _encode(document):
    return json.dumps(document, allow_nan=True).encode()


bodies = st.one_of(
    tensor_requests.map(_encode),
    tensor_requests.map(_encode),
    documents.map(_encode),
    values.map(_encode),
    st.binary(max_size=64),
    # Valid documents with a byte flipped, cut short, or with invalid UTF-8 / NUL inside.
    st.tuples(documents.map(_encode), st.integers(min_value=0), st.binary(min_size=1, max_size=3)).map(_splice),
)


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=bodies)
def test_fuzzed_bodies_never_get_a_5xx(server, path, body):
    status, headers, data = http_request(server.rest_url, "POST", path, body)
    assert status < 500, (status, data)
    assert headers.get("content-type") == "application/json"
    reply = json.loads(data, parse_constant=lambda token: math.nan)
    assert ("error" in reply) == (status != 200)


def test_server_is_alive_after_fuzzing(server):
    status, _, data = http_request(server.rest_url, "POST", "/v1/models/dense:predict", b'{"instances": [[1, 1, 1]]}')
    assert (status, json.loads(data)) == (200, {"predictions": [[3.0, 3.0]]})
