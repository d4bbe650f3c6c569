"""`qwen3-tts-server`: settings from flags and environment, the Starlette app, uvicorn.

    qwen3-tts-server --model-dir models/0.6b-base        # or: python -m app ...
    qwen3-tts-server --demo                               # random tiny model, no weights needed

The port opens at once; the model loads in the background (/health says "loading", /ready is 503)
and the server is ready after a warm-up turn. A model that cannot be loaded stops the process with
a non-zero status. SIGTERM drains (`app.replicas.drain`): /ready 503, no new sessions or turns, turns
in progress finish for up to --drain-timeout seconds, then the sessions left are closed with 1001.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from . import rest, ws
from .auth import ApiKeyMiddleware
from .replicas.drain import DrainingServer
from .errors import ApiError, error_response
from .metrics import Metrics
from .service import DEMO_MAX_FRAMES, Service, Settings

log = logging.getLogger("qwen3_tts.server")

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
STEP_SAMPLE_S = 0.02
SLOW_LOOP_S = 0.25        # an event-loop stall this long is logged

# Settings field -> (flag, environment variable, parser, help). The flag wins over the environment.
OPTIONS = {
    "model_dir": ("--model-dir", "MODEL_DIR", str, "model folder (Hugging Face layout) or a hub id to download"),
    "host": ("--host", "HOST", str, "listen address"),
    "port": ("--port", "PORT", int, "listen port"),
    "max_batch": ("--max-batch", "MAX_BATCH", int, "most sessions in one decode step (default: from GPU memory)"),
    "device": ("--device", "DEVICE", str, "cuda or cpu (default: cuda if present)"),
    "dtype": ("--dtype", "DTYPE", str, "float32 / bfloat16 / float16 (default: bfloat16 on GPU, float32 on CPU)"),
    "voices_dir": ("--voices-dir", "VOICES_DIR", str, "where registered voices are kept"),
    "api_key": ("--api-key", "API_KEY", str, "require 'Authorization: Bearer <key>' on every route but /health"),
    "max_text_chars": ("--max-text-chars", "MAX_TEXT_CHARS", int, "longest text of one request or turn"),
    "max_ref_seconds": ("--max-ref-seconds", "MAX_REF_SECONDS", float, "longest reference audio"),
    "max_ref_bytes": ("--max-ref-bytes", "MAX_REF_BYTES", int, "largest reference audio file"),
    "max_body_bytes": ("--max-body-bytes", "MAX_BODY_BYTES", int, "largest REST body / WebSocket message"),
    "max_frames": ("--max-frames", "MAX_FRAMES", int, "most frames (80 ms each) of one turn"),
    "idle_timeout_s": ("--idle-timeout", "IDLE_TIMEOUT_S", float, "close a WebSocket idle this many seconds"),
    "send_buffer_bytes": ("--send-buffer-bytes", "SEND_BUFFER_BYTES", int,
                          "audio bytes queued for one WebSocket before its client counts as too slow"),
    "max_sessions": ("--max-sessions", "MAX_SESSIONS", int, "most open WebSocket sessions"),
    "max_queue": ("--max-queue", "MAX_QUEUE", int, "most requests waiting for a batch slot (then 503)"),
    "drain_timeout": ("--drain-timeout", "DRAIN_TIMEOUT", float,
                      "on SIGTERM, seconds turns in progress may take to finish before sessions are closed (1001)"),
    "vocoder_batch": ("--vocoder-batch", "VOCODER_BATCH", int,
                      "most streams one vocoder CUDA graph decodes (more: several replays; less memory held)"),
    "slow_iteration_ms": ("--slow-iteration-ms", "SLOW_ITERATION_MS", float,
                          "log each engine iteration that takes longer, with where its time went"),
}
TRUE = ("1", "true", "yes", "on")


def parse_settings(argv: Optional[list[str]] = None, environ: Optional[dict] = None) -> Settings:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="qwen3-tts-server", description="Streaming TTS server for Qwen3-TTS")
    for name, (flag, env, kind, help_text) in OPTIONS.items():
        parser.add_argument(flag, dest=name, type=kind, default=None, help=f"{help_text} [env {env}]")
    parser.add_argument("--demo", action="store_true", default=None,
                        help="serve a random-weight tiny model (its audio is noise; a turn at most "
                             f"{DEMO_MAX_FRAMES} frames unless --max-frames) [env DEMO=1]")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", default=None, help="skip the warm-up turn")
    args = parser.parse_args(argv)
    values = {}
    for name, (flag, env, kind, _) in OPTIONS.items():
        value = getattr(args, name)
        if value is None and environ.get(env):
            try:
                value = kind(environ[env])
            except ValueError:
                parser.error(f"environment variable {env}={environ[env]!r} is not a valid {kind.__name__}")
        if value is not None:
            values[name] = value
    values["demo"] = bool(args.demo) or environ.get("DEMO", "").lower() in TRUE
    if values["demo"]:
        values.setdefault("max_frames", DEMO_MAX_FRAMES)
    if args.warmup is not None:
        values["warmup"] = args.warmup
    return dataclasses.replace(Settings(), **values)


async def _sample_steps(svc: Service) -> None:
    """Feed the per-step metrics from the scheduler's counters (the engine thread keeps them), and
    the event loop's lag: how late this loop's own wake-ups are (every session's sends wait as long)."""
    seen_steps = seen_frames = 0
    seen_host: dict = {}
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(STEP_SAMPLE_S)
        lag = loop.time() - t - STEP_SAMPLE_S
        svc.metrics.loop_lag.observe(max(lag, 0.0))
        if lag > SLOW_LOOP_S:
            log.warning("event loop stalled for %.0f ms", lag * 1000)
        if svc.scheduler is None:
            continue
        st = svc.scheduler.stats()
        if st.steps > seen_steps:
            svc.metrics.observe_step(st.last_batch_size, st.last_step_ms / 1000.0)
            svc.metrics.steps.inc(st.steps - seen_steps)
            svc.metrics.frames.inc(st.frames_generated - seen_frames)
            seen_steps, seen_frames = st.steps, st.frames_generated
        for phase, seconds in st.host_seconds.items():
            svc.metrics.host_seconds.labels(phase).inc(seconds - seen_host.get(phase, 0.0))
        seen_host = st.host_seconds


def _http_error(request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return error_response(ApiError(exc.status_code, code, str(exc.detail)))


def _internal_error(request, exc: Exception):
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(ApiError(500, "internal", "internal server error"))


def create_app(settings: Settings, scheduler=None, on_fatal: Optional[Callable[[], None]] = None) -> Starlette:
    """The ASGI app. With `scheduler` (already started, e.g. in tests) the model is not loaded here
    and the caller stops the scheduler; otherwise the lifespan loads the model and owns it."""
    metrics = Metrics()
    svc = Service(settings, metrics, scheduler, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        starting = asyncio.create_task(svc.start())
        sampler = asyncio.create_task(_sample_steps(svc))
        try:
            yield
        finally:
            sampler.cancel()
            if not starting.done():
                await asyncio.wait({starting}, timeout=60)
            await svc.stop()

    routes = [Mount("/v1", routes=[*rest.v1_routes, *ws.v1_routes]), *rest.routes]
    if WEB_DIR.is_dir():
        routes.append(Mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web"))
    middleware = [Middleware(ApiKeyMiddleware, api_key=settings.api_key)] if settings.api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.service = svc
    return app


def uvicorn_config(app, settings: Settings, **overrides) -> uvicorn.Config:
    # No permessage-deflate: audio barely compresses (PCM ~0.99, mu-law frames are 160 bytes), and
    # deflating it would cost the event loop ~0.9 ms per 8-frame chunk (~35 MB/s a core), about one
    # core's worth at 256 sessions streaming faster than real time.
    options = dict(host=settings.host, port=settings.port, ws_max_size=settings.max_body_bytes,
                   ws_per_message_deflate=False, timeout_graceful_shutdown=5, log_level="info")
    return uvicorn.Config(app, **{**options, **overrides})


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    failed = []
    server: Optional[uvicorn.Server] = None

    def on_fatal():
        failed.append(True)
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    svc: Service = app.state.service
    server = DrainingServer(uvicorn_config(app, settings), svc.begin_drain, svc.open_sessions, settings.drain_timeout,
                            end_sessions=svc.end_sessions)
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
