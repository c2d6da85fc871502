"""The embedded model server: REST (uvicorn) + gRPC over one `ModelManager` and one bounded worker pool.

    server = tfformer.serving.Server(model_name="translator", model_base_path="export/translator")
    ports = server.start()          # ephemeral ports by default: Ports(grpc=..., rest=...)
    ...
    server.stop()                   # graceful: in-flight requests complete

`tfformer serve` runs the same server with TF Serving's flags and ports
(gRPC 8500, REST 8501) and stops gracefully on SIGTERM/SIGINT.
"""

import asyncio
import collections
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import uvicorn

from tfformer.checks import check_int
from tfformer.serving import batching, monitoring
from tfformer.serving import config as config_lib
from tfformer.serving.grpc_service import add_servicers
from tfformer.serving.manager import ModelManager
from tfformer.serving.rest import RestApiHandler, RestApp

log = logging.getLogger("tfformer.serving")

Ports = collections.namedtuple("Ports", ["grpc", "rest"])
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
MAX_CONCURRENT_RPCS = 256


def batching_options(enable_batching, batching_parameters_file=None, batching_parameters=None):
    """The server's `batching.BatchingOptions`, or None without batching (`--enable_batching`,
    `--batching_parameters_file`; TF Serving's defaults when no file is given).

    Raises:
        ValueError: a parameters file without `enable_batching`, or one that is unreadable, not a valid
            `BatchingParameters` text proto (an unknown field, ...), or holds values TF Serving refuses.
    """
    if batching_parameters_file and not enable_batching:
        raise ValueError("server_options.batching_parameters_file is set without setting "
                         "server_options.enable_batching to true.")
    if not enable_batching:
        return None
    if batching_parameters is not None:
        return batching_parameters
    if not batching_parameters_file:
        return batching.BatchingOptions()
    message = config_lib.read_text_proto(batching_parameters_file, "BatchingParameters")
    try:
        return batching.BatchingOptions.from_proto(message)
    except ValueError as error:
        raise ValueError(f"Invalid batching parameters in {batching_parameters_file}: {error}") from None


def prometheus_path(monitoring_config_file):
    """The Prometheus metrics path a `--monitoring_config_file` enables, or None."""
    if not monitoring_config_file:
        return None
    config = config_lib.read_text_proto(monitoring_config_file, "MonitoringConfig")
    if not config.prometheus_config.enable:
        return None
    return config.prometheus_config.path or monitoring.PROMETHEUS_PATH


class AccessLog:
    """A structured access log: one JSON object per request and line.

    Fields: `time` (UTC, ISO 8601), `protocol` (`http`/`grpc`), `method`, `path`, `status` (HTTP status,
    or gRPC code name), `code` (status code name), `model`, `api`, `duration_ms`, `bytes_in`,
    `bytes_out`, `client`, and `error` (the message) for failed requests. Missing values are left out.

    Args:
        target: `"-"` for stdout, a file path (appended to), or a writable text stream.
    """

    def __init__(self, target="-"):
        self._lock = threading.Lock()
        self._owned = False
        if target == "-":
            self._stream = sys.stdout
        elif isinstance(target, (str, os.PathLike)):
            self._stream = open(target, "a", buffering=1, encoding="utf-8")
            self._owned = True
        else:
            self._stream = target

    def write(self, **fields):
        entry = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")}
        for key, value in fields.items():
            if value is not None:
                entry[key] = round(value, 3) if key == "duration_ms" else value
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()

    def close(self):
        if self._owned:
            self._stream.close()


def _bind(host, port):
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url_host(host):
    return f"[{host}]" if ":" in host else host


