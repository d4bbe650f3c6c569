"""Every documented error gets its documented answer, and the server stays healthy after it.

Protocol-level tests: the tiny model (voices, tokenizer, languages) with the scheduler test double
of server_harness, which makes audio as fast or as slowly as a test needs.
"""
import asyncio
import base64
import io
import json
import socket
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from app.service import Settings
from engine.loader import load_model
from server_harness import FakeScheduler, ServerThread, next_event, read_turns, ref_wav_b64

SPEECH = "/v1/audio/speech"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def settings(tmp_path, **kw):
    base = dict(model_dir="unused", voices_dir=str(tmp_path / "voices"), idle_timeout_s=1.0,
                send_buffer_bytes=1 << 20, max_body_bytes=1 << 20, max_ref_bytes=800_000)
    return Settings(**{**base, **kw})


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    fake = FakeScheduler(model, capacity=3, frames=4000, frames_per_chunk=2, step_s=0.02)
    with ServerThread(settings(tmp_path_factory.mktemp("errors")), scheduler=fake) as srv:
        yield srv


def post(srv, body=None, path=SPEECH, **kw):
    return httpx.post(srv.url + path, json=body, timeout=30, **kw)


def assert_error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code and body["error"]["message"], body
    return body


def assert_healthy(srv):
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    r = post(srv, {"input": "Still fine.", "max_frames": 4}, headers=srv.auth_headers())
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    y, sr = sf.read(io.BytesIO(r.content))
    assert len(y) == 4 * 1920


def tiny_wav_b64(seconds, rate=8000):
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * rate), np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


# -- REST ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,code", [
    ({}, "invalid_request"),                                        # input missing
    ({"input": ""}, "invalid_request"),
    ({"input": "   "}, "invalid_request"),
    ({"input": 42}, "invalid_request"),
    ({"input": "x", "speed": 1.5}, "unsupported_speed"),
    ({"input": "x", "response_format": "aac"}, "unsupported_format"),
    ({"input": "x", "response_format": "opus", "sample_rate": 44100}, "unsupported_format"),
    ({"input": "x", "sample_rate": 12345}, "unsupported_format"),
    ({"input": "x", "stream_format": "websocket"}, "invalid_request"),
    ({"input": "x", "language": "klingon"}, "invalid_request"),
    ({"input": "x", "temperature": "hot"}, "invalid_request"),
    ({"input": "x", "temperature": -1}, "invalid_request"),
    ({"input": "x", "top_p": 0}, "invalid_request"),
    ({"input": "x", "top_k": 0}, "invalid_request"),
    ({"input": "x", "seed": -3}, "invalid_request"),
    ({"input": "x", "stream": "yes"}, "invalid_request"),
    ({"input": "x", "instructions": "whisper"}, "invalid_request"),
    ({"input": "x", "ref_audio": "not base64!"}, "invalid_request"),
    ({"input": "x", "voice": 7}, "invalid_request"),
])
def test_speech_400(server, body, code):
    assert_error(post(server, body), 400, code)


def test_speech_400_not_json(server):
    assert_error(httpx.post(server.url + SPEECH, content=b"{nope", timeout=10), 400, "invalid_json")
    assert_error(httpx.post(server.url + SPEECH, content=b"[1, 2]", timeout=10), 400, "invalid_json")


def test_speech_404_unknown_voice(server):
    assert_error(post(server, {"input": "x", "voice": "nobody"}), 404, "voice_not_found")
    assert_error(post(server, {"input": "x", "voice": "../../etc/passwd"}), 404, "voice_not_found")
    assert post(server, {"input": "x", "voice": "alloy", "max_frames": 2}).status_code == 200   # OpenAI names: default
    assert post(server, {"input": "x", "voice": {"id": "default"}, "max_frames": 2}).status_code == 200


def test_413_text_and_body(server):
    assert_error(post(server, {"input": "a" * 4097}), 413, "text_too_long")
    assert post(server, {"input": "a" * 4096, "max_frames": 2}).status_code == 200
    big = json.dumps({"input": "x", "pad": "y" * (1 << 20)}).encode()
    assert_error(httpx.post(server.url + SPEECH, content=big, timeout=10), 413, "payload_too_large")

    def chunked():      # no Content-Length: the limit holds while reading
        yield b'{"input": "x", "pad": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'
    assert_error(httpx.post(server.url + SPEECH, content=chunked(), timeout=10), 413, "payload_too_large")


