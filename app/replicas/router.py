"""Reverse proxy in front of several replicas: each new session goes to the least-loaded ready one.

A WebSocket session stays on the replica it was placed on for its whole life: the router holds one
upstream connection per client connection and copies frames both ways (text as text, binary as
binary, close codes included), so backpressure from a slow client reaches the replica, which applies
its own slow-client rule. A REST request is placed the same way and its response streamed back as
the replica produces it. A replica that refuses a connection is skipped at once; one that answers
503 (full or draining) is skipped when another is ready. With no ready replica the answer is 503 with
`Retry-After`, in the server's error shape.

    python -m app.replicas.router --replica http://127.0.0.1:8091 --replica http://127.0.0.1:8092
    python -m app.replicas.router --discover qwen3-tts-replicas.qwen3-tts.svc.cluster.local:8090
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.frames import EXTERNAL_CLOSE_CODES, CloseCode

from app.errors import error_body
from app.replicas.drain import DrainingServer
from app.replicas.pool import Pool, Replica

log = logging.getLogger("qwen3_tts.replicas")

# Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus those the client library sets.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})
WS_HANDSHAKE = frozenset({b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                          b"sec-websocket-protocol", b"sec-websocket-accept"})
RESPONSE_DROP = (HOP_BY_HOP - {b"content-length"}) | {b"date", b"server"}  # uvicorn adds its own
REPLICA_HEADER = b"x-replica"
RETRY_AFTER_S = 1


class Router:
    """The router's ASGI app: its own `/health`, `/ready`, `/metrics`; everything else is proxied."""

    def __init__(self, pool: Pool, max_body: int = 64 << 20, ws_max_size: int = 64 << 20,
                 connect_timeout: float = 5.0):
        self.pool = pool
        self.max_body = max_body
        self.ws_max_size = ws_max_size
        self.connect_timeout = connect_timeout
        self.draining = False  # set by begin_drain(): no new sessions, open ones go on
        self.client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        self.app = Starlette(routes=[Route("/health", self.health), Route("/ready", self.ready),
                                     Route("/metrics", self.metrics), Mount("", app=self.proxy)],
                             lifespan=self.lifespan)

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    def begin_drain(self) -> None:
        self.draining = True

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        timeout = httpx.Timeout(connect=self.connect_timeout, read=None, write=60.0, pool=None)
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        poller = asyncio.create_task(self.pool.run())
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await self.client.aclose()

    # -- the router's own routes -------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Same keys as a replica's /health (summed), plus the per-replica view; 200 while alive."""
        totals = self.pool.totals()
        models = [r.model for r in self.pool.replicas.values() if r.model]
        status = "draining" if self.draining else "ok" if totals["ready_replicas"] else "loading"
        return JSONResponse({"status": status, **totals, "model": models[0] if models else None,
                             "replicas": [r.describe() for r in self.pool.replicas.values()]})

    async def ready(self, request: Request) -> Response:
        ok = not self.draining and self.pool.pick() is not None
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # -- proxying ----------------------------------------------------------------------------------

    async def proxy(self, scope, receive, send):
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self._http(scope, receive, send)

    async def _http(self, scope, receive, send):
        request = Request(scope, receive)
        if self.draining:
            return await _unavailable("the router is shutting down")(scope, receive, send)
        try:
            body = await _read_body(request, self.max_body)
        except ClientDisconnect:
            return
        if body is None:
            return await _error(413, "too_large", f"body over {self.max_body} bytes")(scope, receive, send)
        headers = _forward_headers(scope, HOP_BY_HOP)
        tried: set[str] = set()
        while (replica := self.pool.pick(tried)) is not None:
            tried.add(replica.url)
            self.pool.acquire(replica, "http")
            try:
                upstream = await self.client.send(
                    self.client.build_request(scope["method"], replica.url + _target(scope),
                                              headers=headers, content=body), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.pool.release(replica)
                self.pool.mark_down(replica, repr(e))
                continue
            except httpx.HTTPError as e:
                self.pool.release(replica)
                return await _error(502, "bad_gateway", f"replica failed: {e!r}")(scope, receive, send)
            try:
                if upstream.status_code == 503 and self.pool.pick(tried) is not None:
                    continue  # that one is full or draining; another may have room
                response = StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code)
                response.raw_headers = _response_headers(upstream.headers.raw, replica)
                await response(scope, receive, send)
            finally:
                await upstream.aclose()
                self.pool.release(replica)
            return
        self.pool.rejected["http"] += 1
        await _unavailable("no replica is ready")(scope, receive, send)

    async def _websocket(self, scope, receive, send):
        ws = WebSocket(scope, receive, send)
        if self.draining:
            return await _deny(ws, _unavailable("the router is shutting down"), CloseCode.TRY_AGAIN_LATER)
        headers = _forward_headers(scope, HOP_BY_HOP | WS_HANDSHAKE)
        tried: set[str] = set()
        refused: Response | None = None
        while (replica := self.pool.pick(tried)) is not None:
            tried.add(replica.url)
            self.pool.acquire(replica, "ws")  # before connecting, so a session opened meanwhile goes elsewhere
            try:
                upstream = await ws_connect(
                    _ws_base(replica.url) + _target(scope), additional_headers=headers,
                    subprotocols=scope.get("subprotocols") or None, user_agent_header=None, proxy=None,
                    compression=None, open_timeout=self.connect_timeout, close_timeout=2,
                    max_size=self.ws_max_size)
            except InvalidStatus as e:
                self.pool.release(replica)
                refused = Response(bytes(e.response.body or b""), status_code=e.response.status_code,
                                   headers={k: v for k, v in e.response.headers.raw_items()
                                            if k.lower().encode() not in RESPONSE_DROP})
                if e.response.status_code == 503:
                    continue  # full or draining: try the next one
                return await _deny(ws, refused, CloseCode.POLICY_VIOLATION)  # 401, 403, 404: same everywhere
            except (OSError, asyncio.TimeoutError, InvalidHandshake) as e:
                self.pool.release(replica)
                self.pool.mark_down(replica, repr(e))
                continue
            try:
                await self._pump(ws, upstream, replica)
            finally:
                self.pool.release(replica)
            return
        self.pool.rejected["ws"] += 1
        await _deny(ws, refused or _unavailable("no replica is ready"), CloseCode.TRY_AGAIN_LATER)

    async def _pump(self, ws: WebSocket, upstream, replica: Replica) -> None:
        """Copy frames both ways until either side closes, then close the other with the same code."""
        await ws.accept(subprotocol=upstream.subprotocol, headers=[(REPLICA_HEADER, replica.url.encode())])

        async def client_to_upstream():
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    await upstream.close(_sendable(message.get("code"), CloseCode.NORMAL_CLOSURE))
                    return
                await upstream.send(message["text"] if message.get("text") is not None else message["bytes"])

        async def upstream_to_client():
            async for data in upstream:
                await ws.send({"type": "websocket.send", "text": data} if isinstance(data, str)
                              else {"type": "websocket.send", "bytes": data})

        tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, Exception) and not isinstance(
                        outcome, (ConnectionClosed, WebSocketDisconnect, OSError)):
                    log.error("session proxied to %s failed: %r", replica.url, outcome)
            await upstream.close()
        if ws.application_state is WebSocketState.CONNECTED and ws.client_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):  # the client may be gone already
                await ws.close(_sendable(upstream.close_code, CloseCode.BAD_GATEWAY), upstream.close_reason or "")


