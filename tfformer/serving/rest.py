"""TF Serving's REST API (`/v1/models/...`) as an ASGI app (Starlette request/response, served by uvicorn).

`RestApiHandler.process(method, path, body)` is TF Serving's
`HttpRestApiHandler::ProcessRequest`: the same path regexes (case-insensitive,
full match), the same dispatch, the same JSON and the same status -> HTTP
mapping. `RestApp` adds what the HTTP layer owns: the request-size limit
(413), the per-request timeout (504), the bounded worker pool the handler runs
in, and the access log.
"""

import asyncio
import logging
import re
import time
import zlib
from urllib.parse import unquote_to_bytes

from google.protobuf import json_format
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from tensorflow_serving.apis import model_pb2

from tfformer.serving import json_tensor, monitoring, rapidjson
from tfformer.serving.servable import Deferred, answer
from tfformer.serving.status import TIMEOUT_MESSAGE, Code, ServingError, invalid_argument

log = logging.getLogger("tfformer.serving")

PATH_REGEX = re.compile(r"/v1/.*", re.IGNORECASE | re.DOTALL)
PREDICTION_API_REGEX = re.compile(
    r"/v1/models/([^/:]+)(?:(?:/versions/([0-9]+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)",
    re.IGNORECASE)
MODEL_STATUS_API_REGEX = re.compile(
    r"/v1/models(?:/([^/:]+))?(?:(?:/versions/([0-9]+))|(?:/labels/([^/:]+)))?(?:/(metadata))?", re.IGNORECASE)
_INT64_MAX = 2**63 - 1

# libevent's reply to a path outside /v1/ (not JSON, as from tensorflow_model_server).
NOT_FOUND_BODY = ("<HTML><HEAD>\n<TITLE>404 Not Found</TITLE>\n</HEAD><BODY>\n<H1>Not Found</H1>\n"
                  "The requested URL {path} was not found on this server.</BODY></HTML>\n")


def _decode_arg(text):
    """curl_easy_unescape: `%XX` decoded, everything else kept (no `+` -> space)."""
    return unquote_to_bytes(text).decode("utf-8", "surrogateescape")


def parse_model_info(method, path):
    """`ParseModelInfo`: (matched, name, version, label, api, subresource) of a REST path."""
    version = label = None
    if method == "POST":
        match = PREDICTION_API_REGEX.fullmatch(path)
        name, version_text, label_text, api = match.groups() if match else (None, None, None, None)
        subresource = None
    elif method == "GET":
        match = MODEL_STATUS_API_REGEX.fullmatch(path)
        name, version_text, label_text, subresource = match.groups() if match else (None, None, None, None)
        api = None
    else:
        return False, None, None, None, None, None
    if name:
        name = _decode_arg(name)
    if version_text:
        if int(version_text) > _INT64_MAX:
            raise invalid_argument(f"Failed to convert version: {version_text} to numeric.")
        version = int(version_text)
    if label_text:
        label = _decode_arg(label_text)
    return match is not None, name or "", version, label, api, subresource


