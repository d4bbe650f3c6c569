"""Hostile input: every field of docs/PROTOCOL.md fuzzed (hypothesis), a corpus of broken audio
uploads, and size caps that hold before anything is parsed. Each gets its documented 4xx or `error`
event; nothing gets a 5xx, a `fatal.internal` or a crash, and a session speaking meanwhile is not
disturbed.

Protocol tests: the tiny model (voices, tokenizer, languages, the real speaker encoder for uploads)
with the scheduler test double of server_harness (sine audio, `FRAMES` frames per turn).
"""
import asyncio
import base64
import io
import json
import math
import time
import urllib.parse

import httpx
import msgpack
import numpy as np
import pytest
import soundfile as sf
import websockets
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from websockets.exceptions import ConnectionClosed

from app.service import Settings
from engine.loader import load_model
from server_harness import FakeScheduler, ServerThread

SPEECH = "/v1/audio/speech"
FRAMES = 3
MAX_BODY = 1 << 20
REST_CODES = {400: {"invalid_request", "invalid_json", "unsupported_format", "unsupported_speed"},
              404: {"voice_not_found"}, 409: {"voice_exists"},
              413: {"payload_too_large", "text_too_long", "audio_too_long", "audio_too_large"},
              422: {"invalid_audio"}}
WS_CODES = {"invalid_message", "unknown_type", "unknown_turn", "turn_closed", "invalid_request", "voice_not_found",
            "unsupported_format", "text_too_long", "audio_too_long", "audio_too_large", "invalid_audio"}
FUZZ = hsettings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    fake = FakeScheduler(model, capacity=64, frames=FRAMES, frames_per_chunk=1, step_s=0.002)
    settings = Settings(model_dir="unused", voices_dir=str(tmp_path_factory.mktemp("voices")), idle_timeout_s=30,
                        max_body_bytes=MAX_BODY, max_ref_bytes=600_000, max_ref_seconds=30)
    with ServerThread(settings, scheduler=fake) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def check_rest(r: httpx.Response) -> None:
    """A documented answer: audio, or a 4xx with its documented code; never a 5xx."""
    if r.status_code == 200:
        assert r.headers["content-type"].startswith(("audio/", "text/event-stream", "application/json")), r.headers
        return
    assert r.status_code in REST_CODES, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] in REST_CODES[r.status_code] and error["message"], error


# -- values ----------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
# msgpack adds bytes, unsigned 64-bit and extension types
msgpack_values = st.recursive(scalars.filter(lambda v: not isinstance(v, int) or -2**63 <= v < 2**64)
                              | st.binary(max_size=12) | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=6)


def near(valid, values=json_values):
    """A field's value: one of its valid values most of the time, anything at all otherwise."""
    return st.sampled_from(valid) | values


SAMPLE_RATES = [8000, 16000, 24000, 48000, 44100, 12345, 0, -1, 24000.0, True]
SAMPLING = {"temperature": near([0, 0.0, 0.7, 1.5, 10, -1, 11]), "top_k": near([1, 50, 3072, 0, 3073]),
            "top_p": near([0.5, 1, 1.0, 0, 1.01]), "repetition_penalty": near([1.05, 0, 10.5]),
            "seed": near([0, 7, 2**63 - 1, 2**63, -1]), "min_new_tokens": near([0, 2, -1])}
SPEECH_FIELDS = {
    "input": near(["Hello.", "", "  ", "a" * 4096, "a" * 4097, "\u0000\ud7ff\U0001f600", "<|im_end|>"]),
    "text": near(["Alias text."]),
    "model": near(["tts-1", "qwen3-tts"]),
    "voice": near(["default", "alloy", "nobody", "../../etc/passwd", "", {"id": "default"}, {"id": 5}]),
    "ref_text": near(["Hello there.", "", " "]),
    "x_vector_only": near([True, False, "yes"]),
    "language": near(["auto", "english", "en", "zh", "klingon", "", "EN"]),
    "response_format": near(["wav", "pcm", "flac", "mp3", "opus", "pcm_s16le", "mulaw", "aac", "WAV"]),
    "sample_rate": near(SAMPLE_RATES),
    "stream": near([True, False, 1, "true"]),
    "stream_format": near(["audio", "sse", "websocket"]),
    "speed": near([1, 1.0, 1.5, 0]),
    "max_frames": near([1, 2, 0, -1, 2**20 + 1]),
    "instructions": near(["whisper", ""]),
    **SAMPLING,
}