class _PoolCollector:
    """Prometheus view of the pool, read at scrape time (prefix `qwen3_tts_router_`, so it never adds
    into the replicas' own `qwen3_tts_*` series)."""

    def __init__(self, pool: Pool):
        self.pool = pool

    def collect(self):
        ready = GaugeMetricFamily("qwen3_tts_router_replica_ready", "1 if the replica takes new sessions",
                                  labels=["replica"])
        load = GaugeMetricFamily("qwen3_tts_router_replica_load",
                                 "(active sessions + queue) / max batch, as the router places work", labels=["replica"])
        held = GaugeMetricFamily("qwen3_tts_router_open", "sessions and requests proxied to the replica now",
                                 labels=["replica"])
        routed = CounterMetricFamily("qwen3_tts_router_routed", "sessions (ws) and requests (http) placed",
                                     labels=["replica", "kind"])
        for r in self.pool.replicas.values():
            ready.add_metric([r.url], float(self.pool.routable(r)))
            load.add_metric([r.url], r.load())
            held.add_metric([r.url], r.open)
            for kind, n in r.routed.items():
                routed.add_metric([r.url, kind], n)
        rejected = CounterMetricFamily("qwen3_tts_router_rejected", "refused with 503: no replica ready",
                                       labels=["kind"])
        for kind, n in self.pool.rejected.items():
            rejected.add_metric([kind], n)
        yield from (ready, load, held, routed, rejected)


