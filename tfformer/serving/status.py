"""Status codes and errors, as TensorFlow Serving reports them.

TF Serving works with absl status codes. gRPC status codes have the same
numbers, and the REST API maps each code to an HTTP status
(`model_servers/http_server.cc`, `ToHTTPStatusCode`).
"""

import enum


class Code(enum.IntEnum):
    """The absl / gRPC status codes (same numbers)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


HTTP_STATUS = {
    Code.OK: 200,
    Code.CANCELLED: 499,
    Code.UNKNOWN: 500,
    Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.ABORTED: 409,
    Code.OUT_OF_RANGE: 400,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.DATA_LOSS: 500,
    Code.UNAUTHENTICATED: 401,
}

# The reverse direction, for clients reading a REST error (several codes share 400/409/500).
CODE_FOR_HTTP_STATUS = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.ABORTED,
    413: Code.RESOURCE_EXHAUSTED,
    429: Code.RESOURCE_EXHAUSTED,
    499: Code.CANCELLED,
    500: Code.INTERNAL,
    501: Code.UNIMPLEMENTED,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
}

# Wording TF Serving uses for a request that ran past its deadline (REST: HTTP 504).
TIMEOUT_MESSAGE = "Timed out waiting for notification"


class ServingError(Exception):
    """A request failed with a status code and message, as TF Serving would answer it.

    Args:
        code: `Code` (or its int value).
        message: str. The status message, sent verbatim as the REST `{"error": ...}`
            body and as the gRPC status details.
        http_status: optional int. Overrides the HTTP status derived from `code`
            (used for the request-size limit, 413, which has no absl code).
    """

    def __init__(self, code, message, http_status=None):
        self.code = Code(int(code))
        self.message = str(message)
        self._http_status = http_status
        super().__init__(f"{self.code.name}: {self.message}")

    @property
    def http_status(self):
        return self._http_status or HTTP_STATUS.get(self.code, 500)

    def to_string(self):
        """absl `Status::ToString()`: `INVALID_ARGUMENT: message`."""
        return f"{self.code.name}: {self.message}"


def invalid_argument(*parts):
    return ServingError(Code.INVALID_ARGUMENT, "".join(str(part) for part in parts))


def not_found(*parts):
    return ServingError(Code.NOT_FOUND, "".join(str(part) for part in parts))


def failed_precondition(*parts):
    return ServingError(Code.FAILED_PRECONDITION, "".join(str(part) for part in parts))


def unimplemented(*parts):
    return ServingError(Code.UNIMPLEMENTED, "".join(str(part) for part in parts))


def internal(*parts):
    return ServingError(Code.INTERNAL, "".join(str(part) for part in parts))