class RestApiHandler:
    """The REST API over a `ModelManager` (synchronous; run it in a worker thread).

    Args:
        manager: `ModelManager`.
    """

    def __init__(self, manager):
        self.manager = manager

    def process(self, method, path, body, info=None):
        """Handles one request.

        Args:
            method: str. The HTTP method.
            path: str. The request path (percent-encoded, without the query).
            body: bytes.
            info: optional dict; receives `model` and `api` for the access log.

        Returns:
            `(http_status, json_text)`, or a `Deferred` for a predict request waiting in a batching queue: its
            answer is `finish(deferred, info)` once its future is done.
        """
        info = {} if info is None else info
        return self._answer(lambda: self._dispatch(method, path, body, info), info, method, path)

    def finish(self, deferred, info):
        """`(http_status, json_text)` of a `Deferred` (from `process`) whose future is done."""
        return self._answer(lambda: deferred.finish(deferred.future.result()), info, "POST", "(a batched predict)")

    def _answer(self, fn, info, method, path):
        try:
            output = fn()
            return output if isinstance(output, Deferred) else (200, output)
        except RecursionError:
            error = invalid_argument("JSON Value: nested too deeply to be processed")
        except ServingError as caught:
            error = caught
        except Exception as caught:  # a bug must still answer with a JSON error
            log.exception("Error processing %s %s", method, path)
            error = ServingError(Code.INTERNAL, f"{type(caught).__name__}: {caught}")
        info["error"] = error.message
        info["code"] = error.code.name
        return error.http_status, rapidjson.error_body(error.message)

    def _dispatch(self, method, path, body, info):
        malformed = invalid_argument(f"Malformed request: {method} {path}")
        matched, name, version, label, api, subresource = parse_model_info(method, path)
        info["model"] = name
        if not matched:
            raise malformed
        if method == "POST":
            info["api"] = api
            if api == "predict":
                return self._predict(name, version, label, body)
            if api in ("classify", "regress"):
                return self._classify_regress(api, name, version, label, body)
            raise malformed  # the regex is case-insensitive but the method name is compared exactly
        if not name:
            raise invalid_argument("Missing model name in request.")
        if subresource == "metadata":
            info["api"] = "metadata"
            return self._metadata(name, version, label)
        info["api"] = "status"
        response = self.manager.model_status(name, version)  # labels are ignored here, as in TF Serving
        return json_format.MessageToJson(response, always_print_fields_with_no_presence=True)

    def _predict(self, name, version, label, body):
        servable = []

        def input_dtypes(signature_name):
            servable.append(self.manager.get_servable(name, version, label))
            return servable[0].input_dtypes(signature_name)

        signature_name, inputs, request_format = json_tensor.parse_predict_request(body, input_dtypes)
        return answer(servable[0].submit(signature_name, inputs),
                      lambda result: json_tensor.make_json_from_tensors(result[1], request_format))

    def _classify_regress(self, api, name, version, label, body):
        signature_name, examples, context = json_tensor.parse_classify_regress_request(body)
        servable = self.manager.get_servable(name, version, label)
        if api == "classify":
            return json_tensor.make_json_from_classification_result(
                servable.classify(signature_name, examples, context))
        return json_tensor.make_json_from_regression_result(servable.regress(signature_name, examples, context))

    def _metadata(self, name, version, label):
        servable = self.manager.get_servable(name, version, label)
        options = dict(preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        model_spec = model_pb2.ModelSpec(name=servable.name)
        model_spec.version.value = servable.version
        return ('{\n"model_spec":' + json_format.MessageToJson(model_spec, **options) + ",\n"
                '"metadata": {"signature_def": ' + json_format.MessageToJson(servable.signature_def_map(), **options)
                + "}\n}\n")


def gunzip(data, limit):
    """A `Content-Encoding: gzip` body inflated, as TF Serving's HTTP server does before the handler reads it: a body
    that does not inflate is read as empty (its "JSON Parse error: The document is empty"); None past `limit`
    bytes inflated."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        body = inflater.decompress(data, limit + 1)
    except zlib.error:
        return b""
    if len(body) > limit:
        return None
    return body if inflater.eof else b""


class RestApp:
    """ASGI app: TF Serving's REST API with a size limit, a timeout, a worker pool and an access log.

    Args:
        handler: `RestApiHandler`.
        executor: `concurrent.futures.Executor` the handler runs in (bounded).
        max_request_bytes: int. Larger bodies get HTTP 413.
        timeout_seconds: float or None. Requests running longer get HTTP 504.
        access_log: optional `AccessLog`.
        metrics: optional `monitoring.Metrics`, served as Prometheus text at `metrics_path`.
        metrics_path: str. Defaults to `/monitoring/prometheus/metrics`.
    """

    def __init__(self, handler, executor, max_request_bytes, timeout_seconds, access_log=None, metrics=None,
                 metrics_path=monitoring.PROMETHEUS_PATH):
        self.handler = handler
        self.executor = executor
        self.max_request_bytes = max_request_bytes
        self.timeout_seconds = timeout_seconds
        self.access_log = access_log
        self.metrics = metrics
        self.metrics_path = metrics_path

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        start = time.perf_counter()
        request = Request(scope, receive)
        method = scope["method"]
        path = (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1")
        info = {}
        size = 0
        if self.metrics is not None and path == self.metrics_path:  # any method, as in TF Serving
            response = Response(self.metrics.render(), media_type="text/plain")
        elif not PATH_REGEX.fullmatch(path):
            response = Response(NOT_FOUND_BODY.format(path=path), status_code=404, media_type="text/html")
            info["code"] = Code.NOT_FOUND.name
        elif method == "OPTIONS":  # a CORS preflight, answered before the body is read as a request
            origin = request.headers.get("origin", "")
            ok = re.search(r"https?://", origin) is not None
            if not ok:
                info.update(code=Code.FAILED_PRECONDITION.name, error="Origin header is missing in CORS preflight")
            response = Response(b"", status_code=200 if ok else 400)
        else:
            body, size = await self._read_body(request)
            if body is None:
                error = ServingError(Code.RESOURCE_EXHAUSTED, f"Request body of {size} bytes exceeds the limit of "
                                                              f"{self.max_request_bytes} bytes", http_status=413)
                info.update(code=error.code.name, error=error.message)
                response = self._json(413, rapidjson.error_body(error.message))
            else:
                status, output = await self._run(method, path, body, info)
                response = self._json(status, output)
        await response(scope, receive, send)
        if self.access_log is not None:
            client = scope.get("client")
            self.access_log.write(
                protocol="http", method=method, path=path, status=response.status_code,
                code=info.get("code", "OK"), model=info.get("model"), api=info.get("api"),
                duration_ms=(time.perf_counter() - start) * 1000, bytes_in=size, bytes_out=len(response.body),
                client=f"{client[0]}:{client[1]}" if client else None, error=info.get("error"))

    @staticmethod
    def _json(status, text):
        return Response(text.encode("utf-8", "replace"), status_code=status, media_type="application/json")

    async def _read_body(self, request):
        """The body, or `(None, size)` when it is over the limit (the rest is drained, up to 4x the limit)."""
        declared = request.headers.get("content-length")
        limit = self.max_request_bytes
        if declared and declared.isdigit() and int(declared) > limit:
            await self._drain(request, int(declared))
            return None, int(declared)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    await self._drain(request, size)
                    return None, size
                chunks.append(chunk)
        except ClientDisconnect:
            pass
        body = b"".join(chunks)
        if "gzip" in request.headers.get("content-encoding", ""):  # TF Serving inflates it (auto_uncompress_input)
            body = gunzip(body, limit)
            size = size if body is not None else limit + 1
        return body, size

    async def _drain(self, request, size):
        if size > 4 * self.max_request_bytes:
            return
        try:
            async for _ in request.stream():
                pass
        except (ClientDisconnect, RuntimeError):
            pass

    async def _run(self, method, path, body, info):
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_seconds is None else time.monotonic() + self.timeout_seconds

        def job():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError()  # waited in the queue past its deadline: don't start it
            return self.handler.process(method, path, body, info)

        try:
            return await asyncio.wait_for(self._complete(loop.run_in_executor(self.executor, job), info),
                                          self.timeout_seconds)
        except (asyncio.TimeoutError, TimeoutError):
            info.update(code=Code.DEADLINE_EXCEEDED.name, error=TIMEOUT_MESSAGE)
            return 504, rapidjson.error_body(TIMEOUT_MESSAGE)

    async def _complete(self, job, info):
        """The answer of `job`; a `Deferred` waits for its batch without holding a worker, then is written in one.
        (A timeout cancels the wait, and with it the queued request: a batch skips it.)"""
        result = await job
        if isinstance(result, Deferred):
            try:
                await asyncio.wrap_future(result.future)
            except Exception:  # `finish` reports the request's error
                pass
            result = await asyncio.get_running_loop().run_in_executor(self.executor, self.handler.finish, result,
                                                                      info)
        return result
