"""The client suite, against the in-process `Server` and `tfformer serve` (a subprocess), over REST and gRPC."""

import json
import math
import os

import numpy as np
import pytest

from tests.serving import models
from tfformer import cli, serving


@pytest.fixture(scope="module", params=["inprocess", "cli"])
def urls(request):
    if request.param == "inprocess":
        server = request.getfixturevalue("server")
        return server.grpc_url, server.rest_url
    return request.getfixturevalue("cli_server")


@pytest.fixture(params=["rest", "grpc"])
def client(urls, request):
    client = serving.Client(urls[1] if request.param == "rest" else urls[0])
    yield client
    client.close()


def test_predict_strings_in_row_format(client):
    outputs = client.predict("text", ["a b", "c"])
    assert set(outputs) == {"upper_bytes", "words", "version"}
    assert outputs["upper_bytes"].tolist() == [b"A B", b"C"]
    assert outputs["words"].dtype == np.int64 and outputs["words"].tolist() == [2, 1]
    assert outputs["version"].tolist() == [2, 2]


def test_predict_two_inputs_in_columnar_format(client):
    outputs = client.predict("multi", {"x": [[1, 2, 3], [0.5, 0, 0]], "ids": [[1, 2, 3, 4], [0, 0, 0, 0]]})
    assert outputs["total"].dtype == np.float32
    np.testing.assert_array_equal(outputs["total"], [[6, 6], [0.5, 0.5]])
    assert outputs["idsum"].dtype == np.int32
    np.testing.assert_array_equal(outputs["idsum"], [[10], [0]])


