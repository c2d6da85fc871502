import http.client
import os
import re
import subprocess
import sys
import time
import urllib.parse

import pytest

from tests.serving import models
from tfformer import serving

READY = re.compile(r"tfformer serve: gRPC at (\S+):(\d+), REST at (http://\S+)")


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving_models")
    models.build_model_root(root)
    return root


@pytest.fixture(scope="session")
def server(model_root):
    """The in-process server on ephemeral ports, serving dense, multi, text (versions 1, 2; labels), slow."""
    server = serving.Server(model_config_file=os.path.join(model_root, "models.config"),
                            file_system_poll_wait_seconds=0)
    server.start()
    yield server
    server.stop()


def spawn_cli_server(config_path, log_path, *flags):
    """Starts `tfformer serve` as a subprocess on free ports (returns at once; see `wait_for_cli_server`)."""
    command = [sys.executable, "-m", "tfformer.cli", "serve", "--model_config_file", str(config_path), "--port", "0",
               "--rest_api_port", str(free_port()), *flags]
    log = open(log_path, "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def wait_for_cli_server(process, log_path, timeout=120):
    """Waits for the ready line; returns (grpc_url, rest_url)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path) as handle:
            match = READY.search(handle.read())
        if match:
            return f"grpc://{match.group(1)}:{match.group(2)}", match.group(3)
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    with open(log_path) as handle:
        raise RuntimeError(f"tfformer serve did not start:\n{handle.read()[-3000:]}")


def start_cli_server(config_path, log_path, *flags, attempts=3):
    """`tfformer serve` as a subprocess on free ports; returns (process, grpc_url, rest_url) once it serves.

    `free_port` closes its probe socket before the server starts, so another process (the other test worker's
    client connections) can take that port first: the server then exits with "Address already in use", and it
    is started again on a new port, up to `attempts` times."""
    for attempt in range(attempts):
        process = spawn_cli_server(config_path, log_path, *flags)
        try:
            return (process, *wait_for_cli_server(process, log_path))
        except RuntimeError as error:
            if "Address already in use" not in str(error) or attempt == attempts - 1:
                raise


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def cli_server(model_root, tmp_path_factory):
    """`tfformer serve --model_config_file ...` in a subprocess: (grpc_url, rest_url)."""
    log_path = tmp_path_factory.mktemp("cli_server") / "serve.log"
    process, grpc_url, rest_url = start_cli_server(os.path.join(model_root, "models.config"), log_path,
                                                   "--file_system_poll_wait_seconds", "0")
    yield grpc_url, rest_url
    process.terminate()
    process.wait(timeout=60)


def http_request(url, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request."""
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()
