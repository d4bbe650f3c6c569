"""The replica router and launcher, on loopback.

Most tests put the router in front of tiny fake replicas (a few Starlette routes that report a chosen
load on /health and /ready and echo WebSocket frames), because what they check is placement and
proxying. The last one starts two real servers on the tiny golden model through the launcher.
"""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from app.replicas.pool import Pool
from app.replicas.drain import DrainingServer
from app.replicas.router import Router

REPO = Path(__file__).resolve().parents[1]
WS_PATH = "/v1/audio/speech/ws"


# -- loopback harness ------------------------------------------------------------------------------

class _Uvicorn(DrainingServer):
    """The router's server class, without touching the test process's signal handlers."""

    def capture_signals(self):
        import contextlib
        return contextlib.nullcontext()


class Served:
    """An ASGI app served by uvicorn on a free loopback port, as a task of the running loop."""

    def __init__(self, app, drain_timeout: float = 0.0):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.ws = self.url.replace("http", "ws", 1)
        config = uvicorn.Config(app, log_level="warning", lifespan="on", ws_per_message_deflate=False)
        if isinstance(app, Router):
            self.server = _Uvicorn(config, app.begin_drain, lambda: app.pool.open_total, drain_timeout)
        else:
            self.server = _Uvicorn(config, lambda: None, lambda: 0, drain_timeout)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        for _ in range(500):
            if self.server.started:
                return self
            await asyncio.sleep(0.01)
        raise TimeoutError("server did not start")

    async def stop(self):
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 10)

    async def __aexit__(self, *exc):
        if not self.task.done():
            await self.stop()


def fake_replica(max_batch: int = 4):
    """A stand-in for a server: reports `state` on /health and /ready, echoes WebSocket frames."""
    state = SimpleNamespace(ready=True, active=0, elsewhere=0, queue=0, max_batch=max_batch, full=False,
                            closed_with=[], seen_headers=[], streams_ended=0)

    async def health(request):
        return JSONResponse({"status": "ok", "active_sessions": state.active + state.elsewhere,
                             "queue_depth": state.queue, "max_batch": state.max_batch, "model": "fake"})

    async def ready(request):
        return JSONResponse({}, status_code=200 if state.ready else 503)

    async def speech(request):
        if state.full:
            return JSONResponse({"error": {"code": "overloaded", "message": "full"}}, status_code=503,
                                headers={"retry-after": "1"})
        state.seen_headers.append(dict(request.headers))
        text = (await request.json())["input"]

        async def chunks():
            try:
                for i in range(3 if text != "endless" else 10**6):
                    yield f"{text}:{i};".encode()
                    await asyncio.sleep(0.01)
            finally:
                state.streams_ended += 1
        return StreamingResponse(chunks(), media_type="audio/pcm", headers={"x-audio-seconds": "0.24"})

    async def session(ws):
        if ws.headers.get("authorization") == "Bearer wrong":
            return await ws.send_denial_response(
                JSONResponse({"error": {"code": "unauthorized", "message": "wrong key"}}, status_code=401))
        await ws.accept(subprotocol=(ws.scope.get("subprotocols") or [None])[0])
        state.active += 1
        try:
            await ws.send_json({"type": "session.created", "authorization": ws.headers.get("authorization"),
                                "query": ws.url.query})
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    state.closed_with.append(message.get("code"))
                    return
                if message.get("text") == "close please":
                    return await ws.close(4001, "asked to")
                if message.get("text") is not None:
                    await ws.send_text(message["text"])
                else:
                    await ws.send_bytes(message["bytes"])
        finally:
            state.active -= 1

    app = Starlette(routes=[Route("/health", health), Route("/ready", ready),
                            Route("/v1/audio/speech", speech, methods=["POST"]), WebSocketRoute(WS_PATH, session)])
    return app, state


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def settle(router: Router, rounds: int = 2):
    await asyncio.wait_for(router.pool.wait_polled(rounds), 5)


async def until(condition, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def replica_of(ws) -> str:
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created"
    return ws.response.headers["x-replica"]


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url)


def make_router(*replicas, **kw) -> Router:
    return Router(Pool([r.url for r in replicas], interval=0.05, timeout=0.5), **kw)


