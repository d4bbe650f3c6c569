"""Aggregate throughput through the scheduler: audio seconds produced per wall second, by batch size.

For each batch size B, B turns of a fixed length (EOS suppressed, `--frames` frames each) are
submitted at once to one `engine.scheduler.Scheduler`; the wall time runs from submission until the
last chunk of the last turn has been delivered, so it includes prefill, every decode step and the
streaming vocoder. Also reports idle and peak GPU memory. With `--sustained N`, N turns of varied
lengths then go through the largest batch's slots at once (a server under steady load: turns end and
queued ones join frame by frame), with the audio rate while every slot is busy (`rtf_steady`).

    python -m bench.throughput --model-dir /tmp/rand06b --device cuda --dtype bfloat16 \
        --batches 1,16,64,256 --frames 125 --out results.jsonl

Rows are JSON lines in the format of ../shared/peers (peer "qwen3-tts-server"), so the peers'
`report.py` prints one table with theirs.
"""
from __future__ import annotations

import argparse
import contextlib
import threading
import time

import numpy as np
import torch

from engine.loader import load_model
from engine.model import kernels
from engine.requests import SamplingParams, SpeechRequest
from engine.scheduler import VOCODER_BATCH, Scheduler
from bench.results import emit

FRAME_S = 0.08
TEXTS = [
    "The quick brown fox jumps over the lazy dog while the sun sets behind the distant hills.",
    "Please remember to bring your umbrella tomorrow, because the forecast says it will rain all afternoon.",
    "Artificial speech has improved a great deal, and modern systems can now sound remarkably natural.",
    "She opened the old wooden door slowly and found a small garden full of bright yellow flowers.",
]


def gib(n: int) -> float:
    return n / 2 ** 30


def _drain_all(handles: list, t0: float) -> tuple[list, list]:
    """Every turn's stream read to its end, one reader a turn (so arrival times are real): each turn's
    chunks as (seconds since t0, samples), and its result."""
    chunks: list = [[] for _ in handles]
    results: list = [None] * len(handles)

    def drain(i: int) -> None:
        while True:
            item = handles[i].get(timeout=600)
            if hasattr(item, "pcm"):
                chunks[i].append((time.perf_counter() - t0, len(item.pcm)))
            else:
                results[i] = item
                return

    readers = [threading.Thread(target=drain, args=(i,)) for i in range(len(handles))]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    return chunks, results


def _submit(scheduler: Scheduler, voice, lengths: list[int], seed0: int) -> list:
    """One turn a length (EOS suppressed: each runs exactly its frames), all submitted at once."""
    return [scheduler.submit(SpeechRequest(text=TEXTS[i % len(TEXTS)], voice=voice, language="english",
                                           sampling=SamplingParams(seed=seed0 + i, min_new_tokens=n + 2),
                                           max_frames=n))
            for i, n in enumerate(lengths)]


def run_batch(scheduler: Scheduler, voice, batch: int, frames: int, seed0: int) -> dict:
    t0 = time.perf_counter()
    chunks, results = _drain_all(_submit(scheduler, voice, [frames] * batch, seed0), t0)
    wall = time.perf_counter() - t0
    first = [c[0][0] for c in chunks if c]
    total_frames = sum(r.frames for r in results)
    return dict(batch=batch, frames_total=total_frames, frames_per_stream=[min(r.frames for r in results),
                max(r.frames for r in results)], wall_s=wall, audio_samples=sum(n for c in chunks for _, n in c),
                rtf_aggregate=total_frames * FRAME_S / wall, rtf_per_stream=total_frames * FRAME_S / batch / wall,
                ttfa_s=float(np.median(first)), ttfa_max_s=max(first))


def run_sustained(scheduler: Scheduler, voice, turns: int, slots: int, frames: int, seed0: int) -> dict:
    """`turns` turns (more than the scheduler's `slots`) submitted at once, their lengths spread over
    frames +-25% (seeded), so that from the first turn's end until the last one's admission every slot
    is busy while turns end and queued ones join frame by frame, as on a server under steady load.
    rtf_steady is the audio delivered over that span per wall second (the batch runs' figure includes the
    ramp of admitting and prefilling all turns at once and the drain of the last ones)."""
    lengths = np.random.default_rng(seed0).integers(int(frames * 0.75), int(frames * 1.25) + 1, turns).tolist()
    t0 = time.perf_counter()
    chunks, results = _drain_all(_submit(scheduler, voice, lengths, seed0), t0)
    wall = time.perf_counter() - t0
    full_from = min(c[-1][0] for c in chunks)                     # the first turn's end: every slot filled
    full_to = max(c[0][0] for c in chunks)                        # the last turn's first audio: the queue empty
    steady = sum(n for c in chunks for t, n in c if full_from < t <= full_to)
    total_frames = sum(r.frames for r in results)
    return dict(batch=slots, turns=turns, frames_total=total_frames, wall_s=wall,
                rtf_aggregate=total_frames * FRAME_S / wall, steady_s=full_to - full_from,
                rtf_steady=steady / scheduler.model.config.sample_rate / (full_to - full_from),
                ttfa_s=float(np.median([c[0][0] for c in chunks[:slots]])))


