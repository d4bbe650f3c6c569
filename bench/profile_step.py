"""Kernel counts and the top GPU kernels of one decode step and of one vocoder window, and the
scheduler's host time per frame.

    python -m bench.profile_step --model-dir /tmp/rand06b --batch 64
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from bench.breakdown import timed
from engine.loader import load_model
from engine.requests import SamplingParams
from engine.runner import ModelRunner


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=200)
    args = ap.parse_args()
    model = load_model(args.model_dir, device="cuda", dtype=torch.bfloat16)
    b, d = args.batch, model.config.talker.transformer.hidden_size
    runner = ModelRunner(model, b, args.prompt + 64)
    slots = list(range(b))
    runner.admit(slots, [SamplingParams(seed=i, min_new_tokens=10 ** 6) for i in slots], [10 ** 6] * b)
    runner.prefill(slots, [torch.randn(args.prompt, d, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in slots])
    text = torch.randn(b, d, device="cuda", dtype=torch.bfloat16) * 0.1
    for _ in range(2):
        runner.step(b, [True] * b, text)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step(b, [True] * b, text)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"eager step B={b}: {kernels} GPU kernel launches")
    print(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    ms = timed(lambda: runner.step(b, [True] * b, text), 5)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"eager step wall {ms:.1f} ms; python profile:\n{s.getvalue()[:6000]}")

    # One 8-frame vocoder window of as many streams as a replay decodes (the default vocoder batch), the
    # convs' algorithms timed by cuDNN as at capture: the ops and what their kernels take.
    from engine.graphs import cudnn_autotuned
    from engine.model.vocoder import VocoderStreams
    from engine.scheduler import VOCODER_BATCH
    vb = min(b, VOCODER_BATCH)
    streams = VocoderStreams(model.vocoder, vb)
    idx = torch.arange(vb, device="cuda")
    codes = torch.randint(0, 2048, (vb, 8, 16), device="cuda")
    with cudnn_autotuned():
        streams.decode(idx, codes)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            streams.decode(idx, codes)
            torch.cuda.synchronize()
    print(f"eager vocoder window B={vb} W=8, ops by their kernels' time:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))

    # The scheduler's host work per frame: drive its loop in this thread under cProfile.
    from engine.requests import SpeechRequest
    from engine.scheduler import Scheduler
    import numpy as np
    voice = model.make_voice(np.random.default_rng(0).standard_normal(48000).astype(np.float32) * 0.1, 24000)
    sched = Scheduler(model, b)
    sched.warmup(max_live=256)
    handles = [sched.submit(SpeechRequest(text="The quick brown fox jumps over the lazy dog.", voice=voice,
                                          sampling=SamplingParams(seed=i, min_new_tokens=10 ** 6), max_frames=100))
               for i in range(b)]
    sched._apply_commands(block=False)
    for _ in range(20):                      # admission, prefill, first frames
        sched._iterate()
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    import time
    t = time.perf_counter()
    pr.enable()
    for _ in range(40):
        sched._iterate()
    torch.cuda.synchronize()
    pr.disable()
    per = (time.perf_counter() - t) / 40 * 1000
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    print(f"scheduler iteration B={b}: {per:.1f} ms wall (profiled); profile:\n{s.getvalue()[:8000]}")

    # The same iterations as served (step and vocoder graphs replayed, the default vocoder batch):
    # the GPU kernels inside the graphs, per frame.
    frames = 16
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(frames):
            sched._iterate()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1000
    print(f"served iterations B={b}: {total / frames:.2f} ms of GPU kernels a frame; top kernels over {frames} frames:")
    print(events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=160))
    del handles


if __name__ == "__main__":
    main()