def test_reference_audio_errors(server):
    long_ref = tiny_wav_b64(31)                                       # 31 s > 30 s
    assert_error(post(server, {"audio": long_ref}, "/v1/voices"), 413, "audio_too_long")
    assert_error(post(server, {"input": "x", "ref_audio": long_ref}), 413, "audio_too_long")
    garbage = base64.b64encode(b"RIFF not really a wav file" * 50).decode()
    assert_error(post(server, {"audio": garbage}, "/v1/voices"), 422, "invalid_audio")
    assert_error(post(server, {"input": "x", "ref_audio": garbage}), 422, "invalid_audio")
    assert_error(post(server, {"audio": tiny_wav_b64(0.01)}, "/v1/voices"), 422, "invalid_audio")   # too short
    assert_error(post(server, {}, "/v1/voices"), 400, "invalid_request")
    assert_error(post(server, {"audio": ref_wav_b64(), "ref_text": "  "}, "/v1/voices"), 400, "invalid_request")
    assert_error(post(server, {"audio": ref_wav_b64(), "voice_id": "../x"}, "/v1/voices"), 400, "invalid_request")
    assert post(server, {"audio": ref_wav_b64(), "voice_id": "dup"}, "/v1/voices").status_code == 200
    assert_error(post(server, {"audio": ref_wav_b64(), "voice_id": "dup"}, "/v1/voices"), 409, "voice_exists")
    assert_error(httpx.delete(server.url + "/v1/voices/nobody"), 404, "voice_not_found")
    assert_error(httpx.get(server.url + "/v1/voices/nobody"), 404, "voice_not_found")
    assert httpx.delete(server.url + "/v1/voices/dup").status_code == 200


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, "not_found")
    assert_error(httpx.get(server.url + SPEECH), 405, "method_not_allowed")


def test_503_overloaded_with_retry_after(server):
    fake = server.service.scheduler

    async def hold_and_probe():
        sessions = []
        for i in range(fake.max_batch):        # fill every slot with a long turn
            ws = await websockets.connect(server.ws_url)
            await ws.recv()
            await ws.send(json.dumps({"type": "text", "turn_id": "hold", "text": "Long turn.", "final": True}))
            await next_event(ws, "turn.started")
            sessions.append(ws)
        r = await asyncio.to_thread(post, server, {"input": "One too many."})
        ws = await websockets.connect(server.ws_url)
        await ws.recv()
        await ws.send(json.dumps({"type": "text", "turn_id": "late", "text": "No room.", "final": True}))
        turn = (await read_turns(ws, 1))["late"]
        await ws.close()
        for s in sessions:
            await s.close()
        return r, turn
    r, turn = asyncio.run(hold_and_probe())
    assert_error(r, 503, "overloaded")
    assert int(r.headers["Retry-After"]) >= 1
    error = turn["events"][0]
    assert error["type"] == "error" and error["code"] == "overloaded" and not error["fatal"]
    assert error["retry_after_ms"] >= 1000
    assert turn["done"]["reason"] == "error" and turn["done"]["frames"] == 0
    deadline = time.monotonic() + 5
    while fake.in_flight and time.monotonic() < deadline:    # closed sockets free their slots
        time.sleep(0.02)
    assert fake.in_flight == 0
    assert_healthy(server)


