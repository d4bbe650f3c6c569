"""The Twilio bridge against the real server (tiny model), with the test playing Twilio.

The peer sends `connected`, `start`, inbound `media` every 20 ms, echoed `mark`s and `stop` in the
shapes of Twilio's Media Streams documentation, and checks what a bidirectional stream must get
back: JSON text frames only, `media` of exactly 160 μ-law bytes in valid base64, sent at real time,
a `mark` after each turn, `clear` on barge-in, and the session gone at once after `stop` or a
closed socket.
"""
from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
import xml.etree.ElementTree as ET

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.bridges.tts_client import Audio
from app.bridges.twilio import TwilioCall
from tts_server import free_port, subprocess_service, tts_server

LEAD_S = 0.060          # the bridge's --lead-ms default
FRAME_S = 0.020
LONG_TEXT = ("This is a long answer that keeps going, sentence after sentence, so that the caller has "
             "plenty of time to interrupt it while it is still being spoken on the line. ") * 4


@pytest.fixture(scope="module")
def tts_url(tiny_model_dir):
    # The tiny random model never says EOS: each turn runs to the server's cap of 20 frames (1.6 s).
    # Sessions idle for 1.5 s are closed, unless the bridge keeps them alive.
    with tts_server(tiny_model_dir, "--max-frames", "20", "--idle-timeout", "1.5") as url:
        yield url


@pytest.fixture(scope="module")
def bridge(tts_url):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "app.bridges.twilio", "--tts-url", tts_url, "--host", "127.0.0.1",
            "--port", str(port)]
    with subprocess_service(args, f"{url}/health", timeout_s=30):
        yield url