def bodies(fields):
    return st.fixed_dictionaries({}, optional=fields)


# -- REST ------------------------------------------------------------------------------------------

@FUZZ
@given(body=bodies(SPEECH_FIELDS))
def test_speech_fields_fuzzed(http, body):
    body.setdefault("max_frames", 2)
    r = http.post(SPEECH, content=json.dumps(body))
    check_rest(r)


@FUZZ
@given(body=bodies({"audio": near(["", "bm90IGF1ZGlv", "!!"]), "ref_text": SPEECH_FIELDS["ref_text"],
                    "name": near(["A name", "x" * 201]), "x_vector_only": SPEECH_FIELDS["x_vector_only"],
                    "voice_id": near(["ok_id", "../x", "a" * 65, "-x", ".hidden", "con", "a/b", "a\u0000b"])}))
def test_voice_fields_fuzzed(http, body):
    check_rest(http.post("/v1/voices", content=json.dumps(body)))


@FUZZ
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode)
       | st.integers(1, 60_000).map(lambda n: b"[" * n) | st.integers(1, 60_000).map(lambda n: b'{"a":' * n))
def test_speech_body_not_json(http, raw):
    check_rest(http.post(SPEECH, content=raw))


@FUZZ
@given(voice_id=st.text(min_size=1, max_size=20) | st.sampled_from(["..", "../voices", "%2e%2e", "..%2Fx", "~root"]))
def test_voice_routes_fuzzed_ids(http, voice_id):
    path = "/v1/voices/" + urllib.parse.quote(voice_id, safe="")
    for r in (http.get(path), http.delete(path)):
        assert r.status_code in (404, 405), (voice_id, r.status_code, r.text)


# -- WebSocket -------------------------------------------------------------------------------------

def ws_messages(values):
    kinds = st.sampled_from(["session.update", "text", "turn.end", "cancel", "ping"]) | values
    turn_ids = near(["t1", "t2", "", "x" * 129], values)
    fmt = st.fixed_dictionaries({}, optional={"encoding": near(["pcm_s16le", "f32le", "mulaw", "alaw", "mp3"], values),
                                              "sample_rate": near(SAMPLE_RATES, values),
                                              "frame_ms": near([20, 5, 1000, 4, 1001, None, 20.5], values)})
    sampling = st.fixed_dictionaries({}, optional={k: near([0, 0.7, 7, -1, 2**63], values) for k in SAMPLING})
    fields = {"turn_id": turn_ids, "text": near(["Hello", " there.", "", "a" * 4097], values),
              "final": near([True, False], values), "voice": near(["default", "nobody", "../x", {"id": "default"}], values),
              "language": near(["auto", "en", "klingon"], values), "sampling": sampling | values,
              "format": fmt | values, "audio_framing": near(["raw", "msgpack", "json"], values),
              "max_frames": near([1, 2, None, 0, -5], values), "ref_text": near(["Hi.", ""], values),
              "x_vector_only": near([True, False], values), "ref_audio": near(["", "%%", "bm90IGF1ZGlv"], values)}
    return st.builds(lambda kind, rest: {"type": kind, **rest}, kinds, st.fixed_dictionaries({}, optional=fields))


