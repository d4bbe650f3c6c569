"""Where the time to first audio goes, and a steady-state frame's, phase by phase.

Drives a `Scheduler` in this thread (no engine thread, no server) for a burst of `--sessions`
requests submitted at once (default one) and times each phase of every engine iteration with the
device synchronized after it: admission (prompt build, slot state, the KV cache's page reservation),
prefill (talker forward over the prompts, first c0), the decode step and the vocoder windows, plus
the host work between them. The first rows sum the iterations up to the burst's last first audio
chunk (and say how many KV chunks were allocated meanwhile); the steady-state row averages the
iterations after it.

    python -m bench.first_audio --model-dir /tmp/rand06b --reps 5
    python -m bench.first_audio --model-dir /tmp/rand06b --reps 2 --sessions 256 --profile
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.loader import load_model
from engine.requests import SamplingParams, SpeechRequest
from engine.scheduler import Scheduler
from bench.results import emit

PHASES = ("_apply_commands", "_admit", "_prefill", "_launch_step", "_send_audio", "_take_step", "_launch_windows")
TEXT = "Please remember to bring your umbrella tomorrow, because the forecast says it will rain all afternoon."


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_phases(scheduler: Scheduler, log: dict) -> None:
    """Wrap the scheduler's phase methods so each adds its synchronized wall time to log[name]."""
    for name in PHASES:
        inner = getattr(scheduler, name)

        def wrapper(*args, _inner=inner, _name=name, **kw):
            t = time.perf_counter()
            out = _inner(*args, **kw)
            sync(scheduler.device)
            log[_name] = log.get(_name, 0.0) + (time.perf_counter() - t) * 1000
            return out
        setattr(scheduler, name, wrapper)


def burst(scheduler: Scheduler, voice, frames: int, seed: int, sessions: int = 1) -> dict:
    """Phases (ms) of the iterations up to the burst's last first chunk, and the mean of the later ones."""
    log: dict = {}
    timed_phases(scheduler, log)
    cache = scheduler.runner.cache
    chunks_before = cache.chunks_held
    t0 = time.perf_counter()
    handles = [scheduler.submit(SpeechRequest(text=TEXT, voice=voice, language="english", max_frames=frames,
                                              sampling=SamplingParams(seed=seed + i, min_new_tokens=frames + 2)))
               for i in range(sessions)]
    firsts: dict[int, float] = {}
    iterations, later = 0, []
    while True:
        before = dict(log)
        t = time.perf_counter()
        scheduler._apply_commands(block=False)
        scheduler._iterate()
        iterations += 1
        all_started = len(firsts) == sessions
        for i, h in enumerate(handles):
            if i not in firsts and h._session.outbox._items:
                firsts[i] = (time.perf_counter() - t0) * 1000
        if not all_started and len(firsts) == sessions:
            head = {k: round(v, 2) for k, v in log.items()}
            head["iterations"] = iterations
            head["kv_chunks_allocated"] = cache.chunks_held - chunks_before
        elif all_started:
            later.append({k: log.get(k, 0.0) - before.get(k, 0.0) for k in PHASES} | {"wall": (time.perf_counter() - t) * 1000})
        if all(h._session.closed for h in handles):
            break
    steady = {k: round(statistics.mean(r[k] for r in later), 3) for k in (*PHASES, "wall")} if later else {}
    for name in PHASES:                  # unwrap
        delattr(scheduler, name)
    first = sorted(firsts.values())
    return dict(sessions=sessions, first_audio_ms=round(first[len(first) // 2], 2), last_first_audio_ms=round(first[-1], 2),
                first_audio_phases_ms=head, steady_iteration_ms=steady, frames=frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=1, help="requests submitted at once")
    ap.add_argument("--prefill-budget", type=int, default=None, help="the scheduler's prompt positions per iteration")
    ap.add_argument("--profile", action="store_true", help="then profile one more burst (torch.profiler tables)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = load_model(args.model_dir, device=args.device, dtype=getattr(torch, args.dtype))
    voice = model.make_voice(np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1, 24000)
    scheduler = Scheduler(model, max_batch=args.sessions,
                          **({"prefill_budget": args.prefill_budget} if args.prefill_budget else {}))
    scheduler.warmup()
    burst(scheduler, voice, 8, 0)     # allocator, lazy inits
    rows = [burst(scheduler, voice, args.frames, 1000 * (rep + 1), args.sessions) for rep in range(args.reps)]
    best = min(rows, key=lambda r: r["first_audio_ms"])
    row = {"peer": "qwen3-tts-server", "kind": "first_audio", "device": args.device, "dtype": args.dtype,
           "prefill_budget": scheduler.prefill_budget,
           "first_audio_ms_median": statistics.median(r["first_audio_ms"] for r in rows), **best}
    emit(row, args.out)
    if args.profile:
        with torch.profiler.profile() as prof:
            burst(scheduler, voice, args.frames, 0, args.sessions)
        for key in ("cpu_time_total", "self_cpu_time_total", "device_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)


if __name__ == "__main__":
    main()