class TwilioPeer:
    """Twilio's side of one bidirectional <Connect><Stream>."""

    def __init__(self, ws, call_sid: str):
        self.ws = ws
        self.call_sid = call_sid
        self.stream_sid = "MZ" + call_sid[2:]
        self.account_sid = "AC" + "0" * 32
        self.seq = 0
        self._inbound = None

    def _next_seq(self) -> str:
        self.seq += 1
        return str(self.seq)

    async def send(self, msg: dict) -> None:
        await self.ws.send(json.dumps(msg))

    async def begin(self, **custom_parameters: str) -> None:
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.send({
            "event": "start", "sequenceNumber": self._next_seq(), "streamSid": self.stream_sid,
            "start": {"accountSid": self.account_sid, "streamSid": self.stream_sid, "callSid": self.call_sid,
                      "tracks": ["inbound"], "customParameters": custom_parameters,
                      "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}},
        })
        self._inbound = asyncio.create_task(self._caller_audio())

    async def _caller_audio(self) -> None:
        """The caller's side of the call: 20 ms of μ-law silence every 20 ms, as Twilio streams it."""
        payload = base64.b64encode(b"\xff" * 160).decode()
        for chunk in range(1, 10**6):
            await self.send({"event": "media", "sequenceNumber": self._next_seq(), "streamSid": self.stream_sid,
                             "media": {"track": "inbound", "chunk": str(chunk), "timestamp": str(chunk * 20),
                                       "payload": payload}})
            await asyncio.sleep(FRAME_S)

    async def recv(self, timeout: float = 30.0) -> tuple[float, dict]:
        frame = await asyncio.wait_for(self.ws.recv(), timeout)
        assert isinstance(frame, str), "Twilio accepts JSON text frames only"
        msg = json.loads(frame)
        assert msg["streamSid"] == self.stream_sid
        if msg["event"] == "media":
            assert set(msg) == {"event", "streamSid", "media"} and set(msg["media"]) == {"payload"}, msg
            audio = base64.b64decode(msg["media"]["payload"], validate=True)
            assert len(audio) == 160, f"media payload of {len(audio)} bytes, not 20 ms"
        elif msg["event"] == "mark":
            assert set(msg) == {"event", "streamSid", "mark"} and isinstance(msg["mark"]["name"], str), msg
        else:
            assert msg == {"event": "clear", "streamSid": self.stream_sid}, msg
        return time.monotonic(), msg

    async def turn(self) -> tuple[list[float], str]:
        """Media arrival times up to the next mark, and the mark's name."""
        times = []
        while True:
            at, msg = await self.recv()
            if msg["event"] == "mark":
                return times, msg["mark"]["name"]
            assert msg["event"] == "media", msg
            times.append(at)

    async def echo_mark(self, name: str) -> None:
        """What Twilio sends once the audio before a mark has played."""
        await self.send({"event": "mark", "sequenceNumber": self._next_seq(), "streamSid": self.stream_sid,
                         "mark": {"name": name}})

    async def stop(self) -> None:
        await self.send({"event": "stop", "sequenceNumber": self._next_seq(), "streamSid": self.stream_sid,
                         "stop": {"accountSid": self.account_sid, "callSid": self.call_sid}})

    def close_inbound(self) -> None:
        if self._inbound:
            self._inbound.cancel()


def assert_not_faster_than_real_time(times: list[float], slack_s: float = 0.1) -> None:
    """A turn's media never arrives faster than it plays (beyond the bridge's lead). The slack
    covers this reader stalling on its first frame; exact pacing is checked with instant audio below."""
    span = times[-1] - times[0]
    assert span >= (len(times) - 1) * FRAME_S - LEAD_S - slack_s, f"{len(times)} frames in {span * 1000:.0f} ms"


async def wait_gone(http: httpx.AsyncClient, bridge: str, tts_url: str, call_sid: str) -> None:
    """Within a second the call leaves the bridge (its TTS socket closed), and its session and batch
    slot leave the server."""
    deadline = time.monotonic() + 1.0
    while True:
        calls = (await http.get(f"{bridge}/calls")).json()["calls"]
        health = (await http.get(f"{tts_url}/health")).json()
        if not any(c["call_sid"] == call_sid for c in calls) and health["active_sessions"] == health["batch_active"] == 0:
            return
        assert time.monotonic() < deadline, f"call still open: calls={calls} health={health}"
        await asyncio.sleep(0.05)


def test_call_speaks_paced_frames_marks_turns_clears_and_ends_on_stop(bridge, tts_url):
    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http, connect(f"{bridge.replace('http', 'ws')}/twilio/media") as ws:
            peer = TwilioPeer(ws, "CA" + "1" * 32)
            await peer.begin(text="Hello, thanks for calling.")

            media_per_turn = {}
            times, mark = await peer.turn()            # the start event's customParameters.text
            assert len(times) >= 4 and mark == "turn-1"
            media_per_turn[mark] = len(times)
            assert_not_faster_than_real_time(times)
            await peer.echo_mark(mark)

            said = (await http.post(f"{bridge}/calls/{peer.call_sid}/say", json={"text": "How can I help?"})).json()
            times, mark = await peer.turn()
            assert mark == said["turn_id"] == "turn-2" and len(times) >= 4
            media_per_turn[mark] = len(times)
            assert_not_faster_than_real_time(times)
            await peer.echo_mark(mark)

            # Barge-in during a long turn: clear comes after the media already sent, then silence.
            long_turn = (await http.post(f"{bridge}/calls/{peer.call_sid}/say", json={"text": LONG_TEXT})).json()
            for _ in range(10):
                _, msg = await peer.recv()
                assert msg["event"] == "media"
            cleared = (await http.post(f"{bridge}/calls/{peer.call_sid}/clear")).json()
            assert cleared["cancelled"] == [long_turn["turn_id"]]
            while (msg := (await peer.recv())[1])["event"] == "media":
                pass
            assert msg["event"] == "clear"
            with pytest.raises(asyncio.TimeoutError):
                await peer.recv(timeout=0.5)       # no audio and no mark of the cleared turn

            # The call goes on after a barge-in.
            await http.post(f"{bridge}/calls/{peer.call_sid}/say", json={"text": "Sorry, go ahead."})
            times, mark = await peer.turn()
            assert mark == "turn-4" and len(times) >= 4
            media_per_turn[mark] = len(times)

            status = (await http.get(f"{bridge}/calls")).json()["calls"]
            [call] = [c for c in status if c["call_sid"] == peer.call_sid]
            done = {t["turn_id"]: t for t in call["turns_done"]}
            for turn_id, frames in media_per_turn.items():     # every sample went out, in 20 ms frames
                assert frames == -(-done[turn_id]["samples"] // 160) > 0, (turn_id, frames, done[turn_id])
            assert done[long_turn["turn_id"]]["reason"] == "cancelled"
            assert call["marks_sent"] == ["turn-1", "turn-2", "turn-4"]
            assert call["marks_echoed"] == ["turn-1", "turn-2"]
            assert call["inbound_media"] > 0 and call["clears"] == 1

            await peer.stop()
            peer.close_inbound()
            await wait_gone(http, bridge, tts_url, peer.call_sid)
    asyncio.run(scenario())


def test_a_silent_call_stays_open(bridge, tts_url):
    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http, connect(f"{bridge.replace('http', 'ws')}/twilio/media") as ws:
            peer = TwilioPeer(ws, "CA" + "5" * 32)
            await peer.begin()
            await asyncio.sleep(3.0)        # twice the server's idle timeout, nothing said
            said = (await http.post(f"{bridge}/calls/{peer.call_sid}/say", json={"text": "Still there?"})).json()
            times, mark = await peer.turn()
            assert mark == said["turn_id"] and len(times) >= 4
            peer.close_inbound()
            await peer.stop()
    asyncio.run(scenario())


def test_closed_socket_ends_the_call_mid_turn(bridge, tts_url):
    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http:
            async with connect(f"{bridge.replace('http', 'ws')}/twilio/media") as ws:
                peer = TwilioPeer(ws, "CA" + "2" * 32)
                await peer.begin(text=LONG_TEXT)
                for _ in range(3):
                    assert (await peer.recv())[1]["event"] == "media"
                assert any(c["call_sid"] == peer.call_sid for c in (await http.get(f"{bridge}/calls")).json()["calls"])
                peer.close_inbound()
            await wait_gone(http, bridge, tts_url, peer.call_sid)
    asyncio.run(scenario())


def test_routes_reject_unknown_calls_and_bad_bodies(bridge):
    assert httpx.post(f"{bridge}/calls/CA404/say", json={"text": "hi"}).status_code == 404
    assert httpx.post(f"{bridge}/calls/CA404/clear").status_code == 404

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http, connect(f"{bridge.replace('http', 'ws')}/twilio/media") as ws:
            peer = TwilioPeer(ws, "CA" + "3" * 32)
            await peer.begin()
            deadline = time.monotonic() + 10
            while not any(c["call_sid"] == peer.call_sid for c in (await http.get(f"{bridge}/calls")).json()["calls"]):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            for body in ({"text": ""}, {"text": 5}, ["not", "an", "object"]):
                r = await http.post(f"{bridge}/calls/{peer.call_sid}/say", json=body)
                assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", body
            peer.close_inbound()
            await peer.stop()
    asyncio.run(scenario())


def test_twiml_connects_a_call_to_the_stream(bridge):
    r = httpx.post(f"{bridge}/twiml?text=Welcome%20%26%20hello", headers={"host": "bridge.example.com"})
    assert r.headers["content-type"].startswith("text/xml")
    stream = ET.fromstring(r.text).find("./Connect/Stream")
    assert stream.get("url") == "wss://bridge.example.com/twilio/media"
    assert [(p.get("name"), p.get("value")) for p in stream.findall("Parameter")] == [("text", "Welcome & hello")]


def test_stream_is_closed_when_the_tts_server_is_unreachable():
    port, dead = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "app.bridges.twilio", "--tts-url", f"ws://127.0.0.1:{dead}", "--port", str(port),
            "--api-key", "k"]
    with subprocess_service(args, f"{url}/health", timeout_s=30):
        assert httpx.get(f"{url}/calls").status_code == 401
        assert httpx.get(f"{url}/calls", headers={"Authorization": "Bearer k"}).json() == {"calls": []}

        async def scenario():
            async with connect(f"ws://127.0.0.1:{port}/twilio/media") as ws:
                peer = TwilioPeer(ws, "CA" + "4" * 32)
                await peer.begin(text="nobody will hear this")
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 15)
                peer.close_inbound()
                assert closed.value.rcvd.code == 1011
        asyncio.run(scenario())


