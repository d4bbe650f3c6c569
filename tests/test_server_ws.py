"""WebSocket sessions against a real uvicorn + the real scheduler on the tiny model (CPU)."""
import asyncio
import json
import time
import warnings

import msgpack
import numpy as np
import pytest
import websockets

from app.service import Settings
from server_harness import ServerThread, next_event, read_turns

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import audioop
    except ImportError:
        audioop = None

FRAMES = 6
WIDTH = {"pcm_s16le": 2, "f32le": 4, "mulaw": 1, "alaw": 1}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    settings = Settings(model_dir=str(tiny_model_dir), device="cpu", max_batch=32,
                        voices_dir=str(tmp_path_factory.mktemp("voices")))
    with ServerThread(settings) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


async def open_session(srv, **update):
    ws = await websockets.connect(srv.ws_url, max_size=None)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created" and created["session_id"]
    if update:
        await ws.send(json.dumps({"type": "session.update", **update}))
        updated = await next_event(ws, "session.updated")
        for key, value in update.items():
            if key not in ("sampling", "format"):
                assert updated[key] == value
    return ws


def greedy(frames=FRAMES, **fmt):
    return dict(sampling={"temperature": 0}, max_frames=frames,
                **({"format": fmt} if fmt else {}))


async def speak_alone(srv, text, **update):
    ws = await open_session(srv, **update)
    await ws.send(json.dumps({"type": "text", "turn_id": "a", "text": text, "final": True}))
    turns = await read_turns(ws, 1)
    await ws.close()
    return turns["a"]


def test_session_created_and_ping(server):
    async def go():
        ws = await websockets.connect(server.ws_url)
        created = json.loads(await ws.recv())
        assert created["sample_rate"] == 24000 and created["encoding"] == "pcm_s16le"
        assert created["limits"]["max_text_chars"] == 4096
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await ws.recv()) == {"type": "pong"}
        await ws.close()
    run(go())


def test_no_per_message_compression_even_when_the_client_offers_it(server):
    """websockets clients offer permessage-deflate by default; the server declines (audio does not
    compress, and deflating it would load the event loop)."""
    async def go():
        ws = await websockets.connect(server.ws_url, compression="deflate")
        assert json.loads(await ws.recv())["type"] == "session.created"
        assert "permessage-deflate" not in (ws.response.headers.get("Sec-WebSocket-Extensions") or "")
        await ws.close()
    run(go())


def test_conversation_turns_in_order_text_in_pieces(server):
    text = "Hello world, how are you today?"
    whole = run(speak_alone(server, text, **greedy()))

    async def go():
        ws = await open_session(server, **greedy())
        # turn 1 arrives in pieces, like LLM tokens; turn 2 and 3 are queued behind it
        for piece in ["Hello ", "world, how", " are you", " today?"]:
            await ws.send(json.dumps({"type": "text", "turn_id": "t1", "text": piece}))
            await asyncio.sleep(0.05)
        await ws.send(json.dumps({"type": "text", "turn_id": "t2", "text": "Second turn.", "final": True}))
        await ws.send(json.dumps({"type": "turn.end", "turn_id": "t1"}))
        await ws.send(json.dumps({"type": "text", "turn_id": "t3", "text": "Third"}))
        await ws.send(json.dumps({"type": "text", "turn_id": "t3", "text": " one.", "final": True}))
        order = []
        turns = {}
        while len([o for o in order if o[0] == "turn.done"]) < 3:
            msg = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(msg, bytes):
                turns[order[-1][1]] += msg
                continue
            event = json.loads(msg)
            order.append((event["type"], event.get("turn_id"), event))
            if event["type"] == "turn.started":
                turns[event["turn_id"]] = b""
        await ws.close()
        return order, turns
    order, audio = run(go())
    assert [(k, t) for k, t, _ in order] == [("turn.started", "t1"), ("turn.done", "t1"), ("turn.started", "t2"),
                                              ("turn.done", "t2"), ("turn.started", "t3"), ("turn.done", "t3")]
    for kind, tid, event in order:
        if kind == "turn.done":
            assert event["reason"] == "max_frames" and event["frames"] == FRAMES
            assert event["samples"] == FRAMES * 1920 and event["audio_ms"] == FRAMES * 80
            assert len(audio[tid]) == 2 * event["samples"]
            assert event["ttfa_ms"] > 0 and event["rtf"] > 0
        else:
            assert event["queue_ms"] >= 0
    # text in pieces speaks like the whole text: the same codes, so the same audio up to the float noise
    # of other vocoder windows (a turn waiting for text flushes its audio), at most one 16-bit step
    pieces, alone = (np.frombuffer(a, "<i2").astype(np.int32) for a in (audio["t1"], whole["audio"]))
    assert pieces.shape == alone.shape and np.abs(pieces - alone).max() <= 1
    assert audio["t2"] != audio["t1"]


