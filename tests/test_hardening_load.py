"""Load, against a real uvicorn + the real scheduler on the tiny model (CPU):
- admission control: beyond MAX_SESSIONS a handshake gets 503 + Retry-After, beyond the batch slots
  and MAX_QUEUE a turn gets `overloaded` (with retry_after_ms) and a REST request 503, all at once;
  the sessions already admitted keep real-time pace (no playback underrun) through a flood of refused
  requests, and the queued turn is spoken when a slot frees;
- isolation: 64 concurrent sessions with different voices (x-vector, ICL), seeds, texts and framings
  each receive only their own audio: exactly what the same turn gives alone.
"""
import asyncio
import json
import time

import httpx
import msgpack
import numpy as np
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from app.service import Settings
from server_harness import ServerThread, next_event, ref_wav_b64
from tts_server import tts_server

RATE = 24000
# 24 s of audio per admitted turn, 4-12 s to make on the CPU (2 rows): well past the flood, which ends
# about 1.5 s after they start, on a fast machine too (at 80 frames one finished within it, and a slot
# freed for a flood request)
FLOOD_FRAMES = 300
FLOOD_S = 1.0
# ~50 refused requests a second. This client's flood shares the 2 cores with the server's engine:
# at twice that, the client's own work cut a slow CI machine's engine below real time (6 underruns).
FLOOD_PAUSE_S = 0.05


class Playback:
    """A listener playing chunks as they arrive: counts chunks that come after the audio before them
    has finished playing (`slack_s` of network/scheduling jitter forgiven). Like a phone's or a
    browser's player it starts `prebuffer_s` after the first chunk (here the test's own flood shares
    the 2 CPU cores with the server: a turn's first windows, made while it starts, came up to ~80 ms
    late on a slow CI machine)."""

    def __init__(self, slack_s=0.05, prebuffer_s=0.15):
        self.end = None
        self.samples = 0
        self.underruns = 0
        self.slack_s = slack_s
        self.prebuffer_s = prebuffer_s

    def add(self, t, n):
        if self.end is None:
            self.end = t + self.prebuffer_s
        elif t > self.end + self.slack_s:
            self.underruns += 1
            self.end = t
        self.end += n / RATE
        self.samples += n


async def open_session(url, update=None):
    ws = await websockets.connect(url, max_size=None)
    assert json.loads(await ws.recv())["type"] == "session.created"
    if update:
        await ws.send(json.dumps({"type": "session.update", **update}))
        await next_event(ws, "session.updated")
    return ws