def add_steady_load_args(ap: argparse.ArgumentParser, turns: int) -> None:
    """The options of a bench that runs steady loads (`steady_load`): model, slots, turns and their length."""
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--turns", type=int, default=turns)
    ap.add_argument("--frames", type=int, default=125, help="mean frames a turn (+-25%%)")
    ap.add_argument("--vocoder-batch", type=int, default=64, help="as the suite's throughput stage runs")
    ap.add_argument("--out", default=None)


@contextlib.contextmanager
def steady_load(args: argparse.Namespace):
    """(a started scheduler of `args.slots` slots, a voice) for `run_sustained` loads of `args.turns`
    turns: warmed up, and its allocator warmed by a short load."""
    model = load_model(args.model_dir, device=args.device, dtype=getattr(torch, args.dtype))
    voice = model.make_voice(np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1, 24000)
    scheduler = Scheduler(model, max_batch=args.slots, vocoder_batch=args.vocoder_batch,
                          max_queue=max(1024, args.turns))
    scheduler.warmup(max_live=int(args.frames * 1.25) + 128)
    with scheduler:
        run_sustained(scheduler, voice, args.slots + args.slots // 2, args.slots, 8, seed0=99)
        yield scheduler, voice


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--frames", type=int, default=125, help="frames per turn (125 = 10 s)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--sustained", type=int, default=0,
                    help="then this many turns (lengths --frames +-25%%) through the largest batch's slots, "
                         "submitted at once: the throughput of a server under steady load")
    ap.add_argument("--window", default="2,8", help="vocoder frames: first window, later windows")
    ap.add_argument("--vocoder-batch", type=int, default=VOCODER_BATCH,
                    help="most streams one vocoder graph replay decodes")
    ap.add_argument("--defer-audio", default=str(Scheduler.defer_audio),
                    help="`Scheduler.defer_audio` values to run each batch (and the sustained load) with, "
                         "comma-separated, one after the other in this process (one warm-up)")
    ap.add_argument("--out", default=None, help="append JSON rows to this file")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",")]
    defer_values = [int(v) for v in args.defer_audio.split(",")]
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model_dir, device=args.device, dtype=dtype)
    ref = np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1
    voice = model.make_voice(ref, 24000)
    cuda = torch.device(args.device).type == "cuda"
    # the sustained load submits all its turns at once: the queue holds them (2,048 overflowed the default 1,024)
    scheduler = Scheduler(model, max_batch=max(batches), window_frames=tuple(int(w) for w in args.window.split(",")),
                          vocoder_batch=args.vocoder_batch, max_queue=max(1024, args.sustained))
    t = time.perf_counter()
    graphs = scheduler.warmup(max_live=args.frames + 128)
    warmup_s = time.perf_counter() - t
    print(f"warm-up: {graphs} CUDA graphs in {warmup_s:.1f} s", flush=True)
    scheduler.start()

    def emit_row(row: dict) -> None:
        emit({"peer": "qwen3-tts-server", "tag": args.tag, "vocoder_batch": args.vocoder_batch, **row}, args.out)

    # what a server's start costs: graph captures, and on a fresh machine Triton's compiles
    emit_row(dict(kind="warmup", graphs=graphs, seconds=round(warmup_s, 1), triton_compiles=kernels.launch.compiles,
                  picked={" ".join(map(str, key)): config for key, config in kernels.launch.fastest_configs.items()},
                  picked_us={" ".join(map(str, key)): round(1000 * ms, 2) for key, ms in kernels.launch.fastest_times.items()}))

    def emit_memory(when: str) -> None:
        """GPU memory with no session running: PyTorch's tensors, its allocator's total, the talker
        cache's pages, and the device's own count (CUDA context and every process included)."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        emit_row(dict(kind="memory", when=when, idle_alloc_gib=gib(torch.cuda.memory_allocated()),
                      idle_reserved_gib=gib(torch.cuda.memory_reserved()),
                      kv_cache_gib=gib(scheduler.stats().kv_cache_bytes), device_used_gib=gib(total - free)))

    try:
        run_batch(scheduler, voice, min(batches), 8, 10_000)      # warm-up (graphs, allocator)
        if cuda:
            emit_memory("after warm-up")
        for b in batches:
            for rep in range(args.reps):
                for defer in defer_values:      # set between runs, while the engine thread idles
                    scheduler.defer_audio = defer
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    row = run_batch(scheduler, voice, b, args.frames, 1000 * rep)
                    if cuda:
                        row["max_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
                        row["max_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
                    emit_row(dict(kind="run", mode="scheduler", rep=rep, device=args.device, dtype=args.dtype,
                                  defer_audio=defer, **row, step_ms=scheduler.stats().last_step_ms))
        for rep in range(args.reps if args.sustained > max(batches) else 0):
            for defer in defer_values:
                scheduler.defer_audio = defer
                row = run_sustained(scheduler, voice, args.sustained, max(batches), args.frames, 1000 * rep)
                emit_row(dict(kind="run", mode="sustained", rep=rep, device=args.device, dtype=args.dtype,
                              defer_audio=defer, **row))
        if cuda:
            time.sleep(0.5)           # the engine thread hands spare cache pages back after the last turn
            emit_memory("after the runs")
    finally:
        scheduler.stop()


if __name__ == "__main__":
    main()
