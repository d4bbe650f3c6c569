"""Aggregate throughput through the scheduler: audio seconds produced per wall second, by batch size.

For each batch size B, B turns of a fixed length (EOS suppressed, `--frames` frames each) are
submitted at once to one `engine.scheduler.Scheduler`; the wall time runs from submission until the
last chunk of the last turn has been delivered, so it includes prefill, every decode step and the
streaming vocoder. Also reports idle and peak GPU memory.

    python -m bench.throughput --model-dir /tmp/rand06b --device cuda --dtype bfloat16 \
        --batches 1,16,64,256 --frames 125 --out results.jsonl

Rows are JSON lines in the format of ../shared/peers (peer "qwen3-tts-server"), so the peers'
`report.py` prints one table with theirs.
"""
from __future__ import annotations

import argparse
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


def run_batch(scheduler: Scheduler, model, voice, batch: int, frames: int, seed0: int) -> dict:
    params = [SamplingParams(seed=seed0 + i, min_new_tokens=frames + 2) for i in range(batch)]
    t0 = time.perf_counter()
    handles = [scheduler.submit(SpeechRequest(text=TEXTS[i % len(TEXTS)], voice=voice, language="english",
                                              sampling=params[i], max_frames=frames))
               for i in range(batch)]
    first: list = [None] * batch
    samples = [0] * batch
    results: list = [None] * batch

    def drain(i: int) -> None:          # one reader per turn, so arrival times are real
        while True:
            item = handles[i].get(timeout=600)
            if hasattr(item, "pcm"):
                samples[i] += len(item.pcm)
                first[i] = first[i] or time.perf_counter() - t0
            else:
                results[i] = item
                return

    readers = [threading.Thread(target=drain, args=(i,)) for i in range(batch)]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    wall = time.perf_counter() - t0
    total_frames = sum(r.frames for r in results)
    return dict(batch=batch, frames_total=total_frames, frames_per_stream=[min(r.frames for r in results),
                max(r.frames for r in results)], wall_s=wall, audio_samples=sum(samples),
                rtf_aggregate=total_frames * FRAME_S / wall, rtf_per_stream=total_frames * FRAME_S / batch / wall,
                ttfa_s=float(np.median([f for f in first if f is not None])),
                ttfa_max_s=max(f for f in first if f is not None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--frames", type=int, default=125, help="frames per turn (125 = 10 s)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--window", default="2,8", help="vocoder frames: first window, later windows")
    ap.add_argument("--vocoder-batch", type=int, default=VOCODER_BATCH,
                    help="most streams one vocoder graph replay decodes")
    ap.add_argument("--out", default=None, help="append JSON rows to this file")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model_dir, device=args.device, dtype=dtype)
    ref = np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1
    voice = model.make_voice(ref, 24000)
    cuda = torch.device(args.device).type == "cuda"
    scheduler = Scheduler(model, max_batch=max(batches), window_frames=tuple(int(w) for w in args.window.split(",")),
                          vocoder_batch=args.vocoder_batch)
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
        run_batch(scheduler, model, voice, min(batches), 8, 10_000)      # warm-up (graphs, allocator)
        if cuda:
            emit_memory("after warm-up")
        for b in batches:
            for rep in range(args.reps):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                row = run_batch(scheduler, model, voice, b, args.frames, 1000 * rep)
                if cuda:
                    row["max_alloc_gib"] = gib(torch.cuda.max_memory_allocated())
                    row["max_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
                emit_row(dict(kind="run", mode="scheduler", rep=rep, device=args.device, dtype=args.dtype, **row,
                          step_ms=scheduler.stats().last_step_ms))
        if cuda:
            time.sleep(0.5)           # the engine thread hands spare cache pages back after the last turn
            emit_memory("after the runs")
    finally:
        scheduler.stop()


if __name__ == "__main__":
    main()
