"""Soak: many WebSocket sessions with churn against a running server for a given time; reports lost
or garbled turns, memory over time and slot leaks.

    python bench/soak.py --url http://127.0.0.1:8090 --duration 600 --concurrency 64 --json soak.json

`--concurrency` workers each open a session after another until `--duration` is over. A session
picks a format (s16le 24 kHz, mu-law 8 kHz in 20 ms frames, f32le 16 kHz) and framing (raw or
msgpack), speaks 1..`--max-turns` turns (text whole or in pieces, like LLM tokens), and sometimes
barges in (cancel) or hangs up mid-turn, or closes the TCP connection without a goodbye. Now and
then a worker makes a REST request instead. Every turn is checked:
- lost: no `turn.done` for a turn whose session stayed open, or a turn that ended with an error;
- garbled: the audio received for it (bytes / sample width; msgpack: by turn_id, offsets contiguous;
  fixed frames all of their size) does not add up to its `turn.done` `samples`, or it ran short of
  its frame cap without `eos`.
Every `--sample-every` seconds the server's /metrics (`process_resident_memory_bytes`,
`process_open_fds`) and /health are recorded. At the end, once the clients are gone, the server must
come back to no active session, no busy batch slot, an empty queue and its open files within
FD_SLACK of the start within `--settle` seconds; whatever is left is a leak. Exit status 1 if
anything was lost, garbled or leaked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import msgpack
import websockets
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))      # run as a script or imported
from ttfa import SENTENCES, ws_url  # noqa: E402

FD_SLACK = 2          # open files the server may hold beyond its count at the start (its own client's)
FORMATS = [({"encoding": "pcm_s16le", "sample_rate": 24000}, 2), ({"encoding": "mulaw", "sample_rate": 8000,
            "frame_ms": 20}, 1), ({"encoding": "f32le", "sample_rate": 16000}, 4)]


@dataclass
class Report:
    duration_s: float = 0.0
    sessions: int = 0
    sessions_cut: int = 0           # hung up by the client mid-turn (on purpose)
    turns: int = 0                  # turns that got a turn.done
    turns_ok: int = 0
    turns_cancelled: int = 0
    turns_refused: int = 0          # overloaded: refused at once (not lost: the client is told to retry)
    lost: int = 0
    garbled: int = 0
    rest_requests: int = 0
    rest_failed: int = 0
    audio_s: float = 0.0
    problems: list = field(default_factory=list)     # the first few lost / garbled turns, described
    samples: list = field(default_factory=list)      # [t, rss_mb, open_fds, active_sessions, batch_active, queue]
    memory_start_mb: float = 0.0
    memory_end_mb: float = 0.0
    memory_max_mb: float = 0.0
    fds_start: int = 0
    fds_end: int = 0
    leaked_slots: int = 0
    leaked_sessions: int = 0
    leaked_queue: int = 0

    def problem(self, kind: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {what}")

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.garbled or self.leaked_slots or self.leaked_sessions or self.leaked_queue)


class Turn:
    def __init__(self, tid: str):
        self.id, self.samples, self.next_offset = tid, 0, 0
        self.refused = False             # overloaded: refused at once, the client is told to retry
        self.bad: Optional[str] = None


def hang_up(ws, rng: random.Random) -> None:
    """Leave mid-turn: half of the time without a close frame or FIN (a TCP reset)."""
    if rng.random() < 0.5:
        sock = ws.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def session(url: str, args, rng: random.Random, report: Report, headers: dict) -> None:
    fmt, width = rng.choice(FORMATS)
    framing = rng.choice(["raw", "msgpack"])
    frame_bytes = fmt.get("frame_ms", 0) * fmt["sample_rate"] // 1000 * width
    ws = await websockets.connect(url, max_size=None, additional_headers=headers, open_timeout=args.timeout)
    try:
        report.sessions += 1
        await asyncio.wait_for(ws.recv(), args.timeout)                      # session.created
        await ws.send(json.dumps({"type": "session.update", "format": fmt, "audio_framing": framing,
                                  "max_frames": args.max_frames,
                                  "sampling": {"temperature": 0.8, "seed": rng.randrange(1 << 31)}}))
        turns: dict[str, Turn] = {}
        for k in range(rng.randint(1, args.max_turns)):
            tid = f"t{k}"
            turns[tid] = Turn(tid)
            text = rng.choice(SENTENCES)
            if rng.random() < 0.5:                                           # in pieces, like LLM tokens
                words = text.split()
                for i in range(0, len(words), 3):
                    await ws.send(json.dumps({"type": "text", "turn_id": tid, "text": " ".join(words[i:i + 3]) + " "}))
                await ws.send(json.dumps({"type": "turn.end", "turn_id": tid}))
            else:
                await ws.send(json.dumps({"type": "text", "turn_id": tid, "text": text, "final": True}))
        leave = rng.random() < args.churn
        barge_in = rng.random() < args.cancel_rate
        pending = set(turns)
        current: Optional[Turn] = None
        chunks = 0
        while pending:
            msg = await asyncio.wait_for(ws.recv(), args.timeout)
            if isinstance(msg, bytes):
                if framing == "msgpack":
                    frame = msgpack.unpackb(msg)
                    turn, data = turns.get(frame["turn_id"]), frame["data"]
                    if turn is not None and frame["offset"] != turn.next_offset:
                        turn.bad = f"audio at offset {frame['offset']}, expected {turn.next_offset}"
                else:
                    turn, data = current, msg
                if turn is None:
                    report.problem("garbled", f"audio for no turn of this session ({framing})")
                    continue
                turn.samples += len(data) // width
                turn.next_offset = turn.samples
                if frame_bytes and len(data) != frame_bytes:
                    turn.bad = f"a frame of {len(data)} bytes, not {frame_bytes}"
                chunks += 1
                if leave and chunks == 2:
                    report.sessions_cut += 1
                    hang_up(ws, rng)
                    return
                if barge_in and chunks == 2:
                    await ws.send(json.dumps({"type": "cancel"}))
                continue
            event = json.loads(msg)
            turn = turns.get(event.get("turn_id"))
            if event["type"] == "turn.started":
                current = turn
            elif event["type"] == "error" and turn is not None:
                if event["code"] == "overloaded":
                    turn.refused = True
                else:
                    turn.bad = f"error {event['code']}: {event['message']}"
            elif event["type"] == "error":
                report.problem("lost", f"the session failed: {event}")
                return
            elif event["type"] == "turn.done":
                pending.discard(turn.id)
                check(turn, event, args, report)
    finally:
        await ws.close()             # at once after a hang-up


def check(turn: Turn, done: dict, args, report: Report) -> None:
    report.turns += 1
    reason = done["reason"]
    if turn.refused and reason == "error":
        report.turns_refused += 1
    elif reason == "error":
        report.problem("lost", f"turn {turn.id} ended with an error: {turn.bad}")
    elif turn.samples != done["samples"]:
        report.problem("garbled", f"turn {turn.id}: {turn.samples} samples received, turn.done says {done['samples']}")
    elif turn.bad:
        report.problem("garbled", f"turn {turn.id}: {turn.bad}")
    elif reason == "cancelled":
        report.turns_cancelled += 1
    elif reason == "max_frames" and args.max_frames and done["frames"] != args.max_frames:
        report.problem("garbled", f"turn {turn.id}: max_frames after {done['frames']} of {args.max_frames} frames")
    else:
        report.turns_ok += 1
        report.audio_s += done["audio_ms"] / 1000


async def rest_request(client: httpx.AsyncClient, args, rng: random.Random, report: Report) -> None:
    report.rest_requests += 1
    body = {"input": rng.choice(SENTENCES), "response_format": rng.choice(["wav", "pcm", "flac"])}
    if args.max_frames:
        body["max_frames"] = args.max_frames
    r = await client.post("/v1/audio/speech", json=body)
    if r.status_code not in (200, 503):
        report.rest_failed += 1
        report.problem("lost", f"REST {r.status_code}: {r.text[:200]}")


async def observe(client: httpx.AsyncClient) -> list:
    metrics = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for s in family.samples:
            metrics.setdefault(s.name, s.value)
    health = (await client.get("/health")).json()
    return [metrics.get("process_resident_memory_bytes", 0) / 2**20, int(metrics.get("process_open_fds", 0)),
            health.get("active_sessions", 0), health.get("batch_active", 0), health.get("queue_depth", 0)]


async def run(args) -> Report:
    report = Report()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = ws_url(args.url)
    base = args.url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    end = t0 + args.duration
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=args.timeout) as client:
        first = await observe(client)
        report.samples.append([0.0, *first])

        async def worker(i: int) -> None:
            wrng = random.Random(rng.randrange(1 << 30) + i)
            while time.monotonic() < end:
                try:
                    if wrng.random() < args.rest_rate:
                        await rest_request(client, args, wrng, report)
                    else:
                        await session(url, args, wrng, report, headers)
                except (asyncio.TimeoutError, websockets.exceptions.WebSocketException, OSError, httpx.HTTPError) as e:
                    report.problem("lost", f"session failed: {e!r}")

        async def sampler() -> None:
            while time.monotonic() < end:
                await asyncio.sleep(args.sample_every)
                report.samples.append([round(time.monotonic() - t0, 1), *await observe(client)])
        await asyncio.gather(sampler(), *(worker(i) for i in range(args.concurrency)))
        report.duration_s = round(time.monotonic() - t0, 1)
        deadline = time.monotonic() + args.settle          # the clients are gone: the server must be idle
        while True:                                         # and its sockets closed (closing takes a moment)
            last = await observe(client)
            if (last[2:] == [0, 0, 0] and last[1] <= first[1] + FD_SLACK) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        report.samples.append([round(time.monotonic() - t0, 1), *last])
    report.leaked_sessions, report.leaked_slots, report.leaked_queue = last[2:]
    report.memory_start_mb, report.fds_start = round(first[0], 1), first[1]
    report.memory_end_mb, report.fds_end = round(last[0], 1), last[1]
    report.memory_max_mb = round(max(s[1] for s in report.samples), 1)
    report.audio_s = round(report.audio_s, 1)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8090", help="server base URL")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="sessions open at once")
    p.add_argument("--max-turns", type=int, default=3, help="most turns per session")
    p.add_argument("--max-frames", type=int, default=None, help="cap each turn at this many 80 ms frames")
    p.add_argument("--churn", type=float, default=0.2, help="share of sessions that hang up mid-turn")
    p.add_argument("--cancel-rate", type=float, default=0.15, help="share of sessions that barge in (cancel)")
    p.add_argument("--rest-rate", type=float, default=0.1, help="share of requests made over REST instead")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--settle", type=float, default=30.0, help="seconds the server gets to become idle at the end")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one message")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here ('-': stdout)")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    out = asdict(report)
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    print(f"{report.sessions} sessions ({report.sessions_cut} cut), {report.turns} turns ({report.turns_ok} ok, "
          f"{report.turns_cancelled} cancelled, {report.turns_refused} refused), {report.rest_requests} REST in "
          f"{report.duration_s} s, {report.audio_s} s of audio; lost {report.lost}, garbled {report.garbled}; "
          f"memory {report.memory_start_mb} -> {report.memory_end_mb} MB (max {report.memory_max_mb}), "
          f"fds {report.fds_start} -> {report.fds_end}; leaked slots {report.leaked_slots}, sessions "
          f"{report.leaked_sessions}, queue {report.leaked_queue}", file=sys.stderr)
    for line in report.problems:
        print("  " + line, file=sys.stderr)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
