"""A steady load through one scheduler in variants of its iteration, one after the other in one process
(one warm-up), with the time to first audio of a session arriving at an idle server in each.

Under a steady load sessions join and leave frame by frame. The host launches step N+1, then reads
step N back; whatever it waits for in between leaves the GPU idle while it works. The variants:
- `as-is`: the scheduler as it ships;
- `no-first-window-path`: never read the step in flight back before launching the next one (the
  scheduler does when that step closes some session's first window, to send it a step sooner; under
  a steady load a session joins almost every frame, so almost every iteration does);
- `vocoder-priority` (CUDA): the vocoder's stream at high priority, so a first window's kernels go
  ahead of the step's queued ones without the step waiting for the host;
- `both` (CUDA).
Each row has the load's `rtf_steady` (`bench.throughput.run_sustained`), the engine thread's seconds per
iteration in each phase (`SchedulerStats.host_seconds`) and the idle server's median time to first audio.

    python -m bench.sustained_variants --model-dir /tmp/rand06b --slots 256 --turns 640 --out results.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import numpy as np
import torch

from bench.results import emit
from bench.throughput import run_sustained
from engine.loader import load_model
from engine.requests import SamplingParams, SpeechRequest
from engine.scheduler import Scheduler


# name -> (without the first-window read-back, the vocoder stream at high priority: CUDA only)
VARIANTS = {"as-is": (False, False), "no-first-window-path": (True, False), "vocoder-priority": (False, True),
            "both": (True, True)}


@contextlib.contextmanager
def variant(scheduler: Scheduler, name: str):
    """The scheduler changed as `name` (one of VARIANTS) says while the context lasts."""
    no_first_window_path, vocoder_priority = VARIANTS[name]
    with contextlib.ExitStack() as stack:
        if no_first_window_path:
            stack.enter_context(mock.patch.object(scheduler.vocoder, "first_window_closes", lambda slots: False))
        if vocoder_priority:
            vocoder_stream = scheduler.vocoder.stream
            torch.cuda.synchronize()           # the old stream's work done before the new one takes over
            stack.enter_context(mock.patch.object(vocoder_stream, "stream", torch.cuda.Stream(priority=-1)))
            stack.callback(torch.cuda.synchronize)
        yield


def first_audio_ms(scheduler: Scheduler, voice, reps: int = 6) -> float:
    """Median time from submit to the first chunk of a turn on the idle scheduler."""
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        handle = scheduler.submit(SpeechRequest(text="Hello there, a short turn on an idle server.", voice=voice,
                                                language="english", max_frames=24,
                                                sampling=SamplingParams(seed=i, min_new_tokens=24)))
        handle.get(timeout=120)
        times.append(time.perf_counter() - t0)
        handle.collect(timeout=120)
    return 1000 * float(np.median(times))


def run_variant(scheduler: Scheduler, voice, name: str, turns: int, slots: int, frames: int) -> dict:
    with variant(scheduler, name):
        before = scheduler.stats()
        row = run_sustained(scheduler, voice, turns, slots, frames, seed0=0)
        after = scheduler.stats()
        ttfa = first_audio_ms(scheduler, voice)
    iterations = max(after.steps - before.steps, 1)
    host = {phase: round(1000 * (t - before.host_seconds.get(phase, 0.0)) / iterations, 3)
            for phase, t in after.host_seconds.items()}
    return dict(variant=name, **row, host_ms_per_step=host, ttfa_idle_ms=round(ttfa, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--turns", type=int, default=640)
    ap.add_argument("--frames", type=int, default=125, help="mean frames a turn (+-25%%)")
    ap.add_argument("--vocoder-batch", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.variants.split(",")
    if set(names) - set(VARIANTS):
        ap.error(f"unknown variants: {', '.join(sorted(set(names) - set(VARIANTS)))}")

    cuda = torch.device(args.device).type == "cuda"
    model = load_model(args.model_dir, device=args.device, dtype=getattr(torch, args.dtype))
    voice = model.make_voice(np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1, 24000)
    scheduler = Scheduler(model, max_batch=args.slots, vocoder_batch=args.vocoder_batch,
                          max_queue=max(1024, args.turns))
    scheduler.warmup(max_live=int(args.frames * 1.25) + 128)
    with scheduler:
        run_sustained(scheduler, voice, args.slots + args.slots // 2, args.slots, 8, seed0=99)   # the allocator warmed
        for name in names:
            if VARIANTS[name][1] and not cuda:     # stream priorities are CUDA's
                continue
            emit({"peer": "qwen3-tts-server", "kind": "sustained_variant", "device": args.device,
                  **run_variant(scheduler, voice, name, args.turns, args.slots, args.frames)}, args.out)


if __name__ == "__main__":
    main()
