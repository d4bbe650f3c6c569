"""The errors a client can get, in one place: HTTP status, a stable code, and the JSON body.

REST answers `{"error": {"code", "message", "type"}}` (`type` is OpenAI's error class, so OpenAI
clients show the message); a WebSocket session sends the same code in an `error` event. Codes of
WebSocket errors that end the session start with `fatal.`.
"""
from __future__ import annotations

from typing import Optional

from starlette.responses import JSONResponse

OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               503: "server_error", 500: "server_error"}


class ApiError(Exception):
    """A client-visible failure: `status` for REST, `code` for both REST and WebSocket."""

    def __init__(self, status: int, code: str, message: str, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


def bad_request(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, code, message)


def error_body(code: str, message: str, status: int) -> dict:
    return {"error": {"code": code, "message": message, "type": OPENAI_TYPE.get(status, "invalid_request_error")}}


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(err.retry_after)))} if err.retry_after is not None else None
    if err.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(err.code, err.message, err.status), status_code=err.status, headers=headers)
