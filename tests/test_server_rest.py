"""REST against a real uvicorn + the real scheduler on the tiny model: the official `openai` client
unchanged, streaming (chunked and SSE), voices over restarts, metrics, operations routes."""
import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import websockets
from prometheus_client.parser import text_string_to_metric_families

from app.service import Settings
from server_harness import ServerThread, assert_same_pcm16, read_turns, ref_wav_b64

FRAMES = 6
GREEDY = {"max_frames": FRAMES, "temperature": 0}
FORMATS = ["wav", "pcm", "flac", "mp3", "opus"]


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def settings(tiny_model_dir, voices_dir):
    return Settings(model_dir=str(tiny_model_dir), device="cpu", max_batch=8, voices_dir=str(voices_dir))


@pytest.fixture(scope="module")
def server(settings):
    srv = ServerThread(settings)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def decode(data: bytes, response_format: str, rate: int = 24000) -> np.ndarray:
    if response_format == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767
    y, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == rate
    return y


def check_length(y: np.ndarray, response_format: str, frames: int = FRAMES, rate: int = 24000) -> None:
    n = frames * 1920 * rate // 24000
    if response_format in ("wav", "pcm", "flac"):
        assert len(y) == n
    else:                     # lossy codecs: whole files are trimmed to the length
        assert abs(len(y) - n) <= 0.01 * n + 1152


@pytest.mark.parametrize("response_format", FORMATS)
def test_openai_client_every_format(client, response_format):
    response = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello from the OpenAI client.",
                                          response_format=response_format, extra_body=GREEDY)
    data = response.read()
    y = decode(data, response_format)
    check_length(y, response_format)
    assert np.abs(y).max() > 0.01
    assert response.response.headers["content-type"].startswith(
        {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg"}[response_format])
    assert float(response.response.headers["x-audio-seconds"]) == pytest.approx(FRAMES * 0.08)
    assert float(response.response.headers["x-rtf"]) > 0 and float(response.response.headers["x-ttfa-ms"]) > 0


@pytest.mark.parametrize("response_format", FORMATS)
def test_openai_streaming_response(client, response_format):
    with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="nova", input="Streaming response test.", response_format=response_format,
            extra_body=GREEDY) as response:
        data = b"".join(response.iter_bytes(chunk_size=1024))
    check_length(decode(data, response_format), response_format)


def test_greedy_rest_audio_equals_websocket_audio(client, server):
    text = "Both routes, one engine."
    rest = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm",
                                      extra_body=GREEDY).read()

    async def ws_turn():
        async with websockets.connect(server.ws_url) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "max_frames": FRAMES, "sampling": {"temperature": 0}}))
            await ws.send(json.dumps({"type": "text", "turn_id": "w", "text": text, "final": True}))
            return (await read_turns(ws, 1))["w"]["audio"]
    assert_same_pcm16(rest, asyncio.run(ws_turn()))


@pytest.mark.parametrize("response_format", ["wav", "pcm", "mp3", "opus", "flac"])
def test_stream_true_is_chunked(server, response_format):
    body = {"input": "Chunked transfer of audio as it is made.", "response_format": response_format,
            "stream": True, "max_frames": 30, "temperature": 0}
    pieces = []
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers
        pieces = list(r.iter_raw())
    data = b"".join(pieces)
    assert len([p for p in pieces if p]) >= 2
    if response_format == "flac":      # a live FLAC stream: header first, frames after (no total length)
        assert data[:4] == b"fLaC" and len(data) > 1000
        return
    y = decode(data, response_format)
    n = 30 * 1920
    if response_format in ("wav", "pcm"):
        assert len(y) == n
    else:
        assert n <= len(y) <= n + 4000


def test_sse_stream_format(client, server):
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Server-sent events.", response_format="pcm", stream_format="sse",
            extra_body=GREEDY) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = [json.loads(block[len("data: "):]) for block in text.strip().split("\n\n")]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 2 * FRAMES * 1920
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == FRAMES and usage["total_tokens"] == usage["input_tokens"] + FRAMES
    plain = client.audio.speech.create(model="tts-1", voice="alloy", input="Server-sent events.",
                                       response_format="pcm", extra_body=GREEDY).read()
    assert_same_pcm16(audio, plain)


