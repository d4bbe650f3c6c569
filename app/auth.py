"""API key check for every route but /health (HTTP and WebSocket), as an ASGI middleware.

The key comes as `Authorization: Bearer <key>`, or `?api_key=<key>` (browsers cannot set headers on
a WebSocket). A page opened with `?api_key=` also gets the key as an HttpOnly cookie, so the files it
loads next (scripts, the worklet) pass too. Keys are compared in constant time (SHA-256 digests, so
not even the key's length shows). HTTP without the key gets 401; a WebSocket is accepted only to be
told why (`fatal.unauthorized`) and closed with 1008, which browsers, unlike a refused handshake, can
show.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from http.cookies import SimpleCookie
from typing import Optional
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, error_response

OPEN_PATHS = frozenset({"/health"})
COOKIE = "qwen3_tts_api_key"
COOKIE_SAFE = re.compile(r"[A-Za-z0-9._~+/=-]+")
CLOSE_POLICY = 1008
MESSAGE = "missing or wrong API key: send 'Authorization: Bearer <key>' (WebSocket: or ?api_key=<key>)"


def _presented(scope: Scope) -> tuple[Optional[str], bool]:
    """(key, came from the query string)."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip(), False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("api_key"):
        return query["api_key"][0], True
    if "cookie" in headers:
        morsel = SimpleCookie(headers["cookie"]).get(COOKIE)
        if morsel is not None:
            return morsel.value, False
    return None, False


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        key, from_query = _presented(scope)
        presented = hashlib.sha256((key or "").encode()).digest()
        if not hmac.compare_digest(presented, self.digest) or key is None:
            if scope["type"] == "websocket":
                await receive()                 # websocket.connect
                await send({"type": "websocket.accept"})
                await send({"type": "websocket.send", "text": json.dumps(
                    {"type": "error", "code": "fatal.unauthorized", "message": MESSAGE, "fatal": True})})
                await send({"type": "websocket.close", "code": CLOSE_POLICY, "reason": "unauthorized"})
                return
            return await error_response(ApiError(401, "unauthorized", MESSAGE))(scope, receive, send)
        if not (from_query and scope["type"] == "http" and COOKIE_SAFE.fullmatch(key)):
            return await self.app(scope, receive, send)
        cookie = f"{COOKIE}={key}; Path=/; HttpOnly; SameSite=Strict".encode("latin-1")

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
            await send(message)
        await self.app(scope, receive, send_with_cookie)
