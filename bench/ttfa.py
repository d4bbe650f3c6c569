"""Time to first audio under load: N WebSocket sessions against a running server.

    python bench/ttfa.py --url http://127.0.0.1:8090 --sessions 64 --rate 8 --text-chars 200 --json out.json

Sessions arrive as a Poisson process of `--rate` per second (0: all at once). Each speaks `--turns`
turns of about `--text-chars` characters, one after another, and measures on the client:
- TTFA: from sending a turn's text to its first audio byte;
- real-time factor: the turn's audio seconds / (turn.done time - send time);
- underruns: a listener starts playing at the first audio and plays in real time; an audio message
  that arrives after everything before it has finished playing is an underrun (playback resumes then).
Prints p50/p95/p99 TTFA, RTF and underrun totals; `--json` writes every turn as well. The server's own
underrun count over the run (`qwen3_tts_underruns_total` of /metrics: chunks ready after the audio
before them would have played) is reported beside the client's, which also counts the client's and
the network's delays.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import websockets

WS_PATH = "/v1/audio/speech/ws"
BYTES_PER_SAMPLE = {"pcm_s16le": 2, "f32le": 4, "mulaw": 1, "alaw": 1}
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "A journey of a thousand miles begins with a single step.",
    "Please call me back when you have a moment to talk.", "The weather today is sunny with a light breeze.",
    "Our meeting has been moved to three o'clock on Thursday.", "Thank you for waiting, your order is on its way.",
]


def server_underruns(url: str, api_key: Optional[str]) -> Optional[float]:
    """qwen3_tts_underruns_total from the server's /metrics (None if it cannot be read)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    request = urllib.request.Request(urlunsplit((scheme, parts.netloc, "/metrics", "", "")))
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("qwen3_tts_underruns_total "):
            return float(line.split()[1])
    return None


def ws_url(url: str) -> str:
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def make_text(chars: int, rng: random.Random) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words += rng.choice(SENTENCES).split()
    text, out = "", []
    for w in words:
        if len(text) + len(w) + 1 > chars and out:
            break
        out.append(w)
        text = " ".join(out)
    return text


@dataclass
class TurnStats:
    session: int
    turn: int
    chars: int
    ttfa_ms: Optional[float] = None
    audio_s: float = 0.0
    wall_s: float = 0.0
    rtf: float = 0.0
    underruns: int = 0
    dry: list = field(default_factory=list)     # each underrun: (audio s delivered before it, ms playback stood still)
    reason: Optional[str] = None
    server_ttfa_ms: Optional[float] = None
    error: Optional[str] = None


@dataclass
class Playback:
    """The listener's clock (see the module docstring); `dry` says where each underrun fell in the turn
    (after how many seconds of audio: 0.16 is the second chunk of a 2-frame first window) and how long
    playback stood still."""
    rate: int
    start: Optional[float] = None
    samples: int = 0
    underruns: int = 0
    dry: list = field(default_factory=list)

    def add(self, now: float, samples: int) -> None:
        if self.start is None:
            self.start = now
        elif now - self.start > self.samples / self.rate:
            self.underruns += 1
            played = self.samples / self.rate
            self.dry.append((round(played, 3), round((now - self.start - played) * 1000, 1)))
            self.start = now - played
        self.samples += samples


