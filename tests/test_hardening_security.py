"""Security: the API key guards every route but /health (HTTP 401, WebSocket closed with 1008) and is
compared in constant time; voice ids never reach outside VOICES_DIR; request bodies and WebSocket
messages are cut at the size limit before anything parses them. Also: a voice written into
VOICES_DIR by another server is served without a restart.

Protocol tests: the tiny model with the scheduler test double of server_harness.
"""
import asyncio
import hmac
import json
import os
import select
import shutil
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import websockets
import yaml
from starlette.routing import Mount, Route, WebSocketRoute
from websockets.exceptions import ConnectionClosed

import app.auth
import app.rest
import app.ws
from app.service import Settings
from app.voices import VoiceStore
from engine.loader import load_model
from server_harness import FakeScheduler, ServerThread, ref_wav_b64

KEY = "k3y-for-tests"
REPO = Path(__file__).resolve().parents[1]
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    settings = Settings(model_dir="unused", voices_dir=str(root / "voices"), api_key=KEY, max_body_bytes=MAX_BODY)
    with ServerThread(settings, scheduler=FakeScheduler(model, frames=2)) as srv:
        srv.root = root
        yield srv


def endpoints(routes, prefix=""):
    """(kind, path, method) of every route of the app, path parameters filled in."""
    for r in routes:
        if isinstance(r, Mount):
            if r.routes:
                yield from endpoints(r.routes, prefix + r.path)
            else:                                       # the page's static files
                yield from (("http", prefix + r.path + f, "GET") for f in ("/", "/index.html", "/app.js"))
        elif isinstance(r, WebSocketRoute):
            yield "ws", prefix + r.path, None
        elif isinstance(r, Route):
            path = prefix + r.path.replace("{voice_id}", "default")
            yield from (("http", path, m) for m in sorted(r.methods - {"HEAD"}))


async def ws_answer(url, headers=None):
    """("open", first event type) or ("closed", close code, the error code sent before)."""
    async with websockets.connect(url, additional_headers=headers) as ws:
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if first["type"] == "session.created":
            return "open", first["type"]
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
        return "closed", closed.value.rcvd.code, first["code"]


def test_every_route_but_health_needs_the_key(server):
    found = list(endpoints(server.app.routes))
    assert ("ws", "/v1/audio/speech/ws", None) in found and len(found) >= 10
    bad = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + KEY[:-1]},
           {"Authorization": "Bearer " + KEY + "x"}, {"Authorization": "Basic " + KEY}, {"Cookie": "qwen3_tts_api_key=no"}]
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for kind, path, method in found:
            if kind == "ws":
                url = server.ws_url
                for headers in bad:
                    assert asyncio.run(ws_answer(url, headers)) == ("closed", 1008, "fatal.unauthorized"), headers
                assert asyncio.run(ws_answer(url + "?api_key=wrong")) == ("closed", 1008, "fatal.unauthorized")
                assert asyncio.run(ws_answer(url, {"Authorization": "Bearer " + KEY})) == ("open", "session.created")
                assert asyncio.run(ws_answer(url + "?api_key=" + KEY)) == ("open", "session.created")
                continue
            for headers in bad:
                r = http.request(method, path, headers=headers, content=b"{}")
                if path == "/health":
                    assert r.status_code == 200
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["code"] == "unauthorized" and r.headers["WWW-Authenticate"] == "Bearer"
            r = http.request(method, path, headers={"Authorization": "Bearer " + KEY}, content=b"{}")
            assert r.status_code != 401, (method, path)
            assert http.get(path + "?api_key=wrong").status_code in ((200,) if path == "/health" else (401,))
        assert http.get("/no/such/route").status_code == 401          # unknown routes too: nothing leaks


def test_keys_are_compared_in_constant_time(server, monkeypatch):
    """Every check goes through hmac.compare_digest, on digests of equal length (the key's length
    does not show either)."""
    calls = []

    def spy(a, b):
        calls.append((len(a), len(b)))
        return hmac.compare_digest(a, b)
    monkeypatch.setattr(app.auth, "hmac", SimpleNamespace(compare_digest=spy))
    for key in ("", "x", "wrong", KEY[:-1], KEY, KEY * 10):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == (200 if key == KEY else 401)
    asyncio.run(ws_answer(server.ws_url + "?api_key=nope"))
    assert len(calls) == 7 and len(set(calls)) == 1, calls


TRAVERSALS = ["../outside/evil", "..", "../voices/../outside/evil", "/etc/passwd", "voices/../../outside/evil",
              "..%2Foutside%2Fevil", "sub/evil", "sub\\evil", "evil\x00", ".evil", "~", "ev il", "e" * 65,
              "\u2025/outside/evil", "evil.safetensors"]