class InstantTTS:
    """A TTS session with each turn's audio ready at once, in uneven pieces: a server far faster
    than real time, so that only the bridge's pacing spaces the frames."""

    def __init__(self, audio: bytes, piece: int):
        self.audio, self.piece = audio, piece
        self.queue: asyncio.Queue = asyncio.Queue()

    async def say(self, turn_id: str, text: str, final: bool = True) -> None:
        for i in range(0, len(self.audio), self.piece):
            self.queue.put_nowait(Audio(turn_id, self.audio[i:i + self.piece]))
        self.queue.put_nowait({"type": "turn.done", "turn_id": turn_id, "reason": "eos"})

    async def cancel(self, turn_id=None) -> None:
        pass

    async def events(self):
        while True:
            yield await self.queue.get()

    async def close(self) -> None:
        pass


class RecordingSocket:
    """Records what the bridge sends and when; `first_send_s` makes the first send slow to go out,
    as on a loaded machine, which must not let the later frames run ahead of real time."""

    def __init__(self, first_send_s: float = 0.0):
        self.sent: list[tuple[float, dict]] = []
        self.got_mark = asyncio.Event()
        self.first_send_s = first_send_s

    async def send_text(self, text: str) -> None:
        if not self.sent:
            await asyncio.sleep(self.first_send_s)
        msg = json.loads(text)
        self.sent.append((time.monotonic(), msg))
        if msg["event"] == "mark":
            self.got_mark.set()


