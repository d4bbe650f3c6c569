"""Where a steady load's frames go on the GPU: each CUDA stream's busy time and the GPU's idle time in
served iterations, from the kernel timeline.

Through 256 slots of an H100 a steady load (turns ending and joining frame by frame) ran at 915x where
turns started together ran at 1,164x (bench/README.md, call DM). The missing time is either more GPU
work (prefills, the small windows of new sessions) or the GPU waiting for the host; the timeline of a
few dozen iterations in the middle of such a load tells which: per decode step, the wall time, the
time any kernel ran (the union over streams), each stream's busy time and its kernels, and the GPU time
of the kernels each phase of the iteration launched (admission, prefill, step launch, ...).

    python -m bench.steady_timeline --model-dir /tmp/rand06b --slots 256 --turns 1024 --out results.jsonl
"""
from __future__ import annotations

import argparse
import collections
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.results import emit
from bench.throughput import add_steady_load_args, run_sustained, steady_load
from engine.scheduler import Scheduler


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by the union of [start, end) intervals."""
    total, covered_to = 0, None
    for start, end in sorted(intervals):
        if covered_to is None or start >= covered_to:
            total += end - start
            covered_to = end
        elif end > covered_to:
            total += end - covered_to
            covered_to = end
    return total


def gpu_activity(prof) -> list[tuple[int, int, int, str]]:
    """(start ns, end ns, stream, name) of every kernel, copy and memset the profile saw on the GPU."""
    return [(e.start_ns(), e.end_ns(), e.device_resource_id(), e.name())
            for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.end_ns() > e.start_ns()]


def summarize(activity: list[tuple[int, int, int, str]], steps: int, wall_ns: int, top: int = 12) -> dict:
    """Per decode step: the wall time, the time some kernel ran, the idle rest, and each stream's busy
    time with its largest kernels (ms a step)."""
    per_step = max(steps, 1) * 1e6
    streams = collections.defaultdict(list)
    for start, end, stream, name in activity:
        streams[stream].append((start, end, name))
    by_stream = {}
    for stream, runs in streams.items():
        kernels = collections.Counter()
        for start, end, name in runs:
            kernels[name[:80]] += end - start
        by_stream[str(stream)] = dict(busy_ms=round(busy_ns([(s, e) for s, e, _ in runs]) / per_step, 3),
                                      kernels=len(runs) / max(steps, 1),
                                      top={name: round(ns / per_step, 3) for name, ns in kernels.most_common(top)})
    busy = busy_ns([(s, e) for s, e, _, _ in activity]) / per_step
    wall = wall_ns / per_step
    return dict(steps=steps, wall_ms_per_step=round(wall, 3), gpu_busy_ms_per_step=round(busy, 3),
                gpu_idle_ms_per_step=round(wall - busy, 3), streams=by_stream)


def phase_gpu_ms(events, steps: int) -> dict:
    """GPU ms a step of the kernels that each phase of the engine's iteration launched, from a profile's
    events (`prof.events()`, CPU and CUDA activity): the `engine.<phase>` ranges the scheduler opens
    while a profiler runs, each with the kernels of the launches inside it (a CUDA graph's too)."""
    totals = collections.Counter()
    for e in events:
        if e.name.startswith("engine."):
            totals[e.name[len("engine."):]] += e.device_time_total / 1000
    return {name: round(ms / max(steps, 1), 3) for name, ms in sorted(totals.items())}


def _profile_steps(scheduler: Scheduler, load: threading.Thread, steps: int, activities: list) -> tuple:
    """A profile of the next `steps` decode steps (fewer if the load ends first): (profile, wall ns, steps)."""
    with profile(activities=activities) as prof:
        t0, start = time.perf_counter_ns(), scheduler.stats().steps
        while scheduler.stats().steps < start + steps and load.is_alive():
            time.sleep(0.0005)
        wall, done = time.perf_counter_ns() - t0, scheduler.stats().steps - start
    return prof, wall, done


def _profile_engine_thread(scheduler: Scheduler, load: threading.Thread, steps: int, activities: list) -> tuple:
    """A profile of the next `steps` decode steps that the engine thread starts and stops itself, between
    two iterations: a profiler records the host calls (and the scheduler's phase ranges) of the thread
    that started it only. (profile, steps)."""
    iterate, state, finished = scheduler._iterate, {}, threading.Event()

    def finish():
        del scheduler._iterate                          # the class's method again
        if "prof" in state:
            state["prof"].__exit__(None, None, None)
            state["steps"] = scheduler.stats().steps - state["start"]
        finished.set()

    def profiled_iterate():
        if "prof" not in state:
            state["prof"] = profile(activities=activities)
            state["prof"].__enter__()
            state["start"] = scheduler.stats().steps
        iterate()
        if scheduler.stats().steps >= state["start"] + steps:
            finish()

    scheduler._iterate = profiled_iterate
    while not finished.wait(0.01) and load.is_alive():
        pass
    if not finished.is_set():        # the load ended first; the engine thread idles once it has
        load.join()
        finish()
    return state.get("prof"), state.get("steps", 0)


def profile_steady(scheduler: Scheduler, voice, turns: int, slots: int, frames: int, steps: int) -> dict:
    """`turns` turns through `slots` slots (`bench.throughput.run_sustained`), profiled for `steps`
    decode steps from the first turn's end on (every slot busy, turns joining and ending): the GPU's
    kernels alone, then for `steps` // 2 more with the engine thread's host calls as well, which slow
    the host further but tell which phase of the iteration launched each kernel (`phase_gpu_ms`)."""
    load = threading.Thread(target=run_sustained, args=(scheduler, voice, turns, slots, frames, 0))
    load.start()
    first_end = int(frames * 0.75) + 8          # the shortest turn of the first slots has ended by then
    while scheduler.stats().steps < first_end and load.is_alive():
        time.sleep(0.001)
    gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    prof, wall, done = _profile_steps(scheduler, load, steps, gpu or [ProfilerActivity.CPU])
    by_phase, phase_steps = _profile_engine_thread(scheduler, load, max(steps // 2, 1), [ProfilerActivity.CPU, *gpu])
    load.join()
    return dict(slots=slots, turns=turns, **summarize(gpu_activity(prof), done, wall),
                gpu_ms_by_phase=phase_gpu_ms(by_phase.events() if by_phase else [], phase_steps),
                phase_steps=phase_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_steady_load_args(ap, turns=1024)
    ap.add_argument("--steps", type=int, default=48, help="decode steps to profile")
    args = ap.parse_args()
    with steady_load(args) as (scheduler, voice):
        emit({"peer": "qwen3-tts-server", "kind": "steady_timeline", "device": args.device,
              **profile_steady(scheduler, voice, args.turns, args.slots, args.frames, args.steps)}, args.out)


if __name__ == "__main__":
    main()