def test_cancel_in_the_middle_of_a_turn(server):
    async def go():
        ws = await open_session(server, **greedy(frames=400))
        await ws.send(json.dumps({"type": "text", "turn_id": "long", "text": "A long turn to interrupt.",
                                  "final": True}))
        await ws.send(json.dumps({"type": "session.update", "max_frames": FRAMES}))   # for the turns after it
        await ws.send(json.dumps({"type": "text", "turn_id": "queued", "text": "Spoken after.", "final": True}))
        await next_event(ws, "turn.started")
        got = 0
        while got < 2:
            if isinstance(await ws.recv(), bytes):
                got += 1
        t0 = time.monotonic()
        await ws.send(json.dumps({"type": "cancel", "turn_id": "long"}))
        after = 0
        while True:
            msg = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(msg, bytes):
                after += len(msg)
                continue
            done = json.loads(msg)
            if done["type"] == "turn.done":
                break
        elapsed = time.monotonic() - t0
        # the queued turn goes on
        queued = await read_turns(ws, 1)
        # cancel everything: a pending turn and the running one
        await ws.send(json.dumps({"type": "session.update", "max_frames": 400}))
        await ws.send(json.dumps({"type": "text", "turn_id": "x", "text": "One more long turn.", "final": True}))
        await ws.send(json.dumps({"type": "text", "turn_id": "y", "text": "And another.", "final": True}))
        await next_event(ws, "turn.started")
        await ws.send(json.dumps({"type": "cancel"}))
        dones = {}
        while len(dones) < 2:
            msg = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(msg, str) and json.loads(msg)["type"] == "turn.done":
                event = json.loads(msg)
                dones[event["turn_id"]] = event
        # late text for a cancelled turn is dropped quietly; the session still works
        await ws.send(json.dumps({"type": "text", "turn_id": "y", "text": " late tokens"}))
        await ws.send(json.dumps({"type": "ping"}))
        pong = json.loads(await asyncio.wait_for(ws.recv(), 10))
        await ws.close()
        return done, elapsed, after, queued, dones, pong
    done, elapsed, after, queued, dones, pong = run(go())
    assert done["turn_id"] == "long" and done["reason"] == "cancelled"
    assert done["frames"] < 400 and elapsed < 3.0
    assert done["samples"] < 400 * 1920
    assert queued["queued"]["done"]["reason"] == "max_frames"
    assert len(queued["queued"]["audio"]) == 2 * FRAMES * 1920
    assert {t: e["reason"] for t, e in dones.items()} == {"x": "cancelled", "y": "cancelled"}
    assert dones["y"]["frames"] == 0 and dones["y"]["samples"] == 0
    assert pong == {"type": "pong"}


ENCODINGS = ["pcm_s16le", "f32le", "mulaw", "alaw"]


def test_every_format(server):
    async def go():
        ws = await open_session(server, **greedy(frames=4))
        results = {}
        for encoding in ENCODINGS:
            for rate in (24000, 16000, 8000, 48000):
                await ws.send(json.dumps({"type": "session.update", "format": {"encoding": encoding,
                                                                                "sample_rate": rate}}))
                tid = f"{encoding}-{rate}"
                await ws.send(json.dumps({"type": "text", "turn_id": tid, "text": "Format test.", "final": True}))
                results[(encoding, rate)] = (await read_turns(ws, 1))[tid]
        await ws.send(json.dumps({"type": "session.update", "format": {"encoding": "mulaw", "sample_rate": 8000,
                                                                        "frame_ms": 20}}))
        await ws.send(json.dumps({"type": "text", "turn_id": "tel", "text": "Format test.", "final": True}))
        tel = (await read_turns(ws, 1))["tel"]
        await ws.close()
        return results, tel
    results, tel = run(go())
    for (encoding, rate), turn in results.items():
        done = turn["done"]
        assert done["sample_rate"] == rate
        assert done["samples"] == 4 * 1920 * rate // 24000, (encoding, rate)
        assert len(turn["audio"]) == WIDTH[encoding] * done["samples"], (encoding, rate)
    s16 = np.frombuffer(results[("pcm_s16le", 24000)]["audio"], "<i2") / 32767
    f32 = np.frombuffer(results[("f32le", 24000)]["audio"], "<f4")
    assert np.abs(s16 - f32).max() < 1e-4 and np.abs(f32).max() > 0.01
    if audioop is not None:
        for encoding, decode in (("mulaw", audioop.ulaw2lin), ("alaw", audioop.alaw2lin)):
            ref = np.frombuffer(results[("pcm_s16le", 8000)]["audio"], "<i2").astype(np.float64)
            got = np.frombuffer(decode(results[(encoding, 8000)]["audio"], 2), "<i2").astype(np.float64)
            assert np.abs(got - ref).max() <= max(64, 0.04 * np.abs(ref).max())
    assert tel["frames"] and all(n == 160 for n in tel["frames"])
    assert len(tel["frames"]) == 4 * 80 // 20
    assert tel["audio"] == results[("mulaw", 8000)]["audio"]