def test_predict_numpy_rows(client):
    outputs = client.predict("dense", np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(outputs["output_0"], np.full((2, 2), 3.0, np.float32))


def test_version_label_and_signature(client):
    assert client.predict("text", ["a"], version=1)["version"].tolist() == [1]
    assert client.predict("text", ["a"], label="stable")["version"].tolist() == [1]
    assert client.predict("text", ["a"], label="canary")["version"].tolist() == [2]
    assert client.predict("text", ["abc", ""], signature_name="lengths")["length"].tolist() == [3, 0]


def test_bytes_and_non_finite_values(client):
    assert client.predict("text", [b"\xff\xfe x"], signature_name="lengths")["length"].tolist() == [4]
    values = client.predict("text", [math.nan, math.inf, -math.inf, 0.1], signature_name="echo_float")["y"]
    assert values.dtype == np.float32
    assert math.isnan(values[0]) and values[1] == math.inf and values[2] == -math.inf
    assert values[3] == np.float32(0.1)


def test_status_and_metadata(client):
    status = client.status("text")
    assert [(entry["version"], entry["state"]) for entry in status["model_version_status"]] == [
        ("2", "AVAILABLE"), ("1", "AVAILABLE")]
    assert client.status("dense", version=1)["model_version_status"][0]["status"] == {
        "error_code": "OK", "error_message": ""}
    metadata = client.metadata("text", label="stable")
    assert metadata["model_spec"]["name"] == "text" and metadata["model_spec"]["version"] == "1"
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["inputs"]["text"]["dtype"] == "DT_STRING"


def test_errors(client):
    with pytest.raises(serving.ServingError) as raised:
        client.predict("nope", ["a"])
    assert raised.value.code == serving.Code.NOT_FOUND
    assert raised.value.message == "Servable not found for request: Latest(nope)"
    with pytest.raises(serving.ServingError) as raised:
        client.predict("text", ["a"], label="nope")
    assert raised.value.code == serving.Code.INVALID_ARGUMENT
    assert raised.value.message == "Unrecognized servable version label: nope"
    with pytest.raises(serving.ServingError) as raised:
        client.status("nope")
    assert (raised.value.code, raised.value.message) == (serving.Code.NOT_FOUND,
                                                         "Could not find any versions of model nope")


@pytest.mark.parametrize("ids, received", [([[1.7, 2, 3, 4]], "1.7"), ([[True, 2, 3, 4]], "true"),
                                           ([[2**31, 2, 3, 4]], "2147483648"), ("a", '"a"')])
def test_python_values_are_checked_as_over_rest_on_both_transports(client, ids, received):
    # Over gRPC the client converted them with numpy: 1.7 was sent as 1 (no error, a wrong sum), True as 1, and
    # "a" or 2**31 were a ValueError / OverflowError from numpy, not a status.
    with pytest.raises(serving.ServingError) as raised:
        client.predict("multi", {"x": [[1, 2, 3]], "ids": ids})
    assert raised.value.code == serving.Code.INVALID_ARGUMENT
    assert raised.value.message.startswith(f"JSON Value: {received} ")
    assert client.predict("multi", {"x": [[1, 2, 3]], "ids": [[1, 2, 3, 4]]})["idsum"].tolist() == [[10]]


def test_an_unknown_signature_gets_the_servers_answer(client):
    with pytest.raises(serving.ServingError) as raised:
        client.predict("text", ["a"], signature_name="zzz")
    assert (raised.value.code, raised.value.message) == (
        (serving.Code.INVALID_ARGUMENT, 'Serving signature name: "zzz" not found in signature def')
        if client.protocol == "rest" else (serving.Code.FAILED_PRECONDITION, 'Serving signature key "zzz" not found.'))


def test_a_client_follows_the_latest_version_when_its_signature_changes(tmp_path):
    # The client cached each signature's dtypes by (model, signature, version=None): after version 2 loaded with
    # other inputs, the same client sent its int32 `ids` as int64 over gRPC (INVALID_ARGUMENT) and read its
    # outputs with version 1's dtypes over REST.
    models.save_dense(str(tmp_path / "1"))
    server = serving.Server(model_name="m", model_base_path=str(tmp_path), file_system_poll_wait_seconds=0.2)
    server.start()
    try:
        clients = [serving.Client(server.rest_url), serving.Client(server.grpc_url)]
        for client in clients:
            assert client.predict("m", {"x": [[1, 1, 1]]})["output_0"].tolist() == [[3.0, 3.0]]
        models.save_seq(str(tmp_path / ".2"))
        os.rename(tmp_path / ".2", tmp_path / "2")
        server.manager.wait_for_version("m", 2)
        for client in clients:
            fresh = serving.Client(client.url)
            expected = fresh.predict("m", {"ids": [[1, 2]]})
            outputs = client.predict("m", {"ids": [[1, 2]]})
            assert {alias: (value.dtype, value.tolist()) for alias, value in outputs.items()} == {
                alias: (value.dtype, value.tolist()) for alias, value in expected.items()}, client.protocol
            assert client.predict("m", {"ids": [[1, 2]]}, version=2)["total"].tolist() == [3]  # cached
            fresh.close()
            client.close()
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_tfformer_predict_command(urls, protocol, capsys):
    url = urls[1] if protocol == "rest" else urls[0]
    assert cli.main(["predict", "--server", url, "--model", "text", "--signature_name", "lengths", "abc", "de"]) == 0
    assert capsys.readouterr().out.splitlines() == ['{"length": 3}', '{"length": 2}']
    assert cli.main(["predict", "--server", url, "--model", "text", "hello world"]) == 0
    assert json.loads(capsys.readouterr().out) == {"upper_bytes": "HELLO WORLD", "words": 2, "version": 2}
    assert cli.main(["predict", "--server", url, "--model", "nope", "x"]) == 1
    assert "Servable not found for request: Latest(nope)" in capsys.readouterr().err


def test_no_reply_is_a_status_on_both_transports(capsys):
    """A server that cannot be reached is UNAVAILABLE, one that never answers DEADLINE_EXCEEDED after `timeout`, on
    REST as gRPC reports them: a `ServingError`, and `tfformer predict` exits 1 with one line."""
    import socket

    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            refused = closed.getsockname()[1]  # nothing listens on it once closed
        for scheme in ("http", "grpc"):
            for port, code in ((refused, serving.Code.UNAVAILABLE), (silent.getsockname()[1],
                                                                      serving.Code.DEADLINE_EXCEEDED)):
                with serving.Client(f"{scheme}://127.0.0.1:{port}", timeout=0.5) as client:
                    with pytest.raises(serving.ServingError) as raised:
                        client.predict("text", ["a"])
                assert raised.value.code == code, (scheme, raised.value)
            assert cli.main(["predict", "--server", f"{scheme}://127.0.0.1:{refused}", "--model", "text", "x"]) == 1
            assert capsys.readouterr().err.startswith("tfformer: error: UNAVAILABLE: ")
            for timeout in ("0", "-1"):  # not a connection error, nor gRPC's "Timeout value out of range"
                assert cli.main(["predict", "--server", f"{scheme}://127.0.0.1:{refused}", "--model", "text",
                                 "--timeout", timeout, "x"]) == 2
                assert "`timeout` must be a number of seconds > 0" in capsys.readouterr().err


def test_server_ports_and_workers_out_of_range_are_refused(tmp_path, capsys):
    """A port outside [0, 65535] (socket libraries wrap 70000 to 4464) and no worker threads are refused by name,
    before the server binds or loads anything, in Python and on the command line."""
    for kwargs, message in (({"port": 70000}, "`port` must be a port in [0, 65535]"),
                            ({"rest_api_port": -1}, "`rest_api_port` must be a port in [0, 65535]"),
                            ({"num_workers": 0}, "`num_workers` must be a positive integer")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            serving.Server(model_name="m", model_base_path=str(tmp_path), **kwargs)
    for flag, value in (("--port", "-5"), ("--rest_api_port", "70000"), ("--rest_api_num_threads", "0")):
        assert cli.main(["serve", "--model_base_path", str(tmp_path), flag, value]) == 2
        assert f"{flag} must be an integer in [" in capsys.readouterr().err