async def turn(ws, tid, text):
    """Speak one turn on an open f32le session: (turn.done or error events, Playback, pcm)."""
    await ws.send(json.dumps({"type": "text", "turn_id": tid, "text": text, "final": True}))
    play, pcm, events = Playback(), [], []
    while True:
        msg = await asyncio.wait_for(ws.recv(), 60)
        if isinstance(msg, bytes):
            play.add(time.monotonic(), len(msg) // 4)
            pcm.append(np.frombuffer(msg, "<f4"))
            continue
        events.append(json.loads(msg))
        if events[-1]["type"] == "turn.done":
            return events, play, np.concatenate(pcm) if pcm else np.zeros(0, np.float32)


# -- admission control ---------------------------------------------------------------------------------

async def wait_for_health(client, key, at_least):
    while (await client.get("/health")).json().get(key, 0) < at_least:
        await asyncio.sleep(0.005)


def test_admission_control_refuses_at_once_and_admitted_work_keeps_real_time(tiny_model_dir, tmp_path):
    # The server is a process of its own, as in production: a flood made in this process would otherwise
    # take the server's interpreter lock too and slow its engine thread for reasons no deployment has.
    with tts_server(tiny_model_dir, "--max-batch", "2", "--max-queue", "1", "--max-sessions", "4",
                    "--voices-dir", str(tmp_path)) as url:
        ws_url = url.replace("http://", "ws://") + "/v1/audio/speech/ws"
        update = {"sampling": {"temperature": 0}, "max_frames": FLOOD_FRAMES, "format": {"encoding": "f32le"}}

        async def go():
            a, b, c, d = [await open_session(ws_url, update) for _ in range(4)]
            t0 = time.monotonic()
            with pytest.raises(InvalidStatus) as full:           # MAX_SESSIONS are open
                await websockets.connect(ws_url)
            handshake_s = time.monotonic() - t0
            speaking = [asyncio.ensure_future(turn(ws, "long", "Admitted, and speaking at real-time pace."))
                        for ws in (a, b)]
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                await wait_for_health(client, "batch_active", 2)          # both hold a slot
                queued = asyncio.ensure_future(turn(c, "queued", "I wait for a slot."))
                await wait_for_health(client, "queue_depth", 1)
            t0 = time.monotonic()
            refused, _, _ = await turn(d, "refused", "There is no room for me.")
            refused_s = time.monotonic() - t0

            flood = {"rest": [], "ws": []}                       # refused work does not slow admitted work
            until = time.monotonic() + FLOOD_S                   # (well before a slot frees)

            async def flood_rest(client):
                while time.monotonic() < until:
                    t1 = time.monotonic()
                    r = await client.post("/v1/audio/speech", json={"input": "Let me in.", "max_frames": 2})
                    code = r.json()["error"]["code"] if r.status_code != 200 else "admitted: a slot freed"
                    flood["rest"].append((r.status_code, r.headers.get("Retry-After"), code, time.monotonic() - t1))
                    await asyncio.sleep(FLOOD_PAUSE_S)

            async def flood_ws():
                while time.monotonic() < until:
                    t1 = time.monotonic()
                    try:
                        await websockets.connect(ws_url)
                        flood["ws"].append((101, time.monotonic() - t1))
                    except InvalidStatus as e:
                        flood["ws"].append((e.response.status_code, time.monotonic() - t1))
                    await asyncio.sleep(FLOOD_PAUSE_S)
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                await asyncio.gather(flood_rest(client), flood_rest(client), flood_ws())
            assert not any(t.done() for t in speaking), "the flood outlasted the admitted turns: make them longer"
            admitted = [await t for t in speaking]
            late = await queued
            for ws in (a, b, c, d):
                await ws.close()
            return full.value.response, handshake_s, refused, refused_s, flood, admitted, late
        full, handshake_s, refused, refused_s, flood, admitted, late = asyncio.run(go())

    assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1 and handshake_s < 0.5
    assert json.loads(full.body)["error"]["code"] == "overloaded"
    error, done = refused
    assert error["type"] == "error" and error["code"] == "overloaded" and error["retry_after_ms"] >= 1000
    assert done["type"] == "turn.done" and done["reason"] == "error" and done["frames"] == 0
    assert refused_s < 0.5
    assert len(flood["rest"]) >= 10 and len(flood["ws"]) >= 5
    assert all(s == 503 and ra and code == "overloaded" for s, ra, code, _ in flood["rest"]), flood["rest"]
    assert all(s == 503 for s, _ in flood["ws"]), flood["ws"]
    assert max(t for *_, t in flood["rest"]) < 0.5 and max(t for _, t in flood["ws"]) < 0.5
    for events, play, pcm in admitted:
        done = events[-1]
        assert done["reason"] == "max_frames" and done["frames"] == FLOOD_FRAMES and play.samples == done["samples"]
        assert play.underruns == 0, "an admitted session fell behind real time"
    events, play, pcm = late                     # the queued turn got a slot when one freed
    assert events[-1]["reason"] == "max_frames" and events[-1]["queue_ms"] > 100 and play.underruns == 0


# -- isolation -------------------------------------------------------------------------------------------

N_SESSIONS = 64
FRAMES = 5
TEXTS = [f"{w} is what session number {n} says." for n, w in enumerate(
    ["Apples", "Bananas", "Cherries", "Dates", "Elderberries", "Figs", "Grapes", "Hazelnuts"])]


@pytest.fixture(scope="module")
def big_server(tiny_model_dir, tmp_path_factory):
    settings = Settings(model_dir=str(tiny_model_dir), device="cpu", max_batch=N_SESSIONS, max_queue=N_SESSIONS,
                        voices_dir=str(tmp_path_factory.mktemp("voices")))
    with ServerThread(settings) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for voice_id, body in (("ref", {"audio": ref_wav_b64()}), ("noise", {"audio": ref_wav_b64(noise=True)}),
                                   ("short", {"audio": ref_wav_b64(seconds=1.5)}),
                                   ("icl", {"audio": ref_wav_b64(), "ref_text": "Hello, this is the default voice "
                                                                                "of the speech server."})):
                assert http.post("/v1/voices", json={**body, "voice_id": voice_id}).status_code == 200
        yield srv


def config(i):
    voice = ["default", "ref", "noise", "short", "icl"][i % 5]
    sampling = {"temperature": 0} if i % 3 == 0 else {"temperature": 0.9, "top_k": 50, "seed": 1000 + i}
    return dict(voice=voice, sampling=sampling, max_frames=FRAMES, language=["auto", "english"][i % 2],
                audio_framing="msgpack" if i % 2 else "raw", format={"encoding": "f32le"})


async def spoken(srv, i):
    """Session i's one turn: pcm and turn.done; with msgpack framing every frame must carry its turn."""
    ws = await open_session(srv.ws_url, config(i))
    tid = f"s{i}"
    await ws.send(json.dumps({"type": "text", "turn_id": tid, "text": TEXTS[i % 8], "final": True}))
    pcm, done = [], None
    while done is None:
        msg = await asyncio.wait_for(ws.recv(), 120)
        if isinstance(msg, bytes):
            if i % 2:
                frame = msgpack.unpackb(msg)
                assert frame["type"] == "audio" and frame["turn_id"] == tid, frame["turn_id"]
                assert frame["offset"] == sum(len(p) for p in pcm)
                msg = frame["data"]
            pcm.append(np.frombuffer(msg, "<f4"))
        else:
            event = json.loads(msg)
            assert event.get("turn_id", tid) == tid, event
            assert event["type"] != "error", event
            if event["type"] == "turn.done":
                done = event
    await ws.close()
    return np.concatenate(pcm), done


def test_64_concurrent_sessions_receive_only_their_own_audio(big_server):
    sch = big_server.service.scheduler
    most = []

    async def together():
        sessions = asyncio.ensure_future(asyncio.gather(*(spoken(big_server, i) for i in range(N_SESSIONS))))
        while not sessions.done():
            most.append(sch.stats().active)
            await asyncio.sleep(0.01)
        return await sessions
    results = asyncio.run(together())
    assert max(most) >= N_SESSIONS // 2          # they really were in one batch together
    for i, (pcm, done) in enumerate(results):
        assert done["reason"] in ("max_frames", "eos") and len(pcm) == done["samples"] > 0
        alone, alone_done = asyncio.run(spoken(big_server, i))
        assert alone.shape == pcm.shape and done["frames"] == alone_done["frames"], i
        assert np.abs(alone - pcm).max() < 1e-4, f"session {i} got audio that is not its own"
    for i in range(N_SESSIONS):                  # other texts and seeds sound different: a swap would show
        for j in range(i + 1, N_SESSIONS):          # (voices of the tiny random model may sound alike, and an ICL
            ci, cj = config(i), config(j)           # turn's first frames still speak the reference's text)
            if ci["sampling"] == cj["sampling"] and (i % 8 == j % 8 or ci["voice"] == cj["voice"] == "icl"):
                continue
            a, b = results[i][0], results[j][0]
            n = min(len(a), len(b))
            assert np.abs(a[:n] - b[:n]).max() > 1e-3, (i, j)