@pytest.mark.parametrize("first_send_s", [0.0, 0.015])
def test_instant_audio_is_reframed_exactly_and_paced_at_real_time(first_send_s):
    audio = (bytes(range(256)) * 31)[:49 * 160 + 40]         # 49 whole frames and 40 bytes

    async def scenario():
        ws = RecordingSocket(first_send_s)
        call = TwilioCall(ws, {"streamSid": "MZ1", "callSid": "CA1"}, InstantTTS(audio, piece=333), LEAD_S)
        try:
            assert await call.say("hello") == "turn-1"
            await asyncio.wait_for(ws.got_mark.wait(), 5)
        finally:
            await call.close()
        return ws.sent

    sent = asyncio.run(scenario())
    media = [(t, m) for t, m in sent if m["event"] == "media"]
    assert sent[-1][1] == {"event": "mark", "streamSid": "MZ1", "mark": {"name": "turn-1"}}
    payloads = [base64.b64decode(m["media"]["payload"]) for _, m in media]
    assert [len(p) for p in payloads] == [160] * 50
    assert b"".join(payloads) == audio + b"\xff" * 120        # the last frame padded with μ-law silence
    times = [t for t, _ in media]
    for k, t in enumerate(times):
        ahead = k * FRAME_S - (t - times[0])
        assert ahead <= LEAD_S + 0.005, f"frame {k} sent {ahead * 1000:.0f} ms ahead of real time"
    assert times[-1] - times[0] <= 49 * FRAME_S - LEAD_S + 0.15, "paced slower than real time"


def test_clear_drops_audio_still_queued_after_the_server_finished_the_turn():
    """The server is done with the turn at once; most of its audio still waits for its time slot."""
    async def scenario():
        ws = RecordingSocket()
        call = TwilioCall(ws, {"streamSid": "MZ1", "callSid": "CA1"}, InstantTTS(b"\xff" * 8000, piece=800), LEAD_S)
        try:
            await call.say("hello")
            while sum(m["event"] == "media" for _, m in ws.sent) < 5:
                await asyncio.sleep(0.005)
            assert await call.clear() == ["turn-1"]
            await asyncio.sleep(0.2)
        finally:
            await call.close()
        return [m["event"] for _, m in ws.sent]

    events = asyncio.run(scenario())
    assert events[-1] == "clear" and set(events[:-1]) == {"media"} and 5 <= len(events) - 1 < 50