def test_sample_rate_and_raw_encodings(server):
    for response_format, width in (("pcm", 2), ("mulaw", 1), ("alaw", 1), ("f32le", 4)):
        r = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
            "input": "Rates.", "response_format": response_format, "sample_rate": 8000, **GREEDY})
        assert r.status_code == 200 and len(r.content) == width * FRAMES * 640
    r = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                   json={"text": "Alias field and a rate.", "response_format": "wav", "sample_rate": 16000, **GREEDY})
    check_length(decode(r.content, "wav", 16000), "wav", rate=16000)


def test_voices_register_use_and_survive_restart(server, settings, voices_dir):
    r = httpx.post(server.url + "/v1/voices", timeout=60, json={"audio": ref_wav_b64(seconds=2.0, noise=True), "name": "noise"})
    assert r.status_code == 200, r.text
    xvec = r.json()
    assert xvec["mode"] == "x_vector" and xvec["voice_id"].startswith("voice_") and xvec["duration_s"] == 2.0
    r = httpx.post(server.url + "/v1/voices", timeout=60, json={
        "audio": ref_wav_b64(), "ref_text": "Hello, this is the default voice of the speech server.",
        "voice_id": "narrator"})
    assert r.status_code == 200, r.text
    icl = r.json()
    assert icl["voice_id"] == "narrator" and icl["mode"] == "icl"
    listed = httpx.get(server.url + "/v1/voices").json()
    assert {v["voice_id"] for v in listed["data"]} == {xvec["voice_id"], "narrator"}
    assert sorted(p.name for p in voices_dir.iterdir()) == sorted([xvec["voice_id"] + ".safetensors",
                                                                    "narrator.safetensors"])

    async def ws_audio(url, voice):
        async with websockets.connect(url) as ws:
            await ws.recv()
            update = {"type": "session.update", "max_frames": FRAMES, "sampling": {"temperature": 0}}
            if voice:
                update["voice"] = voice
            await ws.send(json.dumps(update))
            await ws.send(json.dumps({"type": "text", "turn_id": "v", "text": "Which voice is this?", "final": True}))
            turns = await read_turns(ws, 1)
            assert turns["v"]["done"]["reason"] == "max_frames", turns
            return turns["v"]["audio"]

    default = asyncio.run(ws_audio(server.ws_url, None))
    by_id = {v: asyncio.run(ws_audio(server.ws_url, v)) for v in (xvec["voice_id"], "narrator")}
    assert default != by_id[xvec["voice_id"]] and default != by_id["narrator"] != by_id[xvec["voice_id"]]
    rest = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
        "input": "Which voice is this?", "voice": "narrator", "response_format": "pcm", **GREEDY}).content
    assert_same_pcm16(rest, by_id["narrator"])

    with ServerThread(settings) as again:           # a new server on the same VOICES_DIR
        listed = httpx.get(again.url + "/v1/voices").json()["data"]
        assert {v["voice_id"] for v in listed} == {xvec["voice_id"], "narrator"}
        for voice_id, audio in by_id.items():
            assert_same_pcm16(asyncio.run(ws_audio(again.ws_url, voice_id)), audio)
        assert httpx.delete(again.url + "/v1/voices/" + xvec["voice_id"]).json()["deleted"] is True
        assert httpx.get(again.url + "/v1/voices/" + xvec["voice_id"]).status_code == 404
    assert sorted(p.name for p in voices_dir.iterdir()) == ["narrator.safetensors"]


def test_registered_default_voice_replaces_the_builtin(server):
    def speak():
        return httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
            "input": "The default voice.", "response_format": "pcm", **GREEDY}).content
    builtin = speak()
    r = httpx.post(server.url + "/v1/voices", timeout=60, json={"audio": ref_wav_b64(seconds=1.5, noise=True), "voice_id": "default"})
    assert r.status_code == 200
    assert httpx.get(server.url + "/v1/voices").json()["default_voice"] == "default"
    registered = speak()
    assert registered != builtin
    assert httpx.delete(server.url + "/v1/voices/default").status_code == 200
    assert_same_pcm16(speak(), builtin)