async def run_session(index: int, args, rng: random.Random, results: list) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    width = BYTES_PER_SAMPLE[args.encoding]
    try:
        async with websockets.connect(ws_url(args.url), additional_headers=headers, max_size=None, compression=None,
                                      open_timeout=args.timeout) as ws:
            json.loads(await ws.recv())                     # session.created
            update = {"type": "session.update", "format": {"encoding": args.encoding, "sample_rate": args.sample_rate}}
            sampling = {}
            if args.temperature is not None:
                sampling["temperature"] = args.temperature
            if args.fixed_length:
                sampling["min_new_tokens"] = args.max_frames + 2
            if sampling:
                update["sampling"] = sampling
            if args.max_frames:
                update["max_frames"] = args.max_frames
            if args.voice:
                update["voice"] = args.voice
            await ws.send(json.dumps(update))
            for turn in range(args.turns):
                text = make_text(args.text_chars, rng)
                stats = TurnStats(index, turn, len(text))
                results.append(stats)
                play = Playback(args.sample_rate)
                sent = time.perf_counter()
                await ws.send(json.dumps({"type": "text", "turn_id": f"t{turn}", "text": text, "final": True}))
                while True:
                    msg = await asyncio.wait_for(ws.recv(), args.timeout)
                    now = time.perf_counter()
                    if isinstance(msg, bytes):
                        if stats.ttfa_ms is None:
                            stats.ttfa_ms = (now - sent) * 1000
                        play.add(now, len(msg) // width)
                        continue
                    event = json.loads(msg)
                    if event["type"] == "error":
                        stats.error = f"{event['code']}: {event['message']}"
                        if event.get("fatal"):
                            return
                    elif event["type"] == "turn.done":
                        stats.reason = event["reason"]
                        stats.server_ttfa_ms = event.get("ttfa_ms")
                        break
                stats.wall_s = time.perf_counter() - sent
                stats.audio_s = play.samples / args.sample_rate
                stats.rtf = stats.audio_s / stats.wall_s if stats.wall_s > 0 else 0.0
                stats.underruns, stats.dry = play.underruns, play.dry
    except Exception as e:      # a failed session is a result too
        results.append(TurnStats(index, -1, 0, error=f"{type(e).__name__}: {e}"))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def summarize(results: list[TurnStats], wall_s: float) -> dict:
    ok = [r for r in results if r.ttfa_ms is not None and r.reason is not None]
    audio = sum(r.audio_s for r in ok)
    return {
        "turns": len([r for r in results if r.turn >= 0]), "turns_ok": len(ok),
        "errors": sorted({r.error for r in results if r.error}),
        "ttfa_ms": percentiles([r.ttfa_ms for r in ok]),
        "server_ttfa_ms": percentiles([r.server_ttfa_ms for r in ok if r.server_ttfa_ms is not None]),
        "rtf": {**percentiles([r.rtf for r in ok]), "min": min((r.rtf for r in ok), default=None)},
        "underruns": sum(r.underruns for r in ok), "turns_with_underruns": sum(1 for r in ok if r.underruns),
        "dry": [[r.session, r.turn, *d] for r in ok for d in r.dry],     # (session, turn, audio s before, ms still)
        "audio_s": audio, "wall_s": wall_s, "aggregate_rtf": audio / wall_s if wall_s > 0 else 0.0,
    }


async def run(args) -> dict:
    rng = random.Random(args.seed)
    results: list[TurnStats] = []
    tasks = []
    before = await asyncio.to_thread(server_underruns, args.url, args.api_key)
    t0 = time.perf_counter()
    for i in range(args.sessions):
        tasks.append(asyncio.create_task(run_session(i, args, random.Random(rng.random()), results)))
        if args.rate > 0 and i + 1 < args.sessions:
            await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    summary = summarize(results, wall)
    after = await asyncio.to_thread(server_underruns, args.url, args.api_key)
    summary["server_underruns"] = after - before if None not in (before, after) else None
    return {"config": {k: v for k, v in vars(args).items() if k not in ("api_key", "json")},
            "summary": summary, "turns": [asdict(r) for r in results]}


def print_summary(summary: dict) -> None:
    def fmt(d):
        return " ".join(f"{k} {v:.1f}" if v is not None else f"{k} -" for k, v in d.items())
    print(f"turns {summary['turns_ok']}/{summary['turns']} ok; errors: {summary['errors'] or 'none'}")
    print(f"TTFA ms (client): {fmt(summary['ttfa_ms'])}")
    print(f"TTFA ms (server): {fmt(summary['server_ttfa_ms'])}")
    print(f"RTF per turn:     {fmt(summary['rtf'])}")
    server = summary.get("server_underruns")
    print(f"underruns {summary['underruns']} in {summary['turns_with_underruns']} turns "
          f"(server-side: {'-' if server is None else int(server)}); "
          f"audio {summary['audio_s']:.1f} s in {summary['wall_s']:.1f} s (aggregate x{summary['aggregate_rtf']:.1f})")
    for session, turn, at_s, ms in summary["dry"][:20]:
        print(f"  ran dry: session {session} turn {turn} after {at_s:.2f} s of audio, for {ms:.0f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8090", help="server base URL (http/ws) or the socket URL")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.0, help="session arrivals per second (Poisson); 0: all at once")
    p.add_argument("--turns", type=int, default=1, help="turns per session, one after another")
    p.add_argument("--text-chars", type=int, default=120, help="characters per turn")
    p.add_argument("--max-frames", type=int, default=None, help="cap each turn at this many 80 ms frames")
    p.add_argument("--fixed-length", action="store_true", help="suppress EOS: every turn runs --max-frames frames")
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (default: the model's)")
    p.add_argument("--voice", default=None)
    p.add_argument("--encoding", default="pcm_s16le", choices=list(BYTES_PER_SAMPLE))
    p.add_argument("--sample-rate", type=int, default=24000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one message")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary and every turn to this file ('-': stdout)")
    args = p.parse_args(argv)
    if args.fixed_length and not args.max_frames:
        p.error("--fixed-length needs --max-frames")
    report = asyncio.run(run(args))
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print_summary(report["summary"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0 if report["summary"]["turns_ok"] == report["summary"]["turns"] else 1


if __name__ == "__main__":
    sys.exit(main())
