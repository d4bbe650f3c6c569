"""The vocoder's convolutions in cuDNN with channels-first against channels-last activations.

For each conv shape of a window of --frames frames of --batch streams: the time (CUDA events,
median; cuDNN's benchmark mode as every captured vocoder window uses, or its heuristics), the GPU
kernels it runs (layout conversions show up as nchwToNhwc / nhwcToNchw) and the output's strides,
with the input (and weight) as PyTorch makes them, and with [B, C, T] tensors whose channels are
adjacent in memory (strides (T*C, 1, C)).

    python -m bench.conv_layout --batch 32
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.breakdown import timed
from bench.results import emit
from engine.model.vocoder import channels_adjacent


def kernels_of(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key[:60] for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--frames", type=int, default=8, help="frames a window")
    ap.add_argument("--benchmark", type=int, default=1,
                    help="1: cuDNN times its algorithms (as for the captured vocoder windows); 0: its heuristics")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = bool(args.benchmark)
    dev, dt, b = torch.device("cuda"), torch.bfloat16, args.batch
    n = args.frames * 1920                          # samples of a window at 24 kHz
    cases = [  # name, channels in, out, kernel, dilation, samples out (at the layer's rate), transposed stride
        ("unit k7 d9 96ch", 96, 96, 7, 9, n, 0),
        ("unit k7 d3 192ch", 192, 192, 7, 3, n // 3, 0),
        ("unit k7 d1 384ch", 384, 384, 7, 1, n // 12, 0),
        ("unit k7 d1 768ch", 768, 768, 7, 1, n // 60, 0),
        ("output k7 96->16", 96, 16, 7, 1, n, 0),
        ("upsample k6 s3 192->96", 192, 96, 6, 1, n // 3, 3),
        ("upsample k8 s4 384->192", 384, 192, 8, 1, n // 12, 4),
    ]
    for name, cin, cout, k, d, t, stride in cases:
        row = dict(peer="qwen3-tts-server", kind="conv_layout", case=name, batch=b, frames=args.frames, benchmark=args.benchmark)
        if stride:
            x = torch.randn(b, cin, t + 1, device=dev, dtype=dt)
            w = torch.randn(cin, cout, k, device=dev, dtype=dt) * 0.05
            op = lambda x, w: F.conv_transpose1d(x, w, stride=stride)
            op2 = lambda x, w: F.conv_transpose2d(x, w, stride=(1, stride))
        else:
            x = torch.randn(b, cin, t + (k - 1) * d, device=dev, dtype=dt)
            w = torch.randn(cout, cin, k, device=dev, dtype=dt) * 0.05
            op = lambda x, w, d=d: F.conv1d(x, w, dilation=d)
            op2 = lambda x, w, d=d: F.conv2d(x, w, dilation=(1, d))
        x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        w4 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        for layout, f, xi, wi in (("first", op, x, w), ("last", op, channels_adjacent(x), w),
                                  ("last+w", op, channels_adjacent(x), channels_adjacent(w)), ("2d last", op2, x4, w4)):
            fn = lambda: f(xi, wi)
            y = fn()
            row[layout] = dict(ms=round(timed(fn, args.reps), 3), out_strides=list(y.stride()),
                               kernels=kernels_of(fn))
        ref = op(x, w).float()
        row["max_diff_last"] = float((op(channels_adjacent(x), channels_adjacent(w)).float() - ref).abs().max())
        emit(row, args.out)


if __name__ == "__main__":
    main()