def test_voice_ids_cannot_reach_outside_voices_dir(server):
    http = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer " + KEY}, timeout=30)
    made = http.post("/v1/voices", json={"audio": ref_wav_b64(), "voice_id": "inside"})
    assert made.status_code == 200
    voices_dir = server.root / "voices"
    planted = []                                   # valid voice files where no voice id may lead
    for target in (server.root / "outside" / "evil.safetensors", voices_dir / "sub" / "evil.safetensors",
                   server.root / "evil.safetensors"):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(voices_dir / "inside.safetensors", target)
        planted.append(target)

    async def ws_voice(voice):
        async with websockets.connect(server.ws_url + "?api_key=" + KEY) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "voice": voice}))
            return json.loads(await asyncio.wait_for(ws.recv(), 10))
    for voice_id in TRAVERSALS:
        quoted = urllib.parse.quote(voice_id, safe="").replace(".", "%2E")    # as the client meant it
        for r in (http.get(f"/v1/voices/{quoted}"), http.delete(f"/v1/voices/{quoted}")):
            assert r.status_code == 404, (voice_id, r.status_code)
        r = http.post("/v1/audio/speech", json={"input": "x", "voice": voice_id, "max_frames": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found", voice_id
        r = http.post("/v1/audio/speech", json={"input": "x", "voice": {"id": voice_id}, "max_frames": 1})
        assert r.status_code == 404, voice_id
        event = asyncio.run(ws_voice(voice_id))
        assert event["type"] == "error" and event["code"] == "voice_not_found", (voice_id, event)
        r = http.post("/v1/voices", json={"audio": ref_wav_b64(0.5), "voice_id": voice_id})
        assert r.status_code == 400, (voice_id, r.status_code)
    assert all(p.is_file() for p in planted)        # nothing outside was deleted
    assert sorted(p.name for p in voices_dir.iterdir()) == ["inside.safetensors", "sub"]   # nor written
    assert [v["voice_id"] for v in http.get("/v1/voices").json()["data"]] == ["inside"]


def test_a_voice_registered_by_another_server_is_served_at_once(server, model):
    """Replicas share VOICES_DIR: a voice one of them writes is known to the others on first use."""
    http = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer " + KEY}, timeout=30)
    assert http.get("/v1/voices/elsewhere").status_code == 404
    other = VoiceStore(server.root / "voices", model.config.talker.transformer.hidden_size)
    other.add("elsewhere", server.service.builtin_voice, "From another replica", 3.2, None)
    assert http.get("/v1/voices/elsewhere").json()["name"] == "From another replica"
    r = http.post("/v1/audio/speech", json={"input": "Hello.", "voice": "elsewhere", "max_frames": 2})
    assert r.status_code == 200
    assert "elsewhere" in [v["voice_id"] for v in http.get("/v1/voices").json()["data"]]
    assert http.delete("/v1/voices/elsewhere").status_code == 200
    assert not (server.root / "voices" / "elsewhere.safetensors").exists()


def test_bodies_and_messages_are_capped_before_parsing(server, monkeypatch):
    parsed = []

    def spying(module):
        return SimpleNamespace(loads=lambda data, **kw: parsed.append(len(data)) or module.loads(data, **kw),
                               dumps=module.dumps)
    monkeypatch.setattr(app.rest, "json", spying(json))
    monkeypatch.setattr(app.ws, "json", spying(json))
    monkeypatch.setattr(app.ws, "msgpack", SimpleNamespace(unpackb=lambda data, **kw: parsed.append(len(data)),
                                                           packb=app.ws.msgpack.packb))
    auth = f"Authorization: Bearer {KEY}\r\n".encode()

    # a declared length over the limit: 413 before a byte of the body is read
    with socket.create_connection(("127.0.0.1", server.settings.port)) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n" + auth +
                  f"Content-Type: application/json\r\nContent-Length: {50 * MAX_BODY}\r\n\r\n".encode())
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")

    # no length (chunked): the server answers 413 as soon as the limit is passed, long before the end
    sent = 0
    with socket.create_connection(("127.0.0.1", server.settings.port)) as s:
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n" + auth +
                  b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"10000\r\n" + b"[" * 0x10000 + b"\r\n"
        answer = b""
        s.setblocking(False)
        deadline = time.monotonic() + 20
        while not answer and time.monotonic() < deadline and sent < 100 * MAX_BODY:
            readable, writable, _ = select.select([s], [s], [], 1)
            if readable:
                answer = s.recv(65536)
            elif writable:
                try:
                    sent += s.send(chunk)
                except (BlockingIOError, ConnectionError):
                    pass
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 20 * MAX_BODY          # (what the kernel's socket buffers took, beyond the limit)

    async def oversized(frame):
        async with websockets.connect(server.ws_url + "?api_key=" + KEY, max_size=None) as ws:
            await ws.recv()
            with pytest.raises(ConnectionClosed) as closed:   # the server may close while the frame is still going out
                await ws.send(frame)
                await asyncio.wait_for(ws.recv(), 10)
            return closed.value.rcvd.code
    assert asyncio.run(oversized(json.dumps({"type": "text", "text": "y" * MAX_BODY}))) == 1009
    assert asyncio.run(oversized(b"\x81" + b"\x00" * MAX_BODY)) == 1009
    assert parsed == []                   # neither the bodies nor the messages reached a parser
    r = httpx.post(server.url + "/v1/audio/speech", headers={"Authorization": "Bearer " + KEY},
                   json={"input": "Small.", "max_frames": 1})
    assert r.status_code == 200 and parsed     # (the spy does see what is parsed)


def test_the_kubernetes_readiness_probe_sends_the_key(server):
    """deploy/k8s probes /ready with the key from the pod's environment (an httpGet probe would get 401)."""
    deployment = next(d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "deployment.yaml").read_text())
                      if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = container["readinessProbe"]["exec"]["command"]
    assert "httpGet" not in container["readinessProbe"]

    def probe(**env):
        return subprocess.run(command, env={"PATH": os.environ["PATH"], "PORT": str(server.settings.port), **env},
                              capture_output=True, timeout=30).returncode
    assert probe(API_KEY=KEY) == 0
    assert probe(API_KEY="wrong") != 0 and probe() != 0
    server.service.status = "draining"          # /ready 503: the pod leaves the Service
    try:
        assert probe(API_KEY=KEY) != 0
    finally:
        server.service.status = "ok"