async def exchange(srv, frames: list, binary: bool) -> list:
    """Send `frames`, then a ping; every event until the pong (the session must still be open)."""
    async with websockets.connect(srv.ws_url, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for frame in frames:
            await ws.send(frame)
        ping = {"type": "ping"}
        await ws.send(msgpack.packb(ping) if binary else json.dumps(ping))
        events = []
        deadline = time.monotonic() + 20
        while True:
            msg = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
            if isinstance(msg, bytes):
                try:
                    event = msgpack.unpackb(msg)
                except Exception:
                    continue            # raw audio
                if not isinstance(event, dict) or event.get("type") == "audio":
                    continue
            else:
                event = json.loads(msg)
            events.append(event)
            if event["type"] == "pong":
                return events


def check_ws(events: list) -> None:
    for e in events:
        assert e["type"] in ("session.updated", "turn.started", "turn.done", "error", "pong"), e
        if e["type"] == "error":
            assert e["code"] in WS_CODES and e["fatal"] is False and e["message"], e


@FUZZ
@given(messages=st.lists(ws_messages(json_values), min_size=1, max_size=5))
def test_websocket_json_fields_fuzzed(server, messages):
    frames = [json.dumps(m) for m in messages]
    check_ws(asyncio.run(exchange(server, frames, binary=False)))


@FUZZ
@given(messages=st.lists(ws_messages(msgpack_values), min_size=1, max_size=5))
def test_websocket_msgpack_fields_fuzzed(server, messages):
    frames = [msgpack.packb(m, use_bin_type=True) for m in messages]
    check_ws(asyncio.run(exchange(server, frames, binary=True)))


@FUZZ
@given(frame=st.binary(max_size=64) | st.text(max_size=64) | st.integers(1, 60_000).map(lambda n: "[" * n)
       | st.integers(1, 60_000).map(lambda n: b"\x91" * n))
def test_websocket_frames_not_json_or_msgpack(server, frame):
    events = asyncio.run(exchange(server, [frame], binary=isinstance(frame, bytes)))
    check_ws(events)


# -- every field x every type, deterministically ---------------------------------------------------

HOSTILE = [None, True, False, 0, -1, 2**64 - 1, 1.5, math.nan, math.inf, -math.inf, "", "x", "\u0000", [], [1], {},
           {"id": 1}]
MSGPACK_ONLY = [b"", b"\xff\xfe", msgpack.ExtType(1, b"x"), -2**63]
WS_FIELDS = {
    "session.update": ["voice", "language", "ref_audio", "ref_text", "x_vector_only", "sampling", "format",
                       "audio_framing", "max_frames", *(f"sampling.{k}" for k in SAMPLING),
                       "format.encoding", "format.sample_rate", "format.frame_ms"],
    "text": ["turn_id", "text", "final"],
    "turn.end": ["turn_id"],
    "cancel": ["turn_id"],
    "ping": [],
}


def with_field(message: dict, field: str, value) -> dict:
    outer, _, inner = field.partition(".")
    return {**message, outer: {inner: value} if inner else value}


def test_every_rest_field_with_every_type(http):
    for field in SPEECH_FIELDS:
        for value in HOSTILE:
            check_rest(http.post(SPEECH, content=json.dumps({"input": "Hi.", "max_frames": 2, field: value})))
    for field in ("audio", "ref_text", "name", "x_vector_only", "voice_id"):
        for value in HOSTILE:
            check_rest(http.post("/v1/voices", content=json.dumps({"audio": "bm90IGF1ZGlv", field: value})))


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_every_websocket_field_with_every_type(server, binary):
    values = HOSTILE + (MSGPACK_ONLY if binary else [])
    frames = [msgpack.packb(v, use_bin_type=True) if binary else json.dumps(v) for v in values]   # not objects
    for value in values:                                                                             # the type
        frames.append(msgpack.packb({"type": value}, use_bin_type=True) if binary else json.dumps({"type": value}))
    for kind, fields in WS_FIELDS.items():
        base = {"type": kind, **({"turn_id": "t", "text": "Hi."} if kind == "text" else {})}
        for field in fields:
            for value in values:
                message = with_field(base, field, value)
                frames.append(msgpack.packb(message, use_bin_type=True) if binary else json.dumps(message))
    check_ws(asyncio.run(exchange(server, frames, binary)))


# -- broken audio uploads --------------------------------------------------------------------------

def audio_file(samples, rate, subtype="PCM_16", fmt="WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def corpus() -> dict:
    """name -> (file bytes, REST status, code); a status of 200 means the upload is a usable voice."""
    rng = np.random.default_rng(0)
    speech_like = audio_file((0.2 * rng.standard_normal(3 * 16000)).astype(np.float32), 16000)
    floats = (0.2 * rng.standard_normal(16000)).astype(np.float32)
    nan, inf = floats.copy(), floats.copy()
    nan[100], inf[200] = np.nan, np.inf
    return {
        "empty": (b"", 400, "invalid_request"),
        "truncated_header": (speech_like[:30], 422, "invalid_audio"),
        "truncated_data": (speech_like[: len(speech_like) // 3], 200, None),   # the audio it holds is used
        "wrong_magic": (b"XXXX" + speech_like[4:], 422, "invalid_audio"),
        "wrong_format_tag": (speech_like[:8] + b"WAVX" + speech_like[12:], 422, "invalid_audio"),
        "zero_samples": (audio_file(np.zeros(0, np.float32), 16000), 422, "invalid_audio"),
        "too_short": (audio_file(np.zeros(80, np.float32), 8000), 422, "invalid_audio"),
        "nan_floats": (audio_file(nan, 16000, "FLOAT"), 422, "invalid_audio"),
        "inf_floats": (audio_file(inf, 16000, "FLOAT"), 422, "invalid_audio"),
        "huge_floats": (audio_file(floats * 1e30, 16000, "FLOAT"), 422, "invalid_audio"),
        "stereo_96k": (audio_file((0.2 * rng.standard_normal((96000, 2))).astype(np.float32), 96000), 200, None),
        "ten_minutes": (audio_file(np.zeros(600 * 8000, np.float32), 8000, fmt="FLAC"), 413, "audio_too_long"),
        "over_max_ref_bytes": (audio_file(np.zeros(320_000, np.float32), 16000), 413, "audio_too_large"),
        "png": (b"\x89PNG\r\n\x1a\n" + rng.bytes(2000), 422, "invalid_audio"),
        "text": (b"This is not audio at all, just a sentence." * 20, 422, "invalid_audio"),
        "html": (b"<!doctype html><html><body>audio?</body></html>", 422, "invalid_audio"),
    }


def expected_sine(frames: int) -> bytes:
    """The test double's audio for one turn, as pcm_s16le."""
    pcm = (0.5 * np.sin(np.arange(frames * 1920) * 0.05)).astype(np.float32)
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


async def canary(srv, stop: asyncio.Event) -> list:
    """A session that speaks turn after turn while the uploads go on: each turn's audio, exactly."""
    results = []
    async with websockets.connect(srv.ws_url, max_size=None) as ws:
        await ws.recv()
        while not stop.is_set() or len(results) < 3:
            tid = f"c{len(results)}"
            await ws.send(json.dumps({"type": "text", "turn_id": tid, "text": "Canary.", "final": True}))
            audio, events = b"", []
            while not events or events[-1]["type"] != "turn.done":
                msg = await asyncio.wait_for(ws.recv(), 20)
                if isinstance(msg, bytes):
                    audio += msg
                else:
                    events.append(json.loads(msg))
            results.append((audio, events))
    return results


def test_broken_audio_uploads(server):
    items = corpus()
    huge = base64.b64encode(b"\x00" * MAX_BODY).decode()          # the body is over the limit: 413 / 1009

    async def upload_all():
        answers = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            for name, (data, _, _) in items.items():
                b64 = base64.b64encode(data).decode()
                voice = await http.post("/v1/voices", json={"audio": b64})
                speech = await http.post(SPEECH, json={"input": "Hi.", "ref_audio": b64, "max_frames": 2})
                async with websockets.connect(server.ws_url, max_size=None) as ws:
                    await ws.recv()
                    await ws.send(json.dumps({"type": "session.update", "ref_audio": b64}))
                    event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                answers[name] = voice, speech, event
            answers["huge_base64"] = (await http.post("/v1/voices", json={"audio": huge}),
                                      await http.post(SPEECH, json={"input": "Hi.", "ref_audio": huge}))
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            with pytest.raises(ConnectionClosed) as closed:   # the server may close while the message is still going out
                await ws.send(json.dumps({"type": "session.update", "ref_audio": huge}))
                await asyncio.wait_for(ws.recv(), 10)
        return answers, closed.value.rcvd.code

    async def go():
        stop = asyncio.Event()
        speaking = asyncio.ensure_future(canary(server, stop))
        try:
            answers = await upload_all()
        finally:
            stop.set()
        return answers, await asyncio.wait_for(speaking, 30)
    ((answers, huge_ws_close), canary_turns) = asyncio.run(go())

    for name, (data, status, code) in items.items():
        voice, speech, event = answers[name]
        check_rest(voice)
        check_rest(speech)
        assert voice.status_code == status and speech.status_code == status, (name, voice.text, speech.text)
        if status == 200:
            assert voice.json()["mode"] == "x_vector" and voice.json()["duration_s"] > 0.1, name
            assert speech.headers["content-type"] == "audio/wav", name
            assert event["type"] == "session.updated", (name, event)
        else:
            assert voice.json()["error"]["code"] == speech.json()["error"]["code"] == code, name
            assert event["type"] == "error" and event["code"] == code and event["fatal"] is False, (name, event)
    for r in answers["huge_base64"]:
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert huge_ws_close == 1009

    # the session speaking meanwhile got every turn complete and exact
    assert len(canary_turns) >= 3
    for audio, events in canary_turns:
        assert [e["type"] for e in events] == ["turn.started", "turn.done"], events
        assert events[-1]["samples"] == FRAMES * 1920 and audio == expected_sine(FRAMES)
    # nothing broken was registered
    voices = httpx.get(server.url + "/v1/voices").json()["data"]
    assert len(voices) == sum(1 for _, status, _ in items.values() if status == 200)
