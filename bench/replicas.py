"""Aggregate throughput through the network front door: a server, or the replica router.

For each session count C, C WebSocket sessions are opened and configured first; then all of them
start one fixed-length turn at the same instant (EOS suppressed, `--frames` frames each) and the
wall time runs until the last `turn.done`. Audio seconds per wall second over all sessions is the
aggregate real-time factor; the `x-replica` header of each session shows how the router spread them.
Run it against one GPU and then two to see the scaling:

    python -m app.replicas.launcher --gpus 1 --port 8090 --model-dir models/0.6b-base &
    python -m bench.replicas --url ws://127.0.0.1:8090 --sessions 32,64,128 --frames 125 --tag 1gpu
    python -m app.replicas.launcher --gpus 2 --port 8090 --model-dir models/0.6b-base &
    python -m bench.replicas --url ws://127.0.0.1:8090 --sessions 32,64,128,256 --frames 125 --tag 2gpu
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter

from websockets.asyncio.client import connect

from bench.throughput import FRAME_S, TEXTS
from bench.results import emit

WS_PATH = "/v1/audio/speech/ws"


async def _session(url: str, i: int, frames: int, ready: asyncio.Barrier, start: asyncio.Event) -> dict:
    async with connect(url + WS_PATH, max_size=None, open_timeout=60) as ws:
        replica = ws.response.headers.get("x-replica", url)
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "language": "english", "max_frames": frames,
                                  "sampling": {"seed": i, "min_new_tokens": frames + 2}}))
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        await ready.wait()
        await start.wait()
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "text", "turn_id": "t", "text": TEXTS[i % len(TEXTS)], "final": True}))
        first = None
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                first = first or time.perf_counter() - t0
                continue
            event = json.loads(message)
            if event["type"] == "error":
                raise RuntimeError(f"session {i}: {event}")
            if event["type"] == "turn.done":
                return {"replica": replica, "frames": event["frames"], "ttfa_s": first,
                        "done": time.perf_counter()}


async def run(url: str, sessions: int, frames: int) -> dict:
    """One round of `sessions` concurrent fixed-length turns; the row of numbers it measured."""
    ready, start = asyncio.Barrier(sessions + 1), asyncio.Event()
    tasks = [asyncio.create_task(_session(url, i, frames, ready, start)) for i in range(sessions)]
    await ready.wait()                      # every session connected and configured
    t0 = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks)
    wall = max(r["done"] for r in results) - t0
    total = sum(r["frames"] for r in results)
    ttfa = [r["ttfa_s"] for r in results if r["ttfa_s"] is not None]
    return {"sessions": sessions, "frames_total": total, "wall_s": round(wall, 3),
            "rtf_aggregate": round(total * FRAME_S / wall, 3),
            "rtf_per_session": round(total * FRAME_S / sessions / wall, 3),
            "ttfa_median_s": round(statistics.median(ttfa), 4) if ttfa else None,
            "ttfa_max_s": round(max(ttfa), 4) if ttfa else None,
            "by_replica": dict(Counter(r["replica"] for r in results))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8090", help="ws:// address of a server or the router")
    ap.add_argument("--sessions", default="16,64", help="comma-separated session counts")
    ap.add_argument("--frames", type=int, default=125, help="frames per turn (125 = 10 s of audio)")
    ap.add_argument("--out", default=None, help="append JSON rows to this file")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    asyncio.run(run(args.url, 8, 4))        # warm-up: a few short turns
    for count in (int(c) for c in args.sessions.split(",")):
        row = {"peer": "qwen3-tts-server", "kind": "run", "mode": "websocket", "tag": args.tag,
               "url": args.url, "frames": args.frames, **asyncio.run(run(args.url, count, args.frames))}
        emit(row, args.out)


if __name__ == "__main__":
    main()