class Server:
    """TF Serving's REST and gRPC APIs over local SavedModels, in this process.

    Give either `model_name` + `model_base_path`, `model_config_file`, or `config` (a
    `ModelServerConfig`).

    Args:
        model_name: str. The model's name in URLs and `ModelSpec`s.
        model_base_path: str. Directory holding numeric version directories.
        model_config_file: str. A models.config text proto (TF Serving's `--model_config_file`).
        config: `ModelServerConfig` proto.
        host: str. Address to bind. Defaults to `127.0.0.1`.
        port: int or None. gRPC port; 0 picks a free one, None disables gRPC.
        rest_api_port: int or None. REST port; 0 picks a free one, None disables REST.
        file_system_poll_wait_seconds: float. Version polling interval (0: only when a config is applied).
        model_config_file_poll_wait_seconds: float. Re-read `model_config_file` this often (0: never).
        rest_api_timeout_in_ms: int. REST requests running longer get 504 (gRPC uses the client's deadline).
        max_request_bytes: int. Larger REST bodies get 413; larger gRPC messages RESOURCE_EXHAUSTED.
        num_workers: int. Requests (REST and gRPC) computed at the same time; the rest wait in a queue.
        access_log: None, `"-"` (stdout), a path, a stream, or an `AccessLog`.
        grace_period_seconds: float. How long `stop()` lets in-flight requests finish.
        allow_version_labels_for_unavailable_models, max_num_load_retries, load_retry_interval_micros:
            as TF Serving's flags of the same names.
        enable_batching: bool. Batch concurrent Predict requests (`batching.py`), with TF Serving's default
            parameters unless `batching_parameters_file` (a `BatchingParameters` text proto) or
            `batching_parameters` (`batching.BatchingOptions`) is given.
        monitoring_config_file: str. A `MonitoringConfig` text proto; `prometheus_config { enable: true }`
            serves the metrics at its `path` (default `/monitoring/prometheus/metrics`) on the REST port.
        enable_model_warmup: bool. Replay each version's `assets.extra/tf_serving_warmup_requests` before it
            becomes AVAILABLE (TF Serving's `--enable_model_warmup`, default on).
        num_request_iterations_for_warmup: int. Runs of each warm-up record; used only if > 0, else 1 (TF
            Serving's `--num_request_iterations_for_warmup`).
    """

    def __init__(self, model_name=None, model_base_path=None, model_config_file=None, config=None,
                 host="127.0.0.1", port=0, rest_api_port=0, file_system_poll_wait_seconds=1.0,
                 model_config_file_poll_wait_seconds=0.0, rest_api_timeout_in_ms=30000,
                 max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, num_workers=4, access_log=None,
                 grace_period_seconds=30.0, allow_version_labels_for_unavailable_models=False,
                 max_num_load_retries=5, load_retry_interval_micros=60_000_000, enable_batching=False,
                 batching_parameters_file=None, batching_parameters=None, monitoring_config_file=None,
                 enable_model_warmup=True, num_request_iterations_for_warmup=0):
        for name, value in (("port", port), ("rest_api_port", rest_api_port)):
            check_int(name, value, minimum=0, maximum=65535, allow_none=True,
                      expected="a port in [0, 65535] (0: a free one)")
        check_int("num_workers", num_workers)
        check_int("max_request_bytes", max_request_bytes)
        given = sum(item is not None for item in (model_base_path, model_config_file, config))
        if given != 1:
            raise ValueError("Give exactly one of `model_base_path` (with `model_name`), `model_config_file` or "
                             "`config`.")
        if model_config_file is not None:
            config = config_lib.read_config_file(model_config_file)
        elif model_base_path is not None:
            config = config_lib.single_model_config(model_name or "default", model_base_path)
        self.model_config_file = model_config_file
        self.config = config
        self.host = host
        self._requested_ports = Ports(port, rest_api_port)
        self.rest_api_timeout_in_ms = rest_api_timeout_in_ms
        self.max_request_bytes = int(max_request_bytes)
        self.num_workers = int(num_workers)
        self.model_config_file_poll_wait_seconds = model_config_file_poll_wait_seconds
        self.grace_period_seconds = grace_period_seconds
        if access_log is None or isinstance(access_log, AccessLog):
            self.access_log = access_log
        else:
            self.access_log = AccessLog(access_log)
        self.batching = batching_options(enable_batching, batching_parameters_file, batching_parameters)
        self.metrics_path = prometheus_path(monitoring_config_file)
        self.metrics = monitoring.Metrics()
        self._scheduler = batching.SharedBatchScheduler(self.batching, self.metrics) if self.batching else None
        self.manager = ModelManager(
            poll_wait_seconds=file_system_poll_wait_seconds,
            max_num_load_retries=max_num_load_retries,
            load_retry_interval_seconds=load_retry_interval_micros / 1e6,
            allow_version_labels_for_unavailable_models=allow_version_labels_for_unavailable_models,
            enable_model_warmup=enable_model_warmup,
            num_request_iterations_for_warmup=num_request_iterations_for_warmup,
            **({"loader": batching.loader(self._scheduler)} if self._scheduler else {}),
        )
        self.ports = None
        self._executor = None
        self._grpc_server = None
        self._uvicorn = None
        self._rest_thread = None
        self._config_poller = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()

    # ---------------------------------------------------------------------------------------

    def start(self):
        """Loads the models (blocking until their first versions are available), then opens the ports.

        Returns:
            `Ports(grpc, rest)`: the bound port numbers (None for a disabled API).
        """
        if self._scheduler is not None:
            self._scheduler.start()  # before the first load: warm-up requests go through the batcher too
        try:
            self.manager.start(self.config)
        except BaseException:
            self.manager.stop()
            if self._scheduler is not None:
                self._scheduler.stop()
            raise
        self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tfformer-serving-worker")
        try:
            grpc_port = self._start_grpc() if self._requested_ports.grpc is not None else None
            rest_port = self._start_rest() if self._requested_ports.rest is not None else None
        except BaseException:
            self.stop(grace=0)
            raise
        if self.model_config_file and self.model_config_file_poll_wait_seconds > 0:
            self._config_poller = threading.Thread(target=self._poll_config_file, daemon=True,
                                                   name="tfformer-serving-config")
            self._config_poller.start()
        self.ports = Ports(grpc_port, rest_port)
        return self.ports

    def _start_grpc(self):
        options = [("grpc.max_receive_message_length", self.max_request_bytes),
                   ("grpc.max_send_message_length", -1)]
        # With batching, an RPC's thread waits for its batch (the workers do not): as many threads as RPCs.
        threads = MAX_CONCURRENT_RPCS if self.batching else 2 * self.num_workers + 2
        self._grpc_server = grpc.server(ThreadPoolExecutor(threads, thread_name_prefix="tfformer-serving-grpc"),
                                        options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        add_servicers(self._grpc_server, self.manager, self._executor, self.access_log)
        port = self._grpc_server.add_insecure_port(f"{_url_host(self.host)}:{self._requested_ports.grpc}")
        if port == 0:
            raise OSError(f"Cannot bind the gRPC port {self.host}:{self._requested_ports.grpc}.")
        self._grpc_server.start()
        return port

    def _start_rest(self):
        sock = _bind(self.host, self._requested_ports.rest)
        timeout = self.rest_api_timeout_in_ms / 1000 if self.rest_api_timeout_in_ms > 0 else None
        app = RestApp(RestApiHandler(self.manager), self._executor, self.max_request_bytes, timeout,
                      self.access_log, metrics=self.metrics if self.metrics_path else None,
                      metrics_path=self.metrics_path)
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", access_log=False,
                                loop="asyncio", http="h11", timeout_graceful_shutdown=self.grace_period_seconds,
                                timeout_keep_alive=30)
        self._uvicorn = uvicorn.Server(config)
        self._rest_thread = threading.Thread(target=lambda: asyncio.run(self._uvicorn.serve(sockets=[sock])),
                                             name="tfformer-serving-rest", daemon=True)
        self._rest_thread.start()
        while not self._uvicorn.started:
            if not self._rest_thread.is_alive():
                raise OSError(f"The REST server on {self.host}:{sock.getsockname()[1]} did not start.")
            time.sleep(0.01)
        return sock.getsockname()[1]

    def _poll_config_file(self):
        current = self.config.SerializeToString()
        while not self._stopping.wait(self.model_config_file_poll_wait_seconds):
            try:
                new = config_lib.read_config_file(self.model_config_file)
                if new.SerializeToString() != current:
                    log.info("Reloading %s", self.model_config_file)
                    self.manager.reload_config(new)
                    current = new.SerializeToString()
            except Exception as error:  # a bad edit must not stop the server
                log.error("Could not apply %s: %s", self.model_config_file, error)

    # ---------------------------------------------------------------------------------------

    @property
    def rest_url(self):
        return None if not self.ports or self.ports.rest is None else f"http://{_url_host(self.host)}:{self.ports.rest}"

    @property
    def grpc_url(self):
        return None if not self.ports or self.ports.grpc is None else f"grpc://{_url_host(self.host)}:{self.ports.grpc}"

    def stop(self, grace=None):
        """Stops accepting requests, lets in-flight ones finish (up to `grace` seconds), unloads the models."""
        if self._stopping.is_set():
            self._stopped.wait()
            return
        self._stopping.set()
        grace = self.grace_period_seconds if grace is None else grace
        grpc_stopped = self._grpc_server.stop(grace) if self._grpc_server is not None else None
        if self._uvicorn is not None:
            self._uvicorn.config.timeout_graceful_shutdown = grace
            self._uvicorn.should_exit = True
            self._rest_thread.join()
        if grpc_stopped is not None:
            grpc_stopped.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._config_poller is not None:
            self._config_poller.join()
        self.manager.stop()
        if self._scheduler is not None:
            self._scheduler.stop()
        if self.access_log is not None:
            self.access_log.close()
        self._stopped.set()

    def __enter__(self):
        if self.ports is None:
            self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()


def run_server(**kwargs):
    """Runs a `Server` until SIGTERM or SIGINT, then stops it gracefully (the `tfformer serve` command).

    Prints one line when serving: `tfformer serve: gRPC at host:port, REST at http://host:port`.

    Returns:
        0.
    """
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    server = Server(**kwargs)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        ports = server.start()
        parts = []
        if ports.grpc is not None:
            parts.append(f"gRPC at {_url_host(server.host)}:{ports.grpc}")
        if ports.rest is not None:
            parts.append(f"REST at {server.rest_url}")
        models = ", ".join(model.name for model in server.config.model_config_list.config)
        print(f"tfformer serve: {', '.join(parts)} (models: {models})", flush=True)
        while not stop.wait(0.5):
            pass
        print("tfformer serve: shutting down (in-flight requests finish first)", file=sys.stderr, flush=True)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
