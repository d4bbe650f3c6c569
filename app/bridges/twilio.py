"""Twilio Media Streams bridge: `python -m app.bridges.twilio --tts-url ws://HOST:PORT`.

Twilio's bidirectional `<Connect><Stream url="wss://BRIDGE/twilio/media">` connects here. Per call the
bridge opens one session with the TTS server (μ-law 8 kHz, 20 ms frames) and speaks the `text`
custom parameter of `start` and whatever is posted to `POST /calls/{callSid}/say`. Audio goes to
Twilio as `media` messages of exactly 160 bytes (20 ms), one `mark` named after the turn follows
each turn, and `POST /calls/{callSid}/clear` (barge-in) cancels at the TTS server and sends
`clear`. `stop` or a closed socket ends the TTS session at once.

Pacing: media is sent at real time, at most `lead_ms` ahead of the playback clock (a frame is due
20 ms after the previous one; after an underrun the clock restarts at once instead of bursting to
catch up). Twilio would buffer a burst, but pacing keeps little audio queued on Twilio's side, so an
echoed mark means "played" within `lead_ms`, and a barge-in has little to throw away. `--lead-ms`
large (e.g. 60000) forwards as fast as the server produces.

Routes: `WS /twilio/media` (Twilio); `POST /calls/{callSid}/say` `{"text", "turn_id"?, "final"?}`
-> `{"turn_id"}` (pieces of one turn: same turn_id, `final: false` until the last);
`POST /calls/{callSid}/clear` -> `{"cancelled": [turn ids]}`; `GET /calls` (per-call counters);
`GET|POST /twiml?text=...` (TwiML for a number's voice webhook); `GET /health`. The `start`
event's customParameters `voice` and `language` pick the call's voice and language. Pings keep
the TTS session of a silent call open.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Optional
from xml.sax.saxutils import quoteattr

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from websockets.exceptions import ConnectionClosed, WebSocketException

from app.bridges.tts_client import Audio, TTSClient

log = logging.getLogger("app.bridges.twilio")

SAMPLE_RATE = 8000
FRAME_MS = 20
FRAME_BYTES = SAMPLE_RATE * FRAME_MS // 1000   # 160 bytes of μ-law per media message
MULAW_SILENCE = b"\xff"                          # μ-law code of 0


@dataclass
class BridgeConfig:
    tts_url: str
    api_key: Optional[str] = None
    lead_ms: float = 60.0
    voice: Optional[str] = None
    language: Optional[str] = None


@dataclass
class _Outgoing:
    """One message for Twilio, queued in playback order."""
    turn_id: str
    payload: Optional[bytes] = None    # a 160-byte frame; None means "the mark ending the turn"


@dataclass
class CallStats:
    media_sent: int = 0
    marks_sent: list[str] = field(default_factory=list)
    marks_echoed: list[str] = field(default_factory=list)
    inbound_media: int = 0
    clears: int = 0
    turns_done: list[dict] = field(default_factory=list)   # the server's turn.done, in order


class TwilioCall:
    """One Twilio stream and its TTS session: turns in, paced media and marks out."""

    def __init__(self, ws: WebSocket, start: dict, tts: TTSClient, lead_s: float):
        self.ws = ws
        self.stream_sid = start["streamSid"]
        self.call_sid = start["callSid"]
        self.tts = tts
        self.lead_s = lead_s
        self.stats = CallStats()
        self.unfinished: list[str] = []         # said, and not all of it sent to Twilio yet (no mark)
        self.cancelled: set[str] = set()
        self._turn_ids = (f"turn-{n}" for n in itertools.count(1))
        self._partial: dict[str, bytes] = {}    # bytes short of a whole frame, per turn
        self._queue: asyncio.Queue[_Outgoing] = asyncio.Queue()
        self._send_lock = asyncio.Lock()
        self._clock: Optional[float] = None     # loop time at which the next frame starts playing
        self.ended = asyncio.Event()            # set when the TTS session is gone
        self._tasks = [asyncio.create_task(self._pump_tts()), asyncio.create_task(self._send_paced()),
                       asyncio.create_task(self._keep_alive())]

    async def say(self, text: str, turn_id: Optional[str] = None, final: bool = True) -> str:
        if turn_id is None:
            turn_id = next(self._turn_ids)
        if turn_id in self.cancelled:
            raise ValueError(f"turn {turn_id!r} was cleared")
        if turn_id not in self.unfinished:
            self.unfinished.append(turn_id)
        await self.tts.say(turn_id, text, final)
        return turn_id

    async def clear(self) -> list[str]:
        """Barge-in: cancel every turn at the server, drop their unsent audio, tell Twilio to clear."""
        cleared = list(self.unfinished)
        self.cancelled.update(cleared)
        self.unfinished.clear()
        self._partial.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._clock = None
        await self._send({"event": "clear", "streamSid": self.stream_sid})
        self.stats.clears += 1
        await self.tts.cancel()
        return cleared

    def on_mark(self, name: str) -> None:
        """Twilio echoes a mark when the audio before it has played (or was cleared)."""
        self.stats.marks_echoed.append(name)

    def status(self) -> dict:
        return {"call_sid": self.call_sid, "stream_sid": self.stream_sid, "unfinished_turns": self.unfinished,
                "media_sent": self.stats.media_sent, "marks_sent": self.stats.marks_sent,
                "marks_echoed": self.stats.marks_echoed, "inbound_media": self.stats.inbound_media,
                "clears": self.stats.clears, "turns_done": self.stats.turns_done}

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tts.close()
        self.ended.set()

    async def _pump_tts(self) -> None:
        """TTS events -> whole 160-byte frames and end-of-turn marks on the queue."""
        try:
            async for event in self.tts.events():
                if isinstance(event, Audio):
                    if event.turn_id in self.cancelled:
                        continue
                    data = self._partial.pop(event.turn_id, b"") + event.data
                    whole = len(data) - len(data) % FRAME_BYTES
                    for i in range(0, whole, FRAME_BYTES):
                        self._queue.put_nowait(_Outgoing(event.turn_id, data[i:i + FRAME_BYTES]))
                    if whole < len(data):
                        self._partial[event.turn_id] = data[whole:]
                elif event.get("type") == "turn.done":
                    self.stats.turns_done.append({k: event.get(k) for k in ("turn_id", "reason", "frames", "samples")})
                    self._end_turn(str(event.get("turn_id")))
                elif event.get("type") == "error":
                    log.warning("call %s: TTS error %s", self.call_sid, event)
        finally:
            self.ended.set()

    async def _keep_alive(self) -> None:
        """A call may be silent for minutes; pings keep the server from closing an idle session."""
        idle_s = (self.tts.created.get("limits") or {}).get("idle_timeout_s") or 60.0
        while True:
            await asyncio.sleep(idle_s / 3)
            await self.tts.ping()

    def _end_turn(self, turn_id: str) -> None:
        if turn_id in self.cancelled:
            return
        rest = self._partial.pop(turn_id, b"")
        if rest:
            self._queue.put_nowait(_Outgoing(turn_id, rest + MULAW_SILENCE * (FRAME_BYTES - len(rest))))
        self._queue.put_nowait(_Outgoing(turn_id))

    async def _send_paced(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self._queue.get()
            if item.payload is None:
                if await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": item.turn_id}},
                                    item.turn_id):
                    self.stats.marks_sent.append(item.turn_id)
                    self.unfinished.remove(item.turn_id)
                continue
            if self._clock is not None and self._clock - loop.time() > self.lead_s:
                await asyncio.sleep(self._clock - loop.time() - self.lead_s)
            payload = base64.b64encode(item.payload).decode("ascii")
            if await self._send({"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}},
                                item.turn_id):
                self.stats.media_sent += 1
                # The frame starts playing once it is out: a clock that fell behind (the first frame, or
                # after an underrun) restarts at the moment of sending, not at the moment before it.
                self._clock = max(self._clock or 0.0, loop.time()) + FRAME_MS / 1000

    async def _send(self, msg: dict, turn_id: Optional[str] = None) -> bool:
        """Sends a JSON text frame unless it belongs to a turn cleared meanwhile."""
        async with self._send_lock:
            if turn_id is not None and turn_id in self.cancelled:
                return False
            await self.ws.send_text(json.dumps(msg, separators=(",", ":")))
            return True


def create_app(config: BridgeConfig) -> Starlette:
    calls: dict[str, TwilioCall] = {}

    def authorized(request: Request) -> bool:
        return not config.api_key or request.headers.get("authorization") == f"Bearer {config.api_key}"

    def error(status: int, code: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)

    async def media_stream(ws: WebSocket) -> None:
        await ws.accept()
        call: Optional[TwilioCall] = None
        tts_gone: Optional[asyncio.Future] = None
        try:
            while True:
                receive = asyncio.ensure_future(ws.receive())
                done, _ = await asyncio.wait({receive} | ({tts_gone} if tts_gone else set()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if receive not in done:
                    receive.cancel()
                    log.warning("call %s: the TTS session ended; closing the stream", call.call_sid)
                    await ws.close(1011)
                    return
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is None:
                    continue            # Twilio sends JSON text frames only
                event = json.loads(message["text"])
                kind = event.get("event")
                if kind == "start" and call is None:
                    call = await _start_call(ws, event["start"])
                    if call is None:
                        return
                    calls[call.call_sid] = call
                    tts_gone = asyncio.ensure_future(call.ended.wait())
                elif kind == "media" and call:
                    call.stats.inbound_media += 1
                elif kind == "mark" and call:
                    call.on_mark(event.get("mark", {}).get("name", ""))
                elif kind == "stop":
                    return
        except WebSocketDisconnect:
            return
        finally:
            if tts_gone is not None:
                tts_gone.cancel()
            if call is not None:
                try:
                    await call.close()
                finally:
                    calls.pop(call.call_sid, None)

    async def _start_call(ws: WebSocket, start: dict) -> Optional[TwilioCall]:
        params = start.get("customParameters") or {}
        try:
            tts = await TTSClient.open(config.tts_url, api_key=config.api_key, encoding="mulaw",
                                       sample_rate=SAMPLE_RATE, frame_ms=FRAME_MS,
                                       voice=params.get("voice") or config.voice,
                                       language=params.get("language") or config.language)
        except (OSError, ConnectionError, asyncio.TimeoutError, WebSocketException) as e:
            log.error("call %s: cannot open a TTS session at %s: %s", start.get("callSid"), config.tts_url, e)
            await ws.close(1011)
            return None
        call = TwilioCall(ws, start, tts, config.lead_ms / 1000)
        if params.get("text"):
            await call.say(params["text"])
        return call

    def call_of(request: Request):
        """The call a /calls/{callSid}/... request names, or the error response to send instead."""
        if not authorized(request):
            return error(401, "unauthorized", "missing or wrong API key")
        call = calls.get(request.path_params["call_sid"])
        return call if call is not None else error(404, "call_not_found", "no stream is connected for this callSid")

    async def say(request: Request) -> Response:
        call = call_of(request)
        if isinstance(call, Response):
            return call
        try:
            body = await request.json()
            text, turn_id, final = body.get("text", ""), body.get("turn_id"), bool(body.get("final", True))
        except (ValueError, AttributeError):
            return error(400, "bad_request", 'body must be JSON {"text": ..., "turn_id"?: ..., "final"?: bool}')
        if not isinstance(text, str) or not (text or (turn_id and final)):
            return error(400, "bad_request", "text must be a non-empty string")
        try:
            turn_id = await call.say(text, None if turn_id is None else str(turn_id), final)
        except ValueError as e:
            return error(409, "turn_cleared", str(e))
        except ConnectionClosed:
            return error(503, "tts_unavailable", "the TTS session of this call has ended")
        return JSONResponse({"call_sid": call.call_sid, "turn_id": turn_id})

    async def clear(request: Request) -> Response:
        call = call_of(request)
        if isinstance(call, Response):
            return call
        try:
            return JSONResponse({"call_sid": call.call_sid, "cancelled": await call.clear()})
        except ConnectionClosed:
            return error(503, "tts_unavailable", "the TTS session of this call has ended")

    async def list_calls(request: Request) -> Response:
        if not authorized(request):
            return error(401, "unauthorized", "missing or wrong API key")
        return JSONResponse({"calls": [c.status() for c in calls.values()]})

    async def twiml(request: Request) -> Response:
        """TwiML for a Twilio number's voice webhook: connect the call to this bridge."""
        url = f"wss://{request.headers.get('host', request.url.netloc)}/twilio/media"
        params = "".join(f"<Parameter name={quoteattr(k)} value={quoteattr(v)}/>"
                         for k, v in request.query_params.items() if k in ("text", "voice", "language"))
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Response><Connect><Stream url={quoteattr(url)}>'
                f"{params}</Stream></Connect></Response>")
        return Response(body, media_type="text/xml")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "calls": len(calls)})

    return Starlette(routes=[
        WebSocketRoute("/twilio/media", media_stream),
        Route("/calls", list_calls),
        Route("/calls/{call_sid}/say", say, methods=["POST"]),
        Route("/calls/{call_sid}/clear", clear, methods=["POST"]),
        Route("/twiml", twiml, methods=["GET", "POST"]),
        Route("/health", health),
    ])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bridges.twilio", description=__doc__.split("\n")[0])
    parser.add_argument("--tts-url", default=os.environ.get("TTS_URL", "ws://127.0.0.1:8090"),
                        help="the TTS server (base URL or its /v1/audio/speech/ws URL)")
    parser.add_argument("--host", default=os.environ.get("BRIDGE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("BRIDGE_PORT", "8091")))
    parser.add_argument("--api-key", default=os.environ.get("API_KEY"),
                        help="sent to the TTS server, and required as a Bearer token on /calls routes")
    parser.add_argument("--lead-ms", type=float, default=60.0, help="how far ahead of real time media may be sent")
    parser.add_argument("--voice", default=os.environ.get("VOICE"), help="default voice id for calls")
    parser.add_argument("--language", default=os.environ.get("LANGUAGE"), help="default language for calls")
    args = parser.parse_args(argv)
    import uvicorn
    logging.basicConfig(level=logging.INFO)
    config = BridgeConfig(args.tts_url, args.api_key, args.lead_ms, args.voice, args.language)
    uvicorn.run(create_app(config), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
