"""Helpers for tests/test_server_*.py: a real uvicorn server on a loopback port (in a thread of the
test process, so the model is loaded once per server), a scheduler test double for protocol tests
that need audio faster or in larger pieces than the tiny model makes it, and small clients."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import httpx
import numpy as np
import soundfile as sf
import uvicorn

from app.main import create_app, uvicorn_config
from app.service import Settings
from engine.requests import AudioChunk, TurnResult
from engine.scheduler import Overloaded, SchedulerStats

REF_WAV = Path(__file__).resolve().parents[1] / "engine" / "assets" / "default_voice.wav"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(settings) as srv:` serves on srv.url until the block ends."""

    def __init__(self, settings: Settings, scheduler=None, ready_timeout: float = 120.0):
        self.settings = replace(settings, host="127.0.0.1", port=free_port())
        self.app = create_app(self.settings, scheduler)
        self.server = uvicorn.Server(uvicorn_config(self.app, self.settings, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.ready_timeout = ready_timeout
        self.startup_answers: list[tuple[int, dict]] = []     # /ready answers seen while starting
        self.url = f"http://127.0.0.1:{self.settings.port}"
        self.ws_url = f"ws://127.0.0.1:{self.settings.port}/v1/audio/speech/ws"

    @property
    def service(self):
        return self.app.state.service

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.service.status == "error":
                raise RuntimeError(f"server failed to start: {self.service.error}")
            try:
                r = httpx.get(self.url + "/ready", timeout=2, headers=self.auth_headers())
                self.startup_answers.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server not ready in time")

    def auth_headers(self) -> dict:
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def assert_same_pcm16(a: bytes, b: bytes) -> None:
    """The same 16-bit audio of one turn taken two ways: the same length, each sample within one
    step. The codes are equal; the vocoder windows follow step times (engine.streaming.WindowPolicy),
    and where they split differently the float rounding moves a sample by a step at most."""
    x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
    assert x.shape == y.shape and x.size > 0
    assert np.abs(x - y).max() <= 1, np.abs(x - y).max()


def ref_wav_b64(seconds: Optional[float] = None, noise: bool = False) -> str:
    """The default voice clip (or seeded noise at 16 kHz) as a base64 WAV, cut or tiled to `seconds`."""
    wav, sr = sf.read(str(REF_WAV), dtype="float32")
    if noise:
        sr = 16000
        wav = (0.2 * np.random.default_rng(0).standard_normal(len(wav))).astype(np.float32)
    if seconds is not None:
        wav = np.resize(wav, int(seconds * sr))
    buf = io.BytesIO()
    sf.write(buf, wav, sr, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


# -- a scheduler test double -----------------------------------------------------------------------

class _FakeHandle:
    def __init__(self, fake: "FakeScheduler", request):
        self.fake, self.request = fake, request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text_done = request.text_complete
        self.text_event = asyncio.Event()
        self.cancelled = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    def push_text(self, text: str) -> None:
        self.text_event.set()

    def finish_text(self) -> None:
        self.text_done = True
        self.text_event.set()

    def cancel(self) -> None:
        self.cancelled = True
        self.text_event.set()

    async def _run(self) -> None:
        f = self.fake
        frames = samples = 0
        try:
            while not self.text_done and not self.cancelled:
                self.text_event.clear()
                await self.text_event.wait()
            limit = f.frames if self.request.max_frames is None else min(f.frames, self.request.max_frames)
            while frames < limit and not self.cancelled:
                await asyncio.sleep(f.step_s)
                n = min(f.frames_per_chunk, limit - frames)
                pcm = (0.5 * np.sin(np.arange(samples, samples + n * 1920) * 0.05)).astype(np.float32)
                await self.queue.put(AudioChunk(pcm, frames, samples))
                frames, samples = frames + n, samples + n * 1920
            reason = "cancelled" if self.cancelled else "max_frames"
        finally:
            f.in_flight -= 1
        await self.queue.put(TurnResult(reason, frames, samples, 0.0, 1.0))

    def __aiter__(self):
        return self

    async def __anext__(self):
        if getattr(self, "_done", False):
            raise StopAsyncIteration
        item = await self.queue.get()
        self._done = isinstance(item, TurnResult)
        return item


class FakeScheduler:
    """The Scheduler API with made-up audio: `frames` frames per turn, `frames_per_chunk` frames per
    chunk every `step_s` seconds, at most `capacity` requests in flight (then `Overloaded`)."""

    def __init__(self, model, capacity: int = 4, frames: int = 20, frames_per_chunk: int = 2, step_s: float = 0.01):
        self.model, self.max_batch = model, capacity
        self.frames, self.frames_per_chunk, self.step_s = frames, frames_per_chunk, step_s
        self.in_flight = 0
        self.submitted = []
        self.runner = SimpleNamespace(graphs=None)     # no CUDA graphs to capture

    def submit(self, request):
        if self.in_flight >= self.max_batch:
            raise Overloaded("full")
        if request.text_complete and not request.text.strip():
            raise ValueError("empty text: nothing to speak")
        self.in_flight += 1
        self.submitted.append(request)
        return _FakeHandle(self, request)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(active=self.in_flight, queued=0, max_batch=self.max_batch, steps=0, last_step_ms=0.0,
                              last_batch_size=0, frames_generated=0, waiting_for_text=0, text_waits=0, capacity=0, kv_cache_bytes=0,
                              oom_recoveries=0, host_seconds={})

    def stop(self, timeout=None) -> None:
        pass


# -- clients ---------------------------------------------------------------------------------------

async def read_turns(ws, n_turns: int, timeout: float = 60.0) -> dict:
    """Read until `n_turns` turn.done events: {turn_id: {"audio": bytes, "events": [...], "done": {...}}}
    (raw framing: audio belongs to the turn that last started)."""
    turns: dict = {}
    current = None
    done = 0
    deadline = time.monotonic() + timeout
    while done < n_turns:
        msg = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
        if isinstance(msg, bytes):
            turns[current]["audio"] += msg
            turns[current]["frames"].append(len(msg))
            continue
        event = json.loads(msg)
        tid = event.get("turn_id")
        if tid is not None:
            entry = turns.setdefault(tid, {"audio": b"", "frames": [], "events": [], "done": None})
            entry["events"].append(event)
        if event["type"] == "turn.started":
            current = tid
        elif event["type"] == "turn.done":
            turns[tid]["done"] = event
            done += 1
        elif event["type"] == "error" and tid is None:
            turns.setdefault(None, {"audio": b"", "frames": [], "events": [], "done": None})["events"].append(event)
    return turns


async def next_event(ws, kind: str, timeout: float = 30.0) -> dict:
    """Skip to the next control event of type `kind` (audio and other events are dropped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
        if isinstance(msg, str):
            event = json.loads(msg)
            if event["type"] == kind:
                return event