# -- placement -------------------------------------------------------------------------------------

def test_sessions_spread_evenly_and_follow_reported_load():
    async def main():
        (app_a, a), (app_b, b) = fake_replica(max_batch=4), fake_replica(max_batch=4)
        async with Served(app_a) as ra, Served(app_b) as rb:
            router = make_router(ra, rb)
            async with Served(router) as front:
                await settle(router)
                # opened together: the router counts what it just placed, so they alternate
                sockets = await asyncio.gather(*(connect(front.ws + WS_PATH) for _ in range(4)))
                placed = [await replica_of(ws) for ws in sockets]
                assert sorted(placed) == sorted([ra.url, ra.url, rb.url, rb.url])
                assert a.active == 2 and b.active == 2
                for ws in sockets:
                    await ws.close()
                await until(lambda: a.active == b.active == router.pool.open_total == 0)

                # load is relative to max_batch, and counts sessions the replica has from elsewhere:
                # A has 2 of 8 busy, B 1 of 2, so A takes two (2/8 -> 4/8) before B (1/2) ties with it;
                # on a tie the replica that got work least recently wins
                a.max_batch, a.elsewhere, b.max_batch, b.elsewhere = 8, 2, 2, 1
                await settle(router)
                sockets = [await connect(front.ws + WS_PATH) for _ in range(3)]
                assert [await replica_of(ws) for ws in sockets] == [ra.url, ra.url, rb.url]
                for ws in sockets:
                    await ws.close()
    run(main())


def test_replica_that_goes_away_or_drains_gets_no_new_sessions():
    async def main():
        (app_a, a), (app_b, b) = fake_replica(), fake_replica()
        async with Served(app_a) as ra, Served(app_b) as rb:
            router = make_router(ra, rb)
            # a second router that polls once at start and then not for a minute: it only learns
            # that a replica is gone when a connect to it fails
            blind = Router(Pool([ra.url, rb.url], interval=60, timeout=0.5))
            async with Served(router) as front, Served(blind) as blind_front:
                await settle(router)
                await until(lambda: all(r.ready for r in blind.pool.replicas.values()))
                kept = await connect(front.ws + WS_PATH)
                kept_on = await replica_of(kept)
                other = rb if kept_on == ra.url else ra
                other_state = b if other is rb else a

                # draining (/ready 503): no new sessions, open ones untouched
                other_state.ready = False
                await settle(router)
                fresh = [await connect(front.ws + WS_PATH) for _ in range(3)]
                assert [await replica_of(ws) for ws in fresh] == [kept_on] * 3
                other_state.ready = True
                await settle(router)
                doomed = await connect(front.ws + WS_PATH)
                assert await replica_of(doomed) == other.url

                await other.stop()
                with pytest.raises(ConnectionClosed):  # its session ends with the replica's own close code
                    await doomed.recv()
                assert doomed.close_code == 1012       # uvicorn's "service restart", passed on
                # gone since the last poll: the refused connect is skipped within the same request
                assert blind.pool.replicas[other.url].ready
                sockets = [await connect(blind_front.ws + WS_PATH) for _ in range(3)]
                assert [await replica_of(ws) for ws in sockets] == [kept_on] * 3
                assert not blind.pool.replicas[other.url].ready
                blind.pool.replicas[other.url].ready = True  # same for a REST request
                async with httpx.AsyncClient() as client:
                    r = await client.post(blind_front.url + "/v1/audio/speech", json={"input": "x"})
                    assert r.status_code == 200 and r.headers["x-replica"] == kept_on

                # and the polls keep it out
                await settle(router)
                assert not router.pool.replicas[other.url].ready
                health = (await get(front.url + "/health")).json()
                assert health["ready_replicas"] == 1 and health["status"] == "ok"
                fresh += [await connect(front.ws + WS_PATH) for _ in range(2)]
                assert [await replica_of(ws) for ws in fresh[-2:]] == [kept_on] * 2

                await kept.send("still here")
                assert await kept.recv() == "still here"
                for ws in [kept, *fresh, *sockets]:
                    await ws.close()
    run(main())