def _error(status: int, code: str, message: str, retry_after: int | None = None) -> Response:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(code, message, status), status_code=status, headers=headers)


def _unavailable(message: str) -> Response:
    return _error(503, "unavailable", message, retry_after=RETRY_AFTER_S)


async def _deny(ws: WebSocket, response: Response, close_code: int) -> None:
    """Refuse a WebSocket with an HTTP response where the server supports it, else accept and close."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(response)
    else:
        await ws.accept()
        await ws.close(close_code, response.body.decode(errors="replace")[:120])


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The whole body (kept, so a refused request can go to the next replica), or None past `limit`."""
    if int(request.headers.get("content-length") or 0) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _target(scope) -> str:
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    return (path + b"?" + query if query else path).decode("latin-1")


def _ws_base(url: str) -> str:
    return "ws" + url[len("http"):] if url.startswith("http") else url


def _forward_headers(scope, drop: frozenset) -> list[tuple[str, str]]:
    """The client's end-to-end headers, plus X-Forwarded-For/-Proto/-Host."""
    raw = scope["headers"]
    listed = {t.strip().lower() for k, v in raw if k == b"connection" for t in v.split(b",")}
    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw
           if k not in drop and k not in listed and k != b"x-forwarded-for"]
    earlier = [v.decode("latin-1") for k, v in raw if k == b"x-forwarded-for"]
    client = scope.get("client")
    out.append(("x-forwarded-for", ", ".join(earlier + ([client[0]] if client else []))))
    have = {k for k, _ in out}
    if "x-forwarded-proto" not in have:
        out.append(("x-forwarded-proto", {"ws": "http", "wss": "https"}.get(scope["scheme"], scope["scheme"])))
    host = next((v.decode("latin-1") for k, v in raw if k == b"host"), None)
    if host and "x-forwarded-host" not in have:
        out.append(("x-forwarded-host", host))
    return out


def _response_headers(raw, replica: Replica) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in raw if k.lower() not in RESPONSE_DROP] + [(REPLICA_HEADER, replica.url.encode())]


def _sendable(code: int | None, fallback: int) -> int:
    """A close code that may go on the wire (1005/1006 only describe a close, they are never sent)."""
    if code == CloseCode.NO_STATUS_RCVD:
        return CloseCode.NORMAL_CLOSURE
    return code if code in EXTERNAL_CLOSE_CODES or (code is not None and 3000 <= code < 5000) else fallback


def _env_list(name: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, "").split(",") if x.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m app.replicas.router", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--replica", action="append", help="base URL of a replica, repeatable (env REPLICAS, comma-separated)")
    p.add_argument("--discover", action="append",
                   help="HOST:PORT whose DNS records are the replicas, e.g. a headless Service (env DISCOVER)")
    p.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8090)))
    p.add_argument("--poll-interval", type=float, default=float(os.environ.get("POLL_INTERVAL", 0.5)),
                   help="seconds between /health + /ready polls of each replica")
    p.add_argument("--api-key", default=os.environ.get("API_KEY"),
                   help="sent when polling /ready (clients' own keys are passed through untouched)")
    p.add_argument("--drain-timeout", type=float, default=float(os.environ.get("DRAIN_TIMEOUT", 30)),
                   help="on SIGTERM, seconds to let open sessions finish (0: exit at once)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"))
    args = p.parse_args(argv)
    replicas, discover = args.replica or _env_list("REPLICAS"), args.discover or _env_list("DISCOVER")
    if not replicas and not discover:
        p.error("give at least one --replica URL or --discover HOST:PORT")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    router = Router(Pool(replicas, discover, interval=args.poll_interval, api_key=args.api_key))
    config = uvicorn.Config(router, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                            ws_max_size=router.ws_max_size, ws_per_message_deflate=False, timeout_graceful_shutdown=5)
    DrainingServer(config, router.begin_drain, lambda: router.pool.open_total, args.drain_timeout).run()


if __name__ == "__main__":
    main()
