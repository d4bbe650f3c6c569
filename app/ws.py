"""The WebSocket session (`/v1/audio/speech/ws`): turns spoken in order, text in pieces, barge-in.

Three tasks per socket:
- the receiver parses control messages (JSON text or msgpack binary frames) and applies them;
- the speaker takes turns in order, submits each to the scheduler as soon as it has text (more text
  follows through the handle), and turns its chunks into encoded audio messages;
- the sender writes queued messages to the socket in order.
The speaker never waits for the socket: audio goes into the session's queue, which is bounded in
bytes; a client that does not read is told (`fatal.slow_consumer`) and closed, and its turns are
cancelled, so it cannot hold a batch slot or slow anyone else. Cancel drops the turn's queued audio
at once and stops its generation within one engine step.

Each turn takes the session's settings (voice, language, sampling, format, framing) as they are
when its first message arrives, so a `session.update` applies to the turns created after it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Optional

import msgpack
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from engine.requests import SamplingParams, SpeechRequest, TurnResult, VoicePrompt

from .audio import BYTES_PER_SAMPLE, MODEL_RATE, AudioFormat, FormatError, StreamEncoder
from .errors import ApiError, error_response
from .metrics import PlaybackClock
from .params import base64_audio, boolean, integer, language, optional_str, sampling
from .service import Service

log = logging.getLogger("qwen3_tts.ws")

MAX_TURN_ID = 128
FINISHED_TURNS_KEPT = 1024
CLOSE_GRACE_S = 5.0     # a stuck client gets this long to take the final error and close
DRAIN_POLL_S = 0.05     # while the server drains, how often a session checks whether its turns are done
# close codes: 1000 normal (idle timeout), 1001 going away (server stops), 1008 policy (slow reader),
# 1011 internal error
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_INTERNAL = 1000, 1001, 1008, 1011


@dataclass(frozen=True)
class TurnSettings:
    voice_id: Optional[str]        # None: the default voice, or an inline clone
    voice: VoicePrompt
    language: str
    sampling: SamplingParams
    format: AudioFormat
    framing: str                   # "raw" | "msgpack"
    max_frames: Optional[int]

    def describe(self) -> dict:
        s = self.sampling
        return {"voice": self.voice_id, "language": self.language, "format": self.format.to_dict(),
                "audio_framing": self.framing, "max_frames": self.max_frames,
                "sampling": {"temperature": 0.0 if s.greedy else s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                             "repetition_penalty": s.repetition_penalty, "seed": s.seed}}


class Turn:
    def __init__(self, turn_id: str, settings: TurnSettings):
        self.id = turn_id
        self.settings = settings
        self.created = time.monotonic()
        self.parts: list[str] = []     # text not yet handed to the engine
        self.chars = 0
        self.ended = False
        self.cancelled = False
        self.handle = None
        self.samples = 0               # output samples queued or sent (not dropped)
        self.seq = 0


@dataclass
class Outgoing:
    turn: Optional[Turn]
    data: object                   # str (JSON), bytes, or ("close", code, reason)
    nbytes: int = 0                # audio bytes, counted against the send buffer
    samples: int = 0


class Session:
    def __init__(self, ws: WebSocket, svc: Service, binary_control: Optional[bool]):
        self.ws, self.svc = ws, svc
        self.limits = svc.settings
        self.id = "sess_" + secrets.token_hex(8)
        self.binary_control = binary_control     # None until the client's first control message
        self.settings = TurnSettings(None, svc.default_voice(), "auto", svc.sampling_defaults, AudioFormat(), "raw",
                                     svc.max_frames(None))
        self.live: dict[str, Turn] = {}          # turns not done yet
        self.pending: collections.deque[Turn] = collections.deque()   # not started yet, in order
        self.finished: collections.OrderedDict[str, bool] = collections.OrderedDict()  # id -> cancelled
        self.turn_count = 0
        self.wake_speaker = asyncio.Event()
        self.out: collections.deque[Outgoing] = collections.deque()
        self.out_ready = asyncio.Event()
        self.out_bytes = 0
        self.stop = asyncio.Event()
        self.closing = False
        self.fatal_sent = False
        self.last_activity = time.monotonic()

    # -- outgoing ----------------------------------------------------------------------------------

    def _queue(self, item: Outgoing) -> None:
        self.out.append(item)
        self.out_ready.set()

    def event(self, payload: dict) -> None:
        """A control message, in the encoding the client used first."""
        data = msgpack.packb(payload, use_bin_type=True) if self.binary_control else json.dumps(payload)
        self._queue(Outgoing(None, data))

    def error(self, code: str, message: str, turn_id: Optional[str] = None, **extra) -> None:
        payload = {"type": "error", "code": code, "message": message, "fatal": code.startswith("fatal.")}
        if turn_id is not None:
            payload["turn_id"] = turn_id
        self.event({**payload, **extra})

    def audio(self, turn: Turn, offset: int, data: bytes) -> None:
        if turn.cancelled:
            return
        samples = len(data) // BYTES_PER_SAMPLE[turn.settings.format.encoding]
        if turn.settings.framing == "msgpack":
            data = msgpack.packb({"type": "audio", "turn_id": turn.id, "seq": turn.seq, "offset": offset, "data": data},
                                 use_bin_type=True)
        turn.seq += 1
        turn.samples += samples
        self.out_bytes += len(data)
        self._queue(Outgoing(turn, data, len(data), samples))
        if self.out_bytes > self.limits.send_buffer_bytes:
            self.fatal("fatal.slow_consumer", f"the client reads too slowly: more than {self.limits.send_buffer_bytes} "
                       "bytes of audio are waiting to be sent", CLOSE_POLICY)

    def drop_audio(self, turn: Optional[Turn]) -> None:
        """Forget queued audio of `turn` (of every turn if None)."""
        kept = collections.deque()
        for item in self.out:
            if item.nbytes and (turn is None or item.turn is turn):
                self.out_bytes -= item.nbytes
                item.turn.samples -= item.samples
            else:
                kept.append(item)
        self.out = kept

    async def send_loop(self) -> None:
        try:
            while True:
                while not self.out:
                    self.out_ready.clear()
                    await self.out_ready.wait()
                item = self.out.popleft()
                self.out_bytes -= item.nbytes
                if isinstance(item.data, tuple):
                    await self.ws.close(item.data[1], item.data[2])
                    return
                if isinstance(item.data, str):
                    await self.ws.send_text(item.data)
                else:
                    await self.ws.send_bytes(item.data)
        except Exception:       # the client is gone or the socket broke: the session ends
            self.stop.set()

    def fatal(self, code: str, message: str, close_code: int) -> None:
        """End the session: cancel its turns, drop queued audio, send the error, then close."""
        if self.closing:
            return
        self.closing = True
        log.info("session %s: %s (%s)", self.id, code, message)
        self.cancel_all(notify=False)
        self.drop_audio(None)
        self.error(code, message)
        self._queue(Outgoing(None, ("close", close_code, code.removeprefix("fatal."))))
        self.fatal_sent = True
        self.stop.set()

    # -- turns -------------------------------------------------------------------------------------

    def open_turn(self, turn_id: Optional[str]) -> Turn:
        """The turn text is for: an existing open one, or a new one."""
        if turn_id is None:
            for turn in reversed(list(self.live.values())):
                if not turn.ended:
                    return turn
            self.turn_count += 1
            turn_id = f"turn_{self.turn_count}"
        elif turn_id in self.live:
            turn = self.live[turn_id]
            if turn.ended:
                raise ApiError(400, "turn_closed", f"turn {turn_id!r} has ended; use a new turn_id")
            return turn
        elif turn_id in self.finished:
            raise ApiError(400, "turn_closed", f"turn {turn_id!r} is done; use a new turn_id")
        if self.svc.draining.is_set():
            raise ApiError(503, "shutting_down", "the server is shutting down: no new turns; turns already "
                           "started are finished", retry_after=1.0)
        turn = Turn(turn_id, self.settings)
        self.live[turn_id] = turn
        self.pending.append(turn)
        return turn

    def add_text(self, turn: Turn, text: str) -> None:
        turn.chars += len(text)
        if not text:
            return
        if turn.handle is not None:
            turn.handle.push_text(text)
        else:
            turn.parts.append(text)
            self.wake_speaker.set()

    def end_turn(self, turn: Turn) -> None:
        turn.ended = True
        if turn.handle is not None:
            turn.handle.finish_text()
        self.wake_speaker.set()

    def cancel_turn(self, turn: Turn, notify: bool = True) -> None:
        turn.cancelled = True
        self.drop_audio(turn)
        if turn.handle is not None:
            turn.handle.cancel()            # the speaker sends turn.done when the engine confirms
        else:
            self.pending.remove(turn)
            self.finish(turn, "cancelled", 0, 0.0, 0.0, notify)

    def cancel_all(self, notify: bool = True) -> None:
        for turn in list(self.live.values()):
            if not turn.cancelled:
                self.cancel_turn(turn, notify)

    def finish(self, turn: Turn, reason: str, frames: int, ttfa_ms: float, wall_s: float, notify: bool = True,
               queue_ms: float = 0.0) -> None:
        del self.live[turn.id]
        self.finished[turn.id] = turn.cancelled
        while len(self.finished) > FINISHED_TURNS_KEPT:
            self.finished.popitem(last=False)
        self.svc.metrics.requests.labels("ws", reason).inc()
        if notify:
            rate = turn.settings.format.sample_rate
            audio_s = turn.samples / rate
            self.event({"type": "turn.done", "turn_id": turn.id, "reason": reason, "frames": frames,
                        "audio_ms": round(audio_s * 1000, 3), "ttfa_ms": round(ttfa_ms, 1),
                        "rtf": round(audio_s / wall_s, 3) if wall_s > 0 else 0.0, "queue_ms": round(queue_ms, 1),
                        "samples": turn.samples, "sample_rate": rate})

    async def speak_loop(self) -> None:
        try:
            while True:
                while not (self.pending and (self.pending[0].parts or self.pending[0].ended)):
                    self.wake_speaker.clear()
                    await self.wake_speaker.wait()
                await self.speak(self.pending.popleft())
        except Exception:       # a bug: end this session, keep the server
            log.exception("session %s failed", self.id)
            self.fatal("fatal.internal", "internal error; the session is closed", CLOSE_INTERNAL)

    async def speak(self, turn: Turn) -> None:
        text = "".join(turn.parts)
        turn.parts.clear()
        if turn.ended and not text.strip():
            self.finish(turn, "eos", 0, 0.0, 0.0)          # nothing to say
            return
        s = turn.settings
        request = SpeechRequest(text, s.voice, s.language, s.sampling, text_complete=turn.ended,
                                max_frames=s.max_frames, request_id=f"{self.id}/{turn.id}")
        t0 = time.monotonic()
        waited_ms = (t0 - turn.created) * 1000      # behind this session's earlier turns
        try:
            turn.handle = self.svc.submit(request)
        except ApiError as e:
            extra = {"retry_after_ms": int(e.retry_after * 1000)} if e.retry_after else {}
            self.error(e.code, e.message, turn.id, **extra)
            self.finish(turn, "error", 0, 0.0, 0.0)
            return
        encoder = StreamEncoder(s.format)
        clock = PlaybackClock(MODEL_RATE)
        started = False
        result = None
        async for item in turn.handle:
            if isinstance(item, TurnResult):
                result = item
            elif not turn.cancelled:
                if not started:
                    started = True
                    self.event({"type": "turn.started", "turn_id": turn.id, "queue_ms": round(waited_ms, 1)})
                clock.add(time.monotonic(), item.pcm.shape[0])
                for offset, data in encoder.encode(item.pcm):
                    self.audio(turn, offset, data)
        if result.reason == "error" and not turn.cancelled:
            self.error("generation_failed", f"generation failed: {result.error}", turn.id)
        elif not turn.cancelled:
            for offset, data in encoder.flush():
                self.audio(turn, offset, data)
        wall = time.monotonic() - t0
        self.svc.metrics.observe_turn(result.samples / MODEL_RATE, wall, result.ttfa_ms, clock.underruns)
        if clock.dry:
            log.warning("turn %s/%s: playback ran dry %d times (after s of audio, for ms: %s)", self.id, turn.id,
                        len(clock.dry), ", ".join(f"{at}: {ms:.0f}" for at, ms in clock.dry[:8]))
        self.finish(turn, "cancelled" if turn.cancelled else result.reason, result.frames, result.ttfa_ms, wall,
                    notify=not self.closing, queue_ms=waited_ms + result.queue_ms)

    # -- incoming ----------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Audio still to come without the client saying more: queued, or a complete turn not done.
        (A turn still waiting for text is not: a client that leaves one open and goes quiet is idle.)"""
        return bool(self.out) or any(t.ended for t in self.live.values())

    async def receive_loop(self) -> None:
        """Read and apply messages until the client leaves or the session ends; closes idle sessions."""
        receive = asyncio.ensure_future(self.ws.receive())
        stopped = asyncio.ensure_future(self.stop.wait())
        server_closing = asyncio.ensure_future(self.svc.closing.wait())
        draining = asyncio.ensure_future(self.svc.draining.wait())
        try:
            while True:
                timeout = self.last_activity + self.limits.idle_timeout_s - time.monotonic()
                waits = {receive, stopped, server_closing}
                if not draining.done():
                    waits.add(draining)
                elif not self.live and not self.out:    # its turns are done and sent: close it
                    self.fatal("fatal.shutting_down", "the server is shutting down", CLOSE_GOING_AWAY)
                    return
                else:
                    timeout = min(timeout, DRAIN_POLL_S)
                await asyncio.wait(waits, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
                if stopped.done():
                    return
                if server_closing.done():
                    self.fatal("fatal.shutting_down", "the server is shutting down", CLOSE_GOING_AWAY)
                    return
                if not receive.done():
                    if self.busy():
                        self.last_activity = time.monotonic()
                    elif time.monotonic() - self.last_activity >= self.limits.idle_timeout_s:
                        self.fatal("fatal.idle_timeout", f"no message for {self.limits.idle_timeout_s:g} s",
                                   CLOSE_NORMAL)
                        return
                    continue
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    return
                self.last_activity = time.monotonic()
                await self.handle(message)
                receive = asyncio.ensure_future(self.ws.receive())
        finally:
            for task in (receive, stopped, server_closing, draining):
                task.cancel()

    def parse(self, message: dict) -> dict:
        text, data = message.get("text"), message.get("bytes")
        binary = text is None
        try:
            msg = msgpack.unpackb(data, raw=False) if binary else json.loads(text)
        except Exception:
            raise ApiError(400, "invalid_message", "control messages are JSON objects in text frames or msgpack "
                                                   "maps in binary frames") from None
        if not isinstance(msg, dict):
            raise ApiError(400, "invalid_message", "a control message must be an object with a 'type'")
        if self.binary_control is None:
            self.binary_control = binary
        return msg

    async def handle(self, message: dict) -> None:
        turn_id = None
        try:
            msg = self.parse(message)
            kind = msg.get("type")
            turn_id = msg.get("turn_id")
            if turn_id is not None and (not isinstance(turn_id, str) or not 0 < len(turn_id) <= MAX_TURN_ID):
                turn_id = None
                raise ApiError(400, "invalid_request", f"turn_id must be a string of 1 to {MAX_TURN_ID} characters")
            if kind == "text":
                self.on_text(msg, turn_id)
            elif kind == "turn.end":
                self.on_turn_end(turn_id)
            elif kind == "cancel":
                self.on_cancel(turn_id)
            elif kind == "session.update":
                await self.on_update(msg)
            elif kind == "ping":
                self.event({"type": "pong"})
            else:
                raise ApiError(400, "unknown_type", f"unknown message type {kind!r}; expected session.update, text, "
                                                    "turn.end, cancel or ping")
        except ApiError as e:
            extra = {"retry_after_ms": int(e.retry_after * 1000)} if e.retry_after else {}
            self.error(e.code, e.message, turn_id, **extra)
        except Exception:       # a bug: end this session, keep the server
            log.exception("session %s failed on a message", self.id)
            self.fatal("fatal.internal", "internal error; the session is closed", CLOSE_INTERNAL)

    def on_text(self, msg: dict, turn_id: Optional[str]) -> None:
        text = msg.get("text", "")
        if not isinstance(text, str):
            raise ApiError(400, "invalid_request", "text must be a string")
        final = boolean("final", msg.get("final", False))
        if turn_id is not None and self.finished.get(turn_id):
            return      # text still streaming in for a turn the client cancelled: dropped
        known = self.live.get(turn_id)
        if (known.chars if known else 0) + len(text) > self.limits.max_text_chars:
            raise ApiError(413, "text_too_long", f"turn {turn_id!r} would have more than {self.limits.max_text_chars} "
                                                 "characters")
        turn = self.open_turn(turn_id)
        self.add_text(turn, text)
        if final:
            self.end_turn(turn)

    def on_turn_end(self, turn_id: Optional[str]) -> None:
        if turn_id is None:
            turn = next((t for t in reversed(list(self.live.values())) if not t.ended), None)
            if turn is None:
                raise ApiError(400, "unknown_turn", "no open turn to end")
        elif turn_id in self.live:
            turn = self.live[turn_id]
        elif turn_id in self.finished:
            return
        else:
            raise ApiError(400, "unknown_turn", f"no turn {turn_id!r}")
        self.end_turn(turn)

    def on_cancel(self, turn_id: Optional[str]) -> None:
        if turn_id is None:
            self.cancel_all()
        elif turn_id in self.live:
            if not self.live[turn_id].cancelled:
                self.cancel_turn(self.live[turn_id])
        elif turn_id not in self.finished:
            raise ApiError(400, "unknown_turn", f"no turn {turn_id!r}")

    async def on_update(self, msg: dict) -> None:
        """Validate every field first, then apply them all (or none)."""
        s, svc = self.settings, self.svc
        changes: dict = {}
        if "voice" in msg:
            changes.update(voice_id=msg["voice"] or None, voice=svc.voice(msg["voice"]))
        if "language" in msg:
            changes["language"] = language(msg["language"], svc.model.config)
        if msg.get("sampling") is not None:
            if not isinstance(msg["sampling"], dict):
                raise ApiError(400, "invalid_request", "sampling must be an object")
            changes["sampling"] = sampling(msg["sampling"], s.sampling)
        if msg.get("format") is not None:
            f = msg["format"]
            if not isinstance(f, dict):
                raise ApiError(400, "invalid_request", "format must be an object")
            try:
                changes["format"] = AudioFormat(f.get("encoding", s.format.encoding),
                                                f.get("sample_rate", s.format.sample_rate),
                                                f["frame_ms"] if "frame_ms" in f else s.format.frame_ms)
            except FormatError as e:
                raise ApiError(400, "unsupported_format", str(e)) from None
        if "audio_framing" in msg:
            if msg["audio_framing"] not in ("raw", "msgpack"):
                raise ApiError(400, "invalid_request", "audio_framing must be 'raw' or 'msgpack'")
            changes["framing"] = msg["audio_framing"]
        if "max_frames" in msg:
            frames = None if msg["max_frames"] is None else integer("max_frames", msg["max_frames"], 1, 1 << 20)
            changes["max_frames"] = svc.max_frames(frames)
        if msg.get("ref_audio") is not None:
            audio = base64_audio("ref_audio", msg["ref_audio"])
            ref_text = optional_str("ref_text", msg.get("ref_text"))
            x_vector_only = boolean("x_vector_only", msg.get("x_vector_only", False))
            voice, _ = await svc.clone(audio, ref_text, x_vector_only)
            changes.update(voice_id=None, voice=voice)
        self.settings = dataclasses.replace(s, **changes)
        self.event({"type": "session.updated", "session_id": self.id, **self.settings.describe()})

    # -- life --------------------------------------------------------------------------------------

    def created(self) -> dict:
        lim = self.limits
        f = self.settings.format
        return {"type": "session.created", "session_id": self.id, "sample_rate": f.sample_rate,
                "encoding": f.encoding, "model": self.svc.model_name, "demo": lim.demo,
                **self.settings.describe(),
                "limits": {"max_text_chars": lim.max_text_chars, "max_message_bytes": lim.max_body_bytes,
                           "max_ref_seconds": lim.max_ref_seconds, "idle_timeout_s": lim.idle_timeout_s,
                           "send_buffer_bytes": lim.send_buffer_bytes, "max_frames": self.settings.max_frames}}

    async def run(self) -> None:
        self.event(self.created())
        sender = asyncio.ensure_future(self.send_loop())
        speaker = asyncio.ensure_future(self.speak_loop())
        try:
            await self.receive_loop()
        finally:
            self.closing = True
            for turn in list(self.live.values()):     # cut off by the session's end: no turn.done to send
                if turn.handle is not None:
                    turn.handle.cancel()       # frees the batch slot within one step
                self.finish(turn, "cancelled", 0, 0.0, 0.0, notify=False)
            speaker.cancel()                   # before it can finish a turn finished here
            if self.fatal_sent:     # let the sender deliver the error and close, not waiting on a stuck client
                await asyncio.wait({sender}, timeout=CLOSE_GRACE_S)
            sender.cancel()


async def speech_ws(ws: WebSocket) -> None:
    svc: Service = ws.app.state.service
    try:
        svc.require_ready()
        if svc.active["ws"] >= svc.settings.max_sessions:
            raise ApiError(503, "overloaded", f"the server has {svc.active['ws']} sessions open; retry shortly",
                           retry_after=1.0)
    except ApiError as e:
        svc.metrics.requests.labels("ws_session", "rejected").inc()
        await ws.send_denial_response(error_response(e))
        return
    control = ws.query_params.get("control")
    await ws.accept()
    session = Session(ws, svc, True if control == "msgpack" else None)
    svc.active["ws"] += 1
    svc.metrics.active_sessions.labels("ws").inc()
    try:
        await session.run()
    finally:
        svc.active["ws"] -= 1
        svc.metrics.active_sessions.labels("ws").dec()
        svc.metrics.requests.labels("ws_session", "closed").inc()


v1_routes = [WebSocketRoute("/audio/speech/ws", speech_ws)]