def test_inline_reference_clone(server):
    for extra in ({}, {"ref_text": "Hello, this is the default voice of the speech server."},
                  {"ref_text": "Hello, this is the default voice.", "x_vector_only": True}):
        r = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
            "input": "Inline clone.", "ref_audio": ref_wav_b64(), "response_format": "wav", **GREEDY, **extra})
        assert r.status_code == 200, r.text
        check_length(decode(r.content, "wav"), "wav")


def metric_values(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_move(server):
    before = metric_values(httpx.get(server.url + "/metrics").text)
    httpx.post(server.url + "/v1/audio/speech", timeout=60, json={"input": "Count me.", **GREEDY})
    httpx.post(server.url + "/v1/audio/speech", timeout=60, json={"input": "", **GREEDY})
    after = metric_values(httpx.get(server.url + "/metrics").text)
    names = {name for name, _ in after}
    for name in ("qwen3_tts_requests_total", "qwen3_tts_active_sessions", "qwen3_tts_queue_depth",
                 "qwen3_tts_batch_size_bucket", "qwen3_tts_step_seconds_bucket", "qwen3_tts_ttfa_seconds_bucket",
                 "qwen3_tts_rtf_bucket", "qwen3_tts_audio_seconds_total", "qwen3_tts_underruns_total",
                 "qwen3_tts_gpu_memory_bytes", "qwen3_tts_decode_steps_total", "qwen3_tts_event_loop_lag_seconds_bucket"):
        assert name in names, name

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    assert delta("qwen3_tts_requests_total", route="speech", outcome="ok") == 1
    assert after[("qwen3_tts_gpu_memory_bytes", (("kind", "kv_cache"),))] > 0     # the cache's pages (CPU pool)
    assert delta("qwen3_tts_requests_total", route="speech", outcome="client_error") == 1
    assert delta("qwen3_tts_audio_seconds_total") == pytest.approx(FRAMES * 0.08)
    assert delta("qwen3_tts_ttfa_seconds_count") == 1
    assert delta("qwen3_tts_decode_steps_total") >= FRAMES
    assert delta("qwen3_tts_batch_size_count") >= 1
    assert delta("qwen3_tts_event_loop_lag_seconds_count") >= 1
    assert delta("qwen3_tts_engine_host_seconds_total", phase="step launch") > 0
    assert delta("qwen3_tts_engine_host_seconds_total", phase="read-back") > 0


def test_a_stalled_event_loop_is_measured_and_logged(server, caplog):
    """Something blocking the server's event loop for 0.4 s (here a sleep run on it) shows in the
    lag histogram's top buckets and in a warning."""
    def le(values, bound):
        return values.get(("qwen3_tts_event_loop_lag_seconds_bucket", (("le", bound),)), 0)
    before = metric_values(httpx.get(server.url + "/metrics").text)

    async def block():
        time.sleep(0.4)
    with caplog.at_level("WARNING"):
        asyncio.run_coroutine_threadsafe(block(), server.service.loop).result(10)
        time.sleep(0.1)                      # the sampler wakes after the stall
        after = metric_values(httpx.get(server.url + "/metrics").text)
    stalled = after[("qwen3_tts_event_loop_lag_seconds_count", ())] - before[("qwen3_tts_event_loop_lag_seconds_count", ())]
    under_quarter = le(after, "0.25") - le(before, "0.25")
    assert stalled - under_quarter >= 1
    assert any("event loop stalled" in r.getMessage() for r in caplog.records)


def test_operations_routes(server):
    status, body = server.startup_answers[0]      # /ready while the model was loading
    assert status == 503 and body["error"]["code"] == "loading"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 8 and health["demo"] is False
    assert {"active_sessions", "queue_depth", "model"} <= set(health)
    assert httpx.get(server.url + "/ready").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == health["model"] == "tiny-model"
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
