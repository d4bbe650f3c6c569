"""REST: OpenAI-compatible /v1/audio/speech, /v1/voices, /v1/models, and the operations routes."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.requests import AudioChunk, SpeechRequest, TurnResult

from .audio import CONTAINERS, MODEL_RATE, FileStreamEncoder, FormatError, check_container, encode_file
from .errors import ApiError, bad_request, error_response
from .metrics import PlaybackClock
from .params import base64_audio, boolean, integer, language, optional_str, sampling, text
from .service import Service
from .voices import valid_voice_id


def service(request: Request) -> Service:
    return request.app.state.service


async def read_json(request: Request, limit: int) -> dict:
    """The JSON object body, at most `limit` bytes (413 beyond, also without a Content-Length)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, "payload_too_large", f"request body is {length} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise ApiError(413, "payload_too_large", f"request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:
        raise ApiError(400, "invalid_request", "the client went away while sending the body") from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):     # RecursionError: nested too deep ("[[[[...")
        raise bad_request("the body must be a JSON object", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", "invalid_json")
    return data


@dataclass
class SpeechJob:
    request: SpeechRequest
    response_format: str
    sample_rate: int
    stream: bool
    sse: bool


async def parse_speech(body: dict, svc: Service) -> SpeechJob:
    limit = svc.settings.max_text_chars
    field = "input" if "input" in body else "text"
    words = text(field, body.get(field), limit)
    if not words.strip():
        raise bad_request(f"{field} is empty")
    if body.get("speed") is not None and body["speed"] != 1 and body["speed"] != 1.0:
        raise bad_request(f"only speed 1.0 is supported (got {body['speed']!r}); resample the audio on the client "
                          "for another speed", "unsupported_speed")
    if body.get("instructions"):
        raise bad_request("instructions are not supported by the Base model (clone a voice with ref_audio instead)")
    response_format = body.get("response_format") or "wav"
    sample_rate = body.get("sample_rate", MODEL_RATE)
    try:
        check_container(response_format, sample_rate)
    except FormatError as e:
        raise bad_request(str(e), "unsupported_format") from None
    stream = boolean("stream", body.get("stream", False))
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise bad_request(f"stream_format must be 'audio' or 'sse', got {stream_format!r}")
    lang = language(body.get("language"), svc.model.config)
    params = sampling(body, svc.sampling_defaults)
    max_frames = None if body.get("max_frames") is None else integer("max_frames", body["max_frames"], 1, 1 << 20)
    if body.get("ref_audio") is not None:
        audio = base64_audio("ref_audio", body["ref_audio"])
        ref_text = optional_str("ref_text", body.get("ref_text"))
        x_vector_only = boolean("x_vector_only", body.get("x_vector_only", False))
        voice, _ = await svc.clone(audio, ref_text, x_vector_only)
    else:
        voice = svc.voice(body.get("voice"))
    request = SpeechRequest(words, voice, lang, params, max_frames=svc.max_frames(max_frames), request_id="rest")
    return SpeechJob(request, response_format, sample_rate, stream or stream_format == "sse", stream_format == "sse")


class Synthesis:
    """One REST synthesis: counts itself active until its audio is out, records its metrics."""

    def __init__(self, svc: Service, job: SpeechJob):
        self.svc, self.job = svc, job
        self.t0 = time.monotonic()
        self.handle = svc.submit(job.request)
        self.clock = PlaybackClock(MODEL_RATE)
        self.result: Optional[TurnResult] = None
        svc.active["rest"] += 1
        svc.metrics.active_sessions.labels("rest").inc()
        self.open = True

    async def items(self) -> AsyncIterator[AudioChunk]:
        async for item in self.handle:
            if isinstance(item, TurnResult):
                self.result = item
            else:
                self.clock.add(time.monotonic(), item.pcm.shape[0])
                yield item

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        if self.result is None:
            self.handle.cancel()
        svc = self.svc
        svc.active["rest"] -= 1
        svc.metrics.active_sessions.labels("rest").dec()
        r = self.result
        outcome = "cancelled" if r is None or r.reason == "cancelled" else "error" if r.reason == "error" else "ok"
        svc.metrics.requests.labels("speech", outcome).inc()
        if r is not None:
            svc.metrics.observe_turn(r.samples / MODEL_RATE, time.monotonic() - self.t0, r.ttfa_ms, self.clock.underruns)

    def headers(self) -> dict:
        r = self.result
        wall = time.monotonic() - self.t0
        audio_s = r.samples / MODEL_RATE
        return {"x-audio-seconds": f"{audio_s:.3f}", "x-rtf": f"{audio_s / wall if wall > 0 else 0:.3f}",
                "x-ttfa-ms": f"{r.ttfa_ms:.1f}", "x-sample-rate": str(self.job.sample_rate)}


def engine_failure(result: TurnResult) -> ApiError:
    return ApiError(500, "generation_failed", f"generation failed: {result.error or result.reason}")


async def speech(request: Request) -> Response:
    svc = service(request)
    try:
        svc.require_ready()
        job = await parse_speech(await read_json(request, svc.settings.max_body_bytes), svc)
        synthesis = Synthesis(svc, job)
    except ApiError as e:
        svc.metrics.requests.labels("speech", "overloaded" if e.code == "overloaded" else "client_error"
                                    if e.status < 500 else "error").inc()
        return error_response(e)
    if job.stream:
        return await stream_speech(request, synthesis)
    return await whole_speech(request, synthesis)


async def whole_speech(request: Request, synthesis: Synthesis) -> Response:
    async def cancel_on_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        synthesis.handle.cancel()
    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        pcm = [c.pcm async for c in synthesis.items()]
        r = synthesis.result
        if r.reason == "cancelled":
            return Response(status_code=499)     # the client is gone; nobody reads this
        if r.reason == "error":
            return error_response(engine_failure(r))
        job = synthesis.job
        data = await asyncio.to_thread(encode_file, np.concatenate(pcm) if pcm else np.zeros(0, np.float32),
                                       job.response_format, job.sample_rate)
        return Response(data, media_type=CONTAINERS[job.response_format][0], headers=synthesis.headers())
    finally:
        watcher.cancel()
        synthesis.close()


def sse_event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def stream_speech(request: Request, synthesis: Synthesis) -> Response:
    """Chunked audio (or SSE events) as it is made. The response starts with the first chunk, so an
    engine failure before any audio is still an HTTP error status."""
    job = synthesis.job
    items = synthesis.items()
    first = None
    try:
        first = await anext(items, None)
        ttfa_ms = (time.monotonic() - synthesis.t0) * 1000
    except BaseException:
        synthesis.close()
        raise
    if first is None and synthesis.result.reason == "error":
        synthesis.close()
        return error_response(engine_failure(synthesis.result))

    encoder = FileStreamEncoder(job.response_format, job.sample_rate)

    def pack(data: bytes) -> bytes:
        if not job.sse:
            return data
        return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if data else b""

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield pack(encoder.encode(first.pcm))
                async for chunk in items:
                    data = pack(encoder.encode(chunk.pcm))
                    if data:
                        yield data
            r = synthesis.result
            if r.reason == "error":     # headers are gone: end the stream early, the client sees it short
                return
            yield pack(encoder.flush())
            if job.sse:
                tokens = len(synthesis.svc.model.tokenizer.encode(job.request.text))
                yield sse_event({"type": "speech.audio.done", "usage": {
                    "input_tokens": tokens, "output_tokens": r.frames, "total_tokens": tokens + r.frames}})
        finally:
            encoder.close()
            synthesis.close()

    headers = {"x-ttfa-ms": f"{ttfa_ms:.1f}", "x-sample-rate": str(job.sample_rate)}
    media = "text/event-stream" if job.sse else CONTAINERS[job.response_format][0]
    return StreamingResponse(body(), media_type=media, headers=headers)


# -- voices ----------------------------------------------------------------------------------------

async def create_voice(request: Request) -> Response:
    svc = service(request)
    try:
        svc.require_ready()
        body = await read_json(request, svc.settings.max_body_bytes)
        audio = base64_audio("audio", body.get("audio"))
        ref_text = optional_str("ref_text", body.get("ref_text"))
        name = optional_str("name", body.get("name"))
        x_vector_only = boolean("x_vector_only", body.get("x_vector_only", False))
        voice_id = body.get("voice_id")
        if voice_id is not None:
            if not valid_voice_id(voice_id):
                raise bad_request("voice_id must be 1-64 letters, digits, '_' or '-', starting with a letter or digit")
            if svc.voices.get(voice_id) is not None:
                raise ApiError(409, "voice_exists", f"voice {voice_id!r} exists; DELETE it first to replace it")
        if name is not None and len(name) > 200:
            raise bad_request("name is longer than 200 characters")
        prompt, duration = await svc.clone(audio, ref_text, x_vector_only)
        info = svc.voices.add(voice_id or svc.voices.new_id(), prompt, name, duration, ref_text)
    except ApiError as e:
        svc.metrics.requests.labels("voices", "client_error" if e.status < 500 else "error").inc()
        return error_response(e)
    svc.metrics.requests.labels("voices", "ok").inc()
    return JSONResponse(info)


async def list_voices(request: Request) -> Response:
    svc = service(request)
    try:
        svc.require_ready()
    except ApiError as e:
        return error_response(e)
    has_default = svc.voices.get("default") is not None
    return JSONResponse({"object": "list", "data": svc.voices.list(),
                         "default_voice": "default" if has_default else "builtin"})


async def get_voice(request: Request) -> Response:
    svc = service(request)
    voice_id = request.path_params["voice_id"]
    try:
        svc.require_ready()
        info = svc.voices.info(voice_id) if valid_voice_id(voice_id) else None
        if info is None:
            raise ApiError(404, "voice_not_found", f"no voice {voice_id!r}")
    except ApiError as e:
        return error_response(e)
    return JSONResponse(info)


async def delete_voice(request: Request) -> Response:
    svc = service(request)
    voice_id = request.path_params["voice_id"]
    try:
        svc.require_ready()
        if not (valid_voice_id(voice_id) and svc.voices.delete(voice_id)):
            raise ApiError(404, "voice_not_found", f"no voice {voice_id!r}")
    except ApiError as e:
        return error_response(e)
    svc.metrics.requests.labels("voices", "ok").inc()
    return JSONResponse({"voice_id": voice_id, "deleted": True})


# -- operations ------------------------------------------------------------------------------------

async def health(request: Request) -> Response:
    return JSONResponse(service(request).health())


async def ready(request: Request) -> Response:
    try:
        service(request).require_ready()
    except ApiError as e:
        return error_response(e)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    return Response(service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> Response:
    svc = service(request)
    return JSONResponse({"object": "list", "data": [
        {"id": svc.model_name, "object": "model", "created": int(svc.started_at), "owned_by": "qwen3-tts-server"}]})


# under /v1 (mounted as a group, so a wrong method on a route is a 405, not the page's 404)
v1_routes = [
    Route("/audio/speech", speech, methods=["POST"]),
    Route("/voices", create_voice, methods=["POST"]),
    Route("/voices", list_voices, methods=["GET"]),
    Route("/voices/{voice_id}", get_voice, methods=["GET"]),
    Route("/voices/{voice_id}", delete_voice, methods=["DELETE"]),
    Route("/models", models, methods=["GET"]),
]
routes = [
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