def test_replicas_found_by_dns_come_and_go():
    async def main():
        pool = Pool(discover=["replicas.example:8090"], interval=0.05)
        answers = {"replicas.example": [(socket.AF_INET, 0, 0, "", ("10.0.0.7", 8090)),
                                        (socket.AF_INET6, 0, 0, "", ("fd00::8", 8090, 0, 0))]}

        async def getaddrinfo(host, port, **kw):
            if host not in answers:
                raise socket.gaierror("no such host")
            return answers[host]
        asyncio.get_running_loop().getaddrinfo = getaddrinfo
        await pool._resolve()
        assert set(pool.replicas) == {"http://10.0.0.7:8090", "http://[fd00::8]:8090"}
        pool.acquire(pool.replicas["http://[fd00::8]:8090"], "ws")
        leaving = pool.replicas["http://[fd00::8]:8090"]
        answers["replicas.example"] = answers["replicas.example"][:1]
        await pool._resolve()
        assert set(pool.replicas) == {"http://10.0.0.7:8090"}
        assert pool.open_total == 1               # its session goes on; it just gets no new ones
        pool.release(leaving)
        assert pool.open_total == 0
        del answers["replicas.example"]           # a DNS failure keeps what is known
        await pool._resolve()
        assert set(pool.replicas) == {"http://10.0.0.7:8090"}
        del asyncio.get_running_loop().getaddrinfo

        # and end to end, a real name on loopback
        app_a, _ = fake_replica()
        async with Served(app_a) as ra:
            router = Router(Pool(discover=[f"127.0.0.1:{ra.url.rsplit(':', 1)[1]}"], interval=0.05))
            async with Served(router) as front:
                await settle(router)
                async with connect(front.ws + WS_PATH) as ws:
                    assert await replica_of(ws) == ra.url
    run(main())


def test_no_ready_replica_is_503_with_retry_after():
    async def main():
        (app_a, a), = [fake_replica()]
        async with Served(app_a) as ra:
            a.ready = False
            router = make_router(ra)
            async with Served(router) as front:
                await settle(router)
                async with httpx.AsyncClient() as client:
                    r = await client.post(front.url + "/v1/audio/speech", json={"input": "hi"})
                    assert r.status_code == 503 and r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "unavailable"
                    assert (await client.get(front.url + "/ready")).status_code == 503
                    assert (await client.get(front.url + "/health")).json()["status"] == "loading"
                with pytest.raises(InvalidStatus) as refused:
                    await connect(front.ws + WS_PATH)
                assert refused.value.response.status_code == 503
                assert json.loads(refused.value.response.body)["error"]["code"] == "unavailable"
                metrics = (await get(front.url + "/metrics")).text
                assert 'qwen3_tts_router_rejected_total{kind="ws"} 1.0' in metrics
                assert 'qwen3_tts_router_rejected_total{kind="http"} 1.0' in metrics

                a.ready = True
                await settle(router)
                assert (await get(front.url + "/ready")).status_code == 200
                async with connect(front.ws + WS_PATH) as ws:
                    assert await replica_of(ws) == ra.url
    run(main())


def test_websocket_frames_headers_and_close_codes_pass_through():
    async def main():
        (app_a, a), = [fake_replica()]
        async with Served(app_a) as ra:
            router = make_router(ra)
            async with Served(router) as front:
                await settle(router)
                url = front.ws + WS_PATH + "?api_key=k%201"
                async with connect(url, additional_headers={"Authorization": "Bearer sekrit"},
                                   subprotocols=["tts.v1"]) as ws:
                    created = json.loads(await ws.recv())
                    assert created["authorization"] == "Bearer sekrit" and created["query"] == "api_key=k%201"
                    assert ws.subprotocol == "tts.v1"
                    await ws.send('{"type": "ping"}')
                    assert await ws.recv() == '{"type": "ping"}'          # text stays text
                    payload = bytes(range(256)) * 64
                    await ws.send(payload)
                    assert await ws.recv() == payload                    # binary stays binary
                    await ws.send("close please")
                    with pytest.raises(ConnectionClosed):
                        await ws.recv()
                    assert ws.close_code == 4001 and ws.close_reason == "asked to"  # replica's close relayed

                async with connect(front.ws + WS_PATH) as ws:
                    await ws.recv()
                    await ws.close(code=4002, reason="client done")
                await until(lambda: a.closed_with == [4002])            # client's close relayed

                with pytest.raises(InvalidStatus) as refused:            # the replica's refusal relayed
                    await connect(front.ws + WS_PATH, additional_headers={"Authorization": "Bearer wrong"})
                assert refused.value.response.status_code == 401
                assert json.loads(refused.value.response.body)["error"]["code"] == "unauthorized"
                await until(lambda: router.pool.open_total == 0 and a.active == 0)
    run(main())


