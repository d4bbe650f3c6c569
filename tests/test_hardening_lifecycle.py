"""Start and stop under load: CUDA-graph warm-up before the engine thread runs, and SIGTERM drains.

SIGTERM (the real signal, to a real `python -m app` process on the tiny model): /ready turns 503 at
once and new sessions are refused; an idle session is closed with 1001; a turn in progress goes on
(its text may still arrive) and is spoken to the end, then its session is closed with 1001; a new turn
in a draining session is refused (`shutting_down`); a session still busy at --drain-timeout gets
`fatal.shutting_down` and 1001; then the process exits 0.
"""
import asyncio
import gc
import json
import signal
import sys
import threading
import time

import httpx
import pytest
import torch
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from app.service import Settings
from engine.scheduler import Scheduler
from server_harness import ServerThread, free_port, next_event
from tts_server import subprocess_service

DRAIN_S = 4.0


def test_graphs_are_captured_before_the_engine_thread_starts(tiny_model_dir, tmp_path, monkeypatch):
    calls = []
    warmup = Scheduler.warmup

    def recording(self, *args):
        calls.append((self._thread is None, threading.current_thread().name))
        return warmup(self, *args)
    monkeypatch.setattr(Scheduler, "warmup", recording)
    settings = Settings(model_dir=str(tiny_model_dir), device="cpu", max_batch=2, voices_dir=str(tmp_path))
    with ServerThread(settings) as srv:
        assert srv.service.scheduler._thread is not None
    assert calls and all(not_started for not_started, _ in calls), calls


def test_what_loading_made_is_frozen_out_of_the_collector(tiny_model_dir, tmp_path):
    """Once ready, the model's objects are in the collector's permanent generation (gc.freeze), so a
    full collection under load does not walk them while holding the GIL."""
    settings = Settings(model_dir=str(tiny_model_dir), device="cpu", max_batch=2, voices_dir=str(tmp_path))
    with ServerThread(settings) as srv:
        talker = srv.service.model.talker
        assert gc.get_freeze_count() > 0
        assert not any(o is talker for o in gc.get_objects())
        fresh = torch.nn.Linear(2, 2)       # what comes later is collected as usual
        assert any(o is fresh for o in gc.get_objects())


async def session(url):
    ws = await websockets.connect(url, max_size=None)
    assert json.loads(await ws.recv())["type"] == "session.created"
    await ws.send(json.dumps({"type": "session.update", "max_frames": 8, "sampling": {"temperature": 0}}))
    await next_event(ws, "session.updated")
    return ws


class Reader:
    """Reads one socket until it closes: its control events, audio bytes, the close frame and when."""

    def __init__(self, ws):
        self.ws, self.events, self.audio = ws, [], b""
        self.close, self.closed_at = None, None
        self.task = asyncio.ensure_future(self._read())

    async def _read(self):
        try:
            async for msg in self.ws:
                if isinstance(msg, bytes):
                    self.audio += msg
                else:
                    self.events.append(json.loads(msg))
        except ConnectionClosed:
            pass
        self.close, self.closed_at = self.ws.protocol.close_rcvd, time.monotonic()

    async def event(self, kind, timeout=15.0):
        deadline = time.monotonic() + timeout
        while not (found := [e for e in self.events if e["type"] == kind]):
            assert time.monotonic() < deadline and not self.task.done(), f"no {kind} in {self.events}"
            await asyncio.sleep(0.01)
        return found[0]

    async def ended(self, timeout=15.0):
        await asyncio.wait_for(self.task, timeout)
        return self


def test_sigterm_drains_then_closes_with_1001(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ws_url = f"ws://127.0.0.1:{port}/v1/audio/speech/ws"
    args = [sys.executable, "-m", "app", "--model-dir", str(tiny_model_dir), "--device", "cpu", "--port", str(port),
            "--voices-dir", str(tmp_path / "voices"), "--drain-timeout", str(DRAIN_S), "--max-batch", "4"]
    with subprocess_service(args, url + "/ready") as proc:
        async def go():
            idle = Reader(await session(ws_url))
            speaking = Reader(await session(ws_url))     # a turn whose text is still streaming in (an LLM)
            await speaking.ws.send(json.dumps({"type": "text", "turn_id": "t1", "text": "The first half,"}))
            await speaking.event("turn.started")
            stuck = Reader(await session(ws_url))        # a turn that never ends: cut at the deadline
            await stuck.ws.send(json.dumps({"type": "text", "turn_id": "s", "text": "This never ends"}))
            await stuck.event("turn.started")

            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(base_url=url) as client:
                while (ready := await client.get("/ready")).status_code == 200:
                    assert time.monotonic() - t0 < 2, "/ready still 200 after SIGTERM"
                    await asyncio.sleep(0.02)
                health = (await client.get("/health")).json()
            ready_503_after = time.monotonic() - t0
            with pytest.raises(InvalidStatus) as refused:
                await websockets.connect(ws_url)
            await idle.ended(5)
            await speaking.ws.send(json.dumps({"type": "text", "turn_id": "t2", "text": "A new turn.", "final": True}))
            refused_turn = await speaking.event("error")
            await speaking.ws.send(json.dumps({"type": "text", "turn_id": "t1", "text": " and the rest.",
                                               "final": True}))
            await speaking.ended()
            await stuck.ended(DRAIN_S + 10)
            return ready, health, ready_503_after, refused.value.response, refused_turn, t0, idle, speaking, stuck
        ready, health, ready_503_after, refused, refused_turn, t0, idle, speaking, stuck = asyncio.run(go())
        proc.wait(DRAIN_S + 15)
        exited_after = time.monotonic() - t0

    assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down"
    assert "Retry-After" in ready.headers and health["status"] == "draining" and ready_503_after < 1.0
    assert refused.status_code == 503 and json.loads(refused.body)["error"]["code"] == "shutting_down"

    assert idle.close.code == 1001 and idle.closed_at - t0 < 2.0      # nothing in progress: closed at once
    assert idle.events[-1]["code"] == "fatal.shutting_down"

    assert refused_turn["code"] == "shutting_down" and refused_turn["turn_id"] == "t2"
    assert refused_turn["fatal"] is False and refused_turn["retry_after_ms"] >= 1000
    done = [e for e in speaking.events if e["type"] == "turn.done"]   # the turn in progress was spoken to the end
    assert len(done) == 1 and done[0]["turn_id"] == "t1" and done[0]["reason"] == "max_frames"
    assert done[0]["frames"] == 8 and len(speaking.audio) == 2 * done[0]["samples"] == 2 * 8 * 1920
    assert speaking.close.code == 1001 and speaking.closed_at - t0 < DRAIN_S   # closed once its turn was done
    assert speaking.events[-1]["code"] == "fatal.shutting_down"

    assert stuck.close.code == 1001 and DRAIN_S - 0.5 < stuck.closed_at - t0 < DRAIN_S + 3   # cut at the deadline
    assert stuck.events[-1]["code"] == "fatal.shutting_down"
    assert proc.returncode == 0 and exited_after < DRAIN_S + 8