def test_msgpack_control_and_audio_framing(server):
    async def go():
        ws = await websockets.connect(server.ws_url + "?control=msgpack", max_size=None)
        created = msgpack.unpackb(await ws.recv())
        assert created["type"] == "session.created"
        await ws.send(msgpack.packb({"type": "session.update", "audio_framing": "msgpack", "max_frames": 5,
                                     "sampling": {"temperature": 0}, "format": {"encoding": "f32le", "sample_rate": 16000}}))
        updated = msgpack.unpackb(await ws.recv())
        await ws.send(msgpack.packb({"type": "text", "turn_id": "m1", "text": "Msgpack turn.", "final": True}))
        frames, events = [], []
        while not events or events[-1]["type"] != "turn.done":
            msg = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30))
            (frames if msg["type"] == "audio" else events).append(msg)
        await ws.close()
        return updated, frames, events
    updated, frames, events = run(go())
    assert updated["type"] == "session.updated" and updated["audio_framing"] == "msgpack"
    assert [e["type"] for e in events] == ["turn.started", "turn.done"]
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    assert all(f["turn_id"] == "m1" for f in frames)
    offset = 0
    for f in frames:
        assert f["offset"] == offset
        offset += len(f["data"]) // 4
    assert offset == events[-1]["samples"] == 5 * 1280


def test_32_concurrent_sessions_each_get_their_own_audio(server):
    """Sample counts match turn.done, and each session's audio is the same turn spoken alone (greedy,
    and seeded sampling), up to the float noise of a batched vocoder (the codes are the same)."""
    texts = [f"{word} is what this session says." for word in
             ("Apples", "Bananas", "Cherries", "Dates", "Elderberries", "Figs", "Grapes", "Hazelnuts")]
    frames = 5

    def update(i):
        sampling = {"temperature": 0} if i % 4 else {"temperature": 0.9, "seed": 1000 + i % 8}
        return dict(sampling=sampling, max_frames=frames, format={"encoding": "f32le", "sample_rate": 24000})

    async def session(i):
        ws = await open_session(server, **update(i))
        await ws.send(json.dumps({"type": "text", "turn_id": f"s{i}", "text": texts[i % 8], "final": True}))
        turn = (await read_turns(ws, 1, timeout=120))[f"s{i}"]
        await ws.close()
        return turn

    async def together():
        return await asyncio.gather(*(session(i) for i in range(32)))
    results = run(together())
    for turn in results:
        assert turn["done"]["reason"] == "max_frames" and turn["done"]["frames"] == frames
        assert len(turn["audio"]) == 4 * turn["done"]["samples"] == 4 * frames * 1920
    pcm = [np.frombuffer(r["audio"], "<f4") for r in results]
    for i in (1, 2, 3, 0, 4, 8):   # greedy texts, and seeded sampled ones (i % 4 == 0)
        ws_alone = run(speak_alone(server, texts[i % 8], **update(i)))
        alone = np.frombuffer(ws_alone["audio"], "<f4")
        assert alone.shape == pcm[i].shape
        assert np.abs(alone - pcm[i]).max() < 1e-4, f"session {i} differs from the same turn spoken alone"
    # the same text and settings give the same audio in other sessions; different texts differ a lot
    assert np.abs(pcm[1] - pcm[9]).max() < 1e-4 and np.abs(pcm[1] - pcm[17]).max() < 1e-4
    for i in range(1, 8):
        for j in range(i + 1, 8):
            assert np.abs(pcm[i] - pcm[j]).max() > 1e-2


def test_closed_socket_frees_its_batch_slot(server):
    scheduler = server.service.scheduler

    async def go():
        ws = await open_session(server, **greedy(frames=400))
        await ws.send(json.dumps({"type": "text", "turn_id": "gone", "text": "Hanging up soon.", "final": True}))
        await next_event(ws, "turn.started")
        assert scheduler.stats().active == 1
        await ws.close()
        t0 = time.monotonic()
        while scheduler.stats().active and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.005)
        return time.monotonic() - t0, scheduler.stats()
    freed_after, stats = run(go())
    assert stats.active == 0 and stats.queued == 0
    assert freed_after < 1.0       # a few engine steps of the tiny model on a loaded CPU
