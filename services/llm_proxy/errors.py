"""OpenAI-style errors: one exception carries the HTTP status and the body fields a client expects.

Body shape, as OpenAI sends it: ``{"error": {"message", "type", "param", "code"}}``. The official
client maps the status to its exception classes (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 413/502/503 APIStatusError), so the status matters as much as the body.
"""

from __future__ import annotations

import json

# status -> the OpenAI error type that goes with it
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
}


class ProxyError(Exception):
    """A request the proxy answers with an error status; the server keeps serving."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": _TYPES.get(self.status, "server_error"),
            "param": self.param,
            "code": self.code,
        }
        return json.dumps({"error": error}).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)
