"""Request-size limit, timeouts, graceful shutdown on SIGTERM, and the access log."""

import json
import os
import signal
import socket
import threading
import time

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.serving.conftest import http_request, start_cli_server
from tfformer import serving


def test_request_size_limit_rest_and_grpc(model_root):
    config = os.path.join(model_root, "models.config")
    with serving.Server(model_config_file=config, file_system_poll_wait_seconds=0, max_request_bytes=4096) as server:
        small = json.dumps({"instances": [[1, 1, 1]]}).encode()
        assert http_request(server.rest_url, "POST", "/v1/models/dense:predict", small)[0] == 200
        large = json.dumps({"instances": [[1.0, 1.0, 1.0]] * 1000}).encode()
        code, headers, body = http_request(server.rest_url, "POST", "/v1/models/dense:predict", large)
        assert code == 413 and headers["content-type"] == "application/json"
        assert json.loads(body) == {"error": f"Request body of {len(large)} bytes exceeds the limit of 4096 bytes"}
        # Without a Content-Length (chunked), the limit applies while reading.
        chunks = (large[i:i + 1000] for i in range(0, len(large), 1000))
        assert http_request(server.rest_url, "POST", "/v1/models/dense:predict", chunks)[0] == 413
        assert http_request(server.rest_url, "POST", "/v1/models/dense:predict", small)[0] == 200
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "dense"
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((1000, 3), np.float32)))
        stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(server.grpc_url[7:]))
        with pytest.raises(grpc.RpcError) as raised:
            stub.Predict(request, timeout=30)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_default_request_size_limit_is_16_mib(server):
    body = b'{"instances": [' + b" " * (16 * 1024 * 1024) + b"]}"
    code, _, reply = http_request(server.rest_url, "POST", "/v1/models/dense:predict", body)
    assert code == 413, reply
    assert b"exceeds the limit of 16777216 bytes" in reply


def test_timeouts(model_root):
    config = os.path.join(model_root, "models.config")
    with serving.Server(model_config_file=config, file_system_poll_wait_seconds=0,
                        rest_api_timeout_in_ms=300) as server:
        start = time.monotonic()
        code, _, body = http_request(server.rest_url, "POST", "/v1/models/slow:predict", b'{"instances": [1.5]}')
        assert (code, json.loads(body)) == (504, {"error": "Timed out waiting for notification"})
        assert time.monotonic() - start < 1.4
        time.sleep(1.5)  # the timed-out computation still runs to its end (TF cannot cancel it); then
        code, _, body = http_request(server.rest_url, "POST", "/v1/models/slow:predict", b'{"instances": [0.01]}')
        assert code == 200 and json.loads(body)["predictions"][0] > 0
        client = serving.Client(server.grpc_url, timeout=0.3)
        with pytest.raises(serving.ServingError) as raised:
            client.predict("slow", {"seconds": [1.5]})
        assert raised.value.code == serving.Code.DEADLINE_EXCEEDED
        time.sleep(1.5)
        assert serving.Client(server.grpc_url).predict("slow", {"seconds": [0.01]})["iterations"][0] > 0


def test_sigterm_lets_in_flight_requests_finish(model_root, tmp_path):
    config = tmp_path / "slow.config"
    config.write_text(f"model_config_list {{ config {{ name: 'slow' base_path: '{model_root}/slow' "
                      "model_platform: 'tensorflow' } }")
    process, grpc_url, rest_url = start_cli_server(config, tmp_path / "serve.log")
    try:
        results = {}

        def call(name, url, body):
            results[name] = http_request(url, "POST", "/v1/models/slow:predict", body)

        def call_grpc():
            results["grpc"] = serving.Client(grpc_url).predict("slow", {"seconds": [1.5]})

        threads = [threading.Thread(target=call, args=("rest", rest_url, b'{"instances": [1.5]}')),
                   threading.Thread(target=call_grpc)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both requests are running now
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        assert process.wait(timeout=60) == 0
        code, _, body = results["rest"]
        assert code == 200 and json.loads(body)["predictions"][0] > 0
        assert results["grpc"]["iterations"][0] > 0
        port = int(rest_url.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        log = (tmp_path / "serve.log").read_text()
        assert "shutting down" in log
    finally:
        if process.poll() is None:
            process.kill()


def test_access_log_lines(model_root, tmp_path):
    path = tmp_path / "access.log"
    config = os.path.join(model_root, "models.config")
    with serving.Server(model_config_file=config, file_system_poll_wait_seconds=0, access_log=str(path)) as server:
        ok = http_request(server.rest_url, "POST", "/v1/models/dense:predict", b'{"instances": [[1, 1, 1]]}')
        assert ok[0] == 200
        assert http_request(server.rest_url, "POST", "/v1/models/nope:predict", b'{"instances": [1]}')[0] == 404
        assert http_request(server.rest_url, "GET", "/v1/models/dense")[0] == 200
        client = serving.Client(server.grpc_url)
        client.predict("dense", {"x": [[1, 2, 3]]})
        with pytest.raises(serving.ServingError):
            client.predict("dense", {"x": [[1, 2, 3]]}, version=9)
    lines = path.read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    rest = [entry for entry in entries if entry["protocol"] == "http"]
    assert [(e["method"], e["path"], e["status"], e["code"], e.get("api")) for e in rest] == [
        ("POST", "/v1/models/dense:predict", 200, "OK", "predict"),
        ("POST", "/v1/models/nope:predict", 404, "NOT_FOUND", "predict"),
        ("GET", "/v1/models/dense", 200, "OK", "status"),
    ]
    assert rest[1]["error"] == "Servable not found for request: Latest(nope)"
    for entry in entries:
        assert set(entry) >= {"time", "protocol", "method", "path", "status", "code", "duration_ms", "client"}
        assert entry["time"].endswith("+00:00") and entry["duration_ms"] >= 0
    assert rest[0]["model"] == "dense" and rest[0]["bytes_in"] == 26 and rest[0]["bytes_out"] > 0
    grpc_entries = [(e["path"], e["status"], e["model"]) for e in entries if e["protocol"] == "grpc"]
    assert ("/tensorflow.serving.PredictionService/Predict", "OK", "dense") in grpc_entries
    # The client reads the signature first, so the unknown version fails in GetModelMetadata.
    assert grpc_entries[-1] == ("/tensorflow.serving.PredictionService/GetModelMetadata", "NOT_FOUND", "dense")
