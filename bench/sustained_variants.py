"""A steady load through one scheduler in variants of its iteration, one after the other in one process
(one warm-up), with the time to first audio of a session arriving at an idle server in each.

Under a steady load sessions join and leave frame by frame. The host launches step N+1, then reads
step N back; whatever it waits for in between leaves the GPU idle while it works. The variants:
- `as-is`: the scheduler as it ships;
- `no-first-window-path`: never read the step in flight back before launching the next one (the
  scheduler does when that step closes some session's first window, to send it a step sooner; under
  a steady load a session joins almost every frame, so almost every iteration does);
- `windows-after-next-step`: each window takes its codes on the step's stream, behind the step
  launched after its frames' (as before the twentieth session), instead of on the vocoder's stream
  once its frames are in (`StreamingVocoder.decode`'s `after`);
- `audio-after-windows`: the last iteration's audio sent after this one's windows are launched, not
  before the step is read back (`Scheduler.audio_after_windows`);
- `deferred-audio-N`: each window's audio sent once it has landed, looked for each iteration, and
  waited for only where it must be, or once N iterations late (`Scheduler.defer_audio`).
(The vocoder's stream at high priority bought nothing: DL, bench/README.md.)
Each row has the load's `rtf_steady` (`bench.throughput.run_sustained`), the engine thread's seconds per
iteration in each phase (`SchedulerStats.host_seconds`) and the idle server's median time to first audio.

    python -m bench.sustained_variants --model-dir /tmp/rand06b --slots 256 --turns 640 --out results.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import re
import time
from unittest import mock

import numpy as np

from bench.results import emit
from bench.throughput import add_steady_load_args, run_sustained, steady_load
from engine.requests import SamplingParams, SpeechRequest
from engine.scheduler import Scheduler


VARIANTS = ("as-is", "no-first-window-path", "windows-after-next-step", "audio-after-windows", "deferred-audio-4")


def known(name: str) -> bool:
    """Whether `name` is a variant: one of VARIANTS, or deferred-audio-N for any N."""
    return name in VARIANTS or re.fullmatch(r"deferred-audio-\d+", name) is not None


@contextlib.contextmanager
def variant(scheduler: Scheduler, name: str):
    """The scheduler changed as `name` (one of VARIANTS) says while the context lasts."""
    vocoder = scheduler.vocoder
    if name == "no-first-window-path":
        with mock.patch.object(vocoder, "first_window_closes", lambda slots: False):
            yield
    elif name == "windows-after-next-step":
        decode = vocoder.decode
        with mock.patch.object(vocoder, "decode", lambda slots, frames, after=None: decode(slots, frames)):
            yield
    elif name == "audio-after-windows":
        with mock.patch.object(scheduler, "audio_after_windows", True):
            yield
    elif name.startswith("deferred-audio-"):
        with mock.patch.object(scheduler, "defer_audio", int(name.rsplit("-", 1)[1])):
            yield
    else:
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
    add_steady_load_args(ap, turns=640)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, of " + ", ".join(VARIANTS) + " (deferred-audio-N: any N)")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [name for name in names if not known(name)]
    if unknown:
        ap.error(f"unknown variants: {', '.join(unknown)}")
    with steady_load(args) as (scheduler, voice):
        for name in names:
            emit({"peer": "qwen3-tts-server", "kind": "sustained_variant", "device": args.device,
                  **run_variant(scheduler, voice, name, args.turns, args.slots, args.frames)}, args.out)


if __name__ == "__main__":
    main()