def test_client_gone_frees_the_slot(server):
    fake = server.service.scheduler
    with httpx.stream("POST", server.url + SPEECH, json={"input": "Long.", "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        next(r.iter_raw())
        assert fake.in_flight == 1
    deadline = time.monotonic() + 5
    while fake.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.in_flight == 0


# -- WebSocket -------------------------------------------------------------------------------------

async def expect_error(ws, message, code, raw=False):
    await (ws.send(message) if raw else ws.send(json.dumps(message)))
    event = await next_event(ws, "error", timeout=10)
    assert event["code"] == code and event["message"] and event["fatal"] is False, event
    await ws.send(json.dumps({"type": "ping"}))              # the session is still open
    assert (await next_event(ws, "pong", timeout=10)) == {"type": "pong"}
    return event


def test_websocket_errors_keep_the_session_open(server):
    async def go():
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            await expect_error(ws, "{not json", "invalid_message", raw=True)
            await expect_error(ws, b"\xc1\xc1 not msgpack", "invalid_message", raw=True)
            await expect_error(ws, "[1, 2]", "invalid_message", raw=True)
            await expect_error(ws, {"type": "dance"}, "unknown_type")
            await expect_error(ws, {"type": "session.update", "voice": "nobody"}, "voice_not_found")
            await expect_error(ws, {"type": "session.update", "format": {"encoding": "mp3"}}, "unsupported_format")
            await expect_error(ws, {"type": "session.update", "format": {"sample_rate": 12345}}, "unsupported_format")
            await expect_error(ws, {"type": "session.update", "format": {"encoding": "mulaw", "sample_rate": 11025,
                                                                         "frame_ms": 20}}, "unsupported_format")
            await expect_error(ws, {"type": "session.update", "audio_framing": "json"}, "invalid_request")
            await expect_error(ws, {"type": "session.update", "language": "klingon"}, "invalid_request")
            await expect_error(ws, {"type": "session.update", "sampling": {"top_p": 2}}, "invalid_request")
            await expect_error(ws, {"type": "session.update", "ref_audio": tiny_wav_b64(31)}, "audio_too_long")
            garbage = base64.b64encode(b"garbage" * 100).decode()
            await expect_error(ws, {"type": "session.update", "ref_audio": garbage}, "invalid_audio")
            await expect_error(ws, {"type": "text", "turn_id": 5, "text": "x"}, "invalid_request")
            await expect_error(ws, {"type": "text", "turn_id": "t", "text": None}, "invalid_request")
            await expect_error(ws, {"type": "turn.end", "turn_id": "never"}, "unknown_turn")
            await expect_error(ws, {"type": "cancel", "turn_id": "never"}, "unknown_turn")
            event = await expect_error(ws, {"type": "text", "turn_id": "big", "text": "a" * 4097}, "text_too_long")
            assert event["turn_id"] == "big"
            # a failed update changes nothing
            await ws.send(json.dumps({"type": "session.update", "max_frames": 3}))
            await next_event(ws, "session.updated")
            await ws.send(json.dumps({"type": "session.update", "max_frames": 9, "voice": "nobody"}))
            await next_event(ws, "error")
            await ws.send(json.dumps({"type": "text", "turn_id": "ok", "text": "Works.", "final": True}))
            done = (await read_turns(ws, 1))["ok"]["done"]
            await expect_error(ws, {"type": "text", "turn_id": "ok", "text": "more"}, "turn_closed")
            return done
    done = asyncio.run(go())
    assert done["reason"] == "max_frames" and done["frames"] == 3
    assert_healthy(server)


def test_idle_timeout_closes_only_idle_sessions(server):
    async def go():
        idle = await websockets.connect(server.ws_url)
        busy = await websockets.connect(server.ws_url)
        abandoned = await websockets.connect(server.ws_url)
        await idle.recv()
        await busy.recv()
        await abandoned.recv()
        await abandoned.send(json.dumps({"type": "text", "turn_id": "open", "text": "A turn never fini"}))
        t0 = time.monotonic()
        await busy.send(json.dumps({"type": "session.update", "max_frames": 200}))   # ~2 s of speaking
        await busy.send(json.dumps({"type": "text", "turn_id": "t", "text": "Talking for a while.", "final": True}))
        event = await next_event(idle, "error", timeout=10)
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(idle.recv(), 5)
        idle_after = time.monotonic() - t0
        left = await next_event(abandoned, "error", timeout=10)   # a turn left open does not keep it alive
        turn = (await read_turns(busy, 1))["t"]
        await busy.send(json.dumps({"type": "ping"}))
        pong = await next_event(busy, "pong")
        await busy.close()
        return event, closed.value, idle_after, turn, pong, left
    event, closed, idle_after, turn, pong, left = asyncio.run(go())
    assert left["code"] == "fatal.idle_timeout"
    assert event["code"] == "fatal.idle_timeout" and event["fatal"] is True
    assert closed.rcvd.code == 1000 and 0.9 < idle_after < 4
    assert turn["done"]["reason"] == "max_frames" and pong == {"type": "pong"}


def test_slow_reader_is_closed_and_others_are_not_slowed(server):
    fake = server.service.scheduler

    async def go():
        sock = socket.socket()      # a small receive buffer, so the kernel does not absorb the flood
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", server.settings.port))
        slow = await websockets.connect(server.ws_url, sock=sock, max_size=None, max_queue=4)
        await slow.recv()
        await slow.send(json.dumps({"type": "session.update", "format": {"encoding": "f32le", "sample_rate": 48000}}))
        await slow.send(json.dumps({"type": "text", "turn_id": "flood", "text": "Lots of audio.", "final": True}))
        await asyncio.sleep(0.3)
        fast = await websockets.connect(server.ws_url, max_size=None)
        await fast.recv()
        t0 = time.monotonic()
        await fast.send(json.dumps({"type": "session.update", "max_frames": 40}))
        await fast.send(json.dumps({"type": "text", "turn_id": "f", "text": "Meanwhile.", "final": True}))
        turn = (await read_turns(fast, 1))["f"]
        fast_s = time.monotonic() - t0
        deadline = time.monotonic() + 30
        while fake.in_flight and time.monotonic() < deadline:   # the slow client reads nothing until
            await asyncio.sleep(0.02)                           # the server gives up on it
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                msg = await asyncio.wait_for(slow.recv(), 10)
                if isinstance(msg, str):
                    events.append(json.loads(msg))
        await fast.close()
        return turn, fast_s, events, closed.value
    turn, fast_s, events, closed = asyncio.run(go())
    assert turn["done"]["frames"] == 40 and len(turn["audio"]) == 2 * 40 * 1920
    assert fast_s < 0.4 + 40 / 2 * 0.02 * 3            # 20 chunks, 20 ms apart in the double: not held up
    assert events[-1]["code"] == "fatal.slow_consumer" and events[-1]["fatal"] is True
    assert not any(e["type"] == "turn.done" for e in events)
    assert closed.rcvd.code == 1008
    assert fake.in_flight == 0                          # its turn was cancelled
    assert_healthy(server)


def test_websocket_message_size_cap(server):
    async def go():
        ws = await websockets.connect(server.ws_url, max_size=None)
        await ws.recv()
        with pytest.raises(ConnectionClosed) as closed:   # the server may close while the message is still going out
            await ws.send(json.dumps({"type": "text", "text": "y" * ((1 << 20) + 10)}))
            await asyncio.wait_for(ws.recv(), 10)
        return closed.value
    assert asyncio.run(go()).rcvd.code == 1009
    assert_healthy(server)


def test_api_key(model, tmp_path):
    fake = FakeScheduler(model, frames=4)
    with ServerThread(settings(tmp_path, api_key="s3cret"), scheduler=fake) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        for path in ("/ready", "/metrics", "/v1/models", "/v1/voices", "/"):
            assert_error(httpx.get(srv.url + path), 401, "unauthorized")
            assert_error(httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = post(srv, {"input": "x"})
        assert_error(r, 401, "unauthorized")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        page = httpx.get(srv.url + "/?api_key=s3cret")     # the page, then its files by cookie
        assert page.status_code == 200
        assert httpx.get(srv.url + "/app.js", cookies=page.cookies).status_code == 200

        async def ws(url, headers=None):
            async with websockets.connect(url, additional_headers=headers) as conn:
                first = json.loads(await conn.recv())
                if first["type"] == "error":    # refused: told why, then closed with 1008
                    with pytest.raises(ConnectionClosed) as closed:
                        await conn.recv()
                    return first["code"], closed.value.rcvd.code
                return first["type"]
        assert asyncio.run(ws(srv.ws_url)) == ("fatal.unauthorized", 1008)
        assert asyncio.run(ws(srv.ws_url + "?api_key=nope")) == ("fatal.unauthorized", 1008)
        assert asyncio.run(ws(srv.ws_url + "?api_key=s3cret")) == "session.created"
        assert asyncio.run(ws(srv.ws_url, {"Authorization": "Bearer s3cret"})) == "session.created"
        assert_healthy(srv)


def test_session_limit_refuses_with_503(model, tmp_path):
    with ServerThread(settings(tmp_path, max_sessions=1), scheduler=FakeScheduler(model)) as srv:
        async def go():
            async with websockets.connect(srv.ws_url) as first:
                await first.recv()
                with pytest.raises(InvalidStatus) as refused:
                    async with websockets.connect(srv.ws_url):
                        pass
                return refused.value.response
        response = asyncio.run(go())
        assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
        assert json.loads(response.body)["error"]["code"] == "overloaded"
        assert_healthy(srv)