def test_rest_is_streamed_and_a_full_replica_is_skipped():
    async def main():
        (app_a, a), (app_b, b) = fake_replica(), fake_replica()
        async with Served(app_a) as ra, Served(app_b) as rb:
            router = make_router(ra, rb)
            async with Served(router) as front:
                await settle(router)
                async with httpx.AsyncClient() as client:
                    async with client.stream("POST", front.url + "/v1/audio/speech", json={"input": "hey"},
                                             headers={"authorization": "Bearer x"}) as r:
                        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
                        assert r.headers["x-audio-seconds"] == "0.24"
                        assert b"".join([c async for c in r.aiter_raw()]) == b"hey:0;hey:1;hey:2;"
                    first = r.headers["x-replica"]
                    seen = (a if first == ra.url else b).seen_headers[-1]
                    assert seen["authorization"] == "Bearer x" and seen["x-forwarded-for"] == "127.0.0.1"

                    # a client that goes away mid-stream: the replica's stream ends too (no wasted GPU)
                    ended = a.streams_ended + b.streams_ended
                    async with client.stream("POST", front.url + "/v1/audio/speech", json={"input": "endless"}) as r:
                        async for _ in r.aiter_raw():
                            break
                    await until(lambda: a.streams_ended + b.streams_ended == ended + 1)
                    await until(lambda: router.pool.open_total == 0)

                    a.full = True  # 503 from A: the same body goes to B
                    for _ in range(4):
                        r = await client.post(front.url + "/v1/audio/speech", json={"input": "x"})
                        assert r.status_code == 200 and r.headers["x-replica"] == rb.url
                    b.full = True  # both full: the replica's own 503 reaches the client
                    r = await client.post(front.url + "/v1/audio/speech", json={"input": "x"})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
                    assert r.headers["retry-after"] == "1"
    run(main())


def test_router_drains_on_first_signal():
    async def main():
        app_a, _ = fake_replica()
        async with Served(app_a) as ra:
            router = make_router(ra)
            async with Served(router, drain_timeout=30) as front:
                await settle(router)
                ws = await connect(front.ws + WS_PATH)
                await replica_of(ws)
                front.server.handle_exit(signal.SIGTERM, None)
                assert (await get(front.url + "/ready")).status_code == 503
                with pytest.raises(InvalidStatus):
                    await connect(front.ws + WS_PATH)
                await asyncio.sleep(0.3)
                assert not front.task.done()                 # waits for the open session...
                await ws.send("bye?")
                assert await ws.recv() == "bye?"             # ...which still works
                await ws.close()
                await asyncio.wait_for(front.task, 5)        # and exits once it has ended
    run(main())


# -- the launcher's plan ---------------------------------------------------------------------------

def test_launcher_gives_each_replica_one_visible_gpu_and_its_own_port(monkeypatch):
    from argparse import Namespace
    from app.replicas.launcher import plan, visible_gpus

    # CUDA stops reading the list at the first invalid entry; UUIDs are kept as they are
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5f1c,-1,7")
    assert visible_gpus() == ["3", "GPU-5f1c"]
    args = Namespace(device="cuda", gpus="all", replicas=None, replica_host="127.0.0.1", base_port=9001)
    planned = plan(args, ["--model-dir", "m", "--max-batch", "64"])
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in planned] == ["3", "GPU-5f1c"]
    for i, (cmd, _) in enumerate(planned):
        assert cmd[1:] == ["-m", "app", "--host", "127.0.0.1", "--port", str(9001 + i), "--device", "cuda:0",
                           "--model-dir", "m", "--max-batch", "64"]
    assert len(plan(Namespace(**{**vars(args), "gpus": "1"}), [])) == 1
    with pytest.raises(SystemExit, match="only 2 visible"):
        plan(Namespace(**{**vars(args), "gpus": "3"}), [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit, match="no GPU visible"):
        plan(args, [])

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = plan(Namespace(**{**vars(args), "device": "cpu", "replicas": 3}), ["--demo"])
    assert [cmd[cmd.index("--port") + 1] for cmd, _ in cpu] == ["9001", "9002", "9003"]
    assert all(cmd[cmd.index("--device") + 1] == "cpu" and cmd[-1] == "--demo" for cmd, _ in cpu)
    assert all(int(env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) // 3) for _, env in cpu)


# -- two real servers through the launcher ---------------------------------------------------------

def _free_port_run(count: int) -> int:
    """A port p such that p .. p+count-1 are all free on loopback now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no free port range")


async def speak(url: str, text: str) -> tuple[str, int, dict]:
    """One session, one turn: (replica it ran on, audio bytes, turn.done)."""
    async with connect(url + WS_PATH) as ws:
        replica = await replica_of(ws)
        await ws.send(json.dumps({"type": "text", "turn_id": "t1", "text": text, "final": True}))
        audio = 0
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                audio += len(message)
                continue
            event = json.loads(message)
            assert event["type"] != "error", event
            if event["type"] == "turn.done":
                return replica, audio, event


def test_two_real_servers_behind_the_launcher(tiny_model_dir, tmp_path):
    base = _free_port_run(3)
    front, replica_urls = f"http://127.0.0.1:{base}", [f"http://127.0.0.1:{base + 1 + i}" for i in range(2)]
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log_file:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "app.replicas.launcher", "--replicas", "2", "--device", "cpu",
             "--port", str(base), "--base-port", str(base + 1), "--drain-timeout", "10",
             "--model-dir", str(tiny_model_dir), "--voices-dir", str(tmp_path / "voices"), "--max-frames", "4"],
            cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        async def main():
            async with httpx.AsyncClient(timeout=30) as client:
                deadline = time.monotonic() + 100
                while True:
                    assert launcher.poll() is None, log_path.read_text()[-3000:]
                    assert time.monotonic() < deadline, "replicas not ready:\n" + log_path.read_text()[-3000:]
                    try:
                        if (await client.get(front + "/health")).json()["ready_replicas"] == 2:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.5)
                ws_front = front.replace("http", "ws", 1)

                # two sessions at once land on the two replicas, and both are spoken in full
                results = await asyncio.gather(speak(ws_front, "Hello there."), speak(ws_front, "Good morning."))
                assert sorted(r for r, _, _ in results) == replica_urls
                for _, audio, done in results:
                    assert audio > 0 and done["reason"] in ("eos", "max_frames") and done["frames"] >= 1
                # the benchmark client through the router: fixed-length turns, spread one per replica
                from bench.replicas import run as bench_run
                row = await bench_run(ws_front, 2, 3)
                assert row["by_replica"] == {url: 1 for url in replica_urls}
                assert row["frames_total"] == 6 and row["rtf_aggregate"] > 0

                r = await client.post(front + "/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"})
                assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
                assert r.content[:4] == b"RIFF" and r.headers["x-replica"] in replica_urls

                # a killed replica gets no new sessions; the other one serves them all
                pids = dict(re.findall(r"replica (\d+): pid (\d+)", log_path.read_text()))
                os.kill(int(pids["0"]), signal.SIGKILL)
                results = await asyncio.gather(speak(ws_front, "Still there?"), speak(ws_front, "Yes."))
                assert [r for r, _, _ in results] == [replica_urls[1]] * 2
                assert all(audio > 0 for _, audio, _ in results)
                health = (await client.get(front + "/health")).json()
                assert health["ready_replicas"] == 1 and health["status"] == "ok"
        run(main())
        assert launcher.poll() is None  # one replica is enough to keep serving
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        text = log_path.read_text()
        assert "replica 0 exited with status -9" in text and "router exited" in text
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
