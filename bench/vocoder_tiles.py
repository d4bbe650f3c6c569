"""The vocoder's per-sample Triton kernels, SnakeBeta and the residual tail, in each launch config they may
time (`kernels.SNAKE_CONFIGS`, `kernels.RESIDUAL_TAIL_CONFIGS`, plus --extra-snake and --extra-tail ones,
candidates: a row of error for one that does not run), on tensors of either layout, at the decoder's
widths for an 8-frame window of --batch streams: microseconds a call, timed in CUDA graphs (GPU time),
with the rate of the kernel's reads and writes.

    python -m bench.vocoder_tiles --batch 32 [--extra-snake 8:512:4,16:512:8] [--extra-tail 128:128:8:64:3]
"""
from __future__ import annotations

import argparse

import torch

from bench.breakdown import timed_in_graph
from bench.results import emit
from engine.model import kernels
from engine.model.vocoder import channels_adjacent

# (channels, new samples, context samples) of the 12 Hz decoder's stages for an 8-frame window
SHAPES = ((1536, 64, 6), (768, 320, 54), (384, 1280, 54), (192, 5120, 54), (96, 15360, 54))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--extra-snake", default="", help="more SnakeBeta tiles, BLOCK_C:BLOCK_T:num_warps,...")
    ap.add_argument("--extra-tail", default="",
                    help="more residual-tail configs, BLOCK_CO:BLOCK_T:num_warps:BLOCK_CI:num_stages,...")
    ap.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    extra = [dict(zip(("BLOCK_C", "BLOCK_T", "num_warps"), map(int, e.split(":"))))
             for e in args.extra_snake.split(",") if e]
    extra_tail = [dict(zip(("BLOCK_CO", "BLOCK_T", "num_warps", "BLOCK_CI", "num_stages"), map(int, e.split(":"))))
                  for e in args.extra_tail.split(",") if e]
    g = torch.Generator(device="cuda").manual_seed(0)
    b = args.batch
    for c, t, n_left in SHAPES:
        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * scale
        first = {"x": randn(b, c, t), "y": randn(b, c, t)}
        last = {k: channels_adjacent(v) for k, v in first.items()}
        alpha, beta, bias = randn(c, scale=0.1), randn(c, scale=0.1), randn(c, scale=0.1)
        left = randn(b, c, n_left)
        weight = randn(c, c, 1, scale=c ** -0.5)
        snake_mb = b * c * 2 * (t + n_left) * 2 / 1e6        # x and left read, y written
        tail_mb = 3 * b * c * t * 2 / 1e6                     # x and y read, out written
        for layout, xs in (("channels_first", first), ("channels_last", last)):
            adjacent = layout == "channels_last"
            row = dict(peer="qwen3-tts-server", kind="vocoder_tile", layout=layout, channels=c, samples=t, batch=b)
            for cfg in kernels.SNAKE_CONFIGS[adjacent] + (extra if adjacent else []):
                time_config(dict(row, kernel="snake_beta", config=cfg), snake_mb, cfg in extra, args,
                            lambda: kernels.snake_beta_triton(xs["x"], alpha, beta, None, left, cfg))
            for cfg in kernels.residual_tail_configs(c) + extra_tail:
                time_config(dict(row, kernel="residual_tail", config=cfg), tail_mb, cfg in extra_tail, args,
                            lambda: kernels.residual_tail_triton(xs["x"], xs["y"], alpha, beta, bias, weight, bias, cfg))


def time_config(row: dict, mb: float, candidate: bool, args, fn) -> None:
    """Emit `row` with fn's microseconds a call and the rate of its `mb` of reads and writes; for a
    candidate config that does not run (past the shared memory, say), a row of error instead."""
    try:
        us = 1000 * timed_in_graph(fn, args.reps)
    except Exception as e:
        if not candidate:
            raise
        emit(dict(row, kind="error", error=f"{type(e).__name__}: {e}"[:300]), args.out)
        return
    emit(dict(row, us=round(us, 1), tb_s=round(mb / us, 2)), args.out)


if __name__ == "__main__":
    main()
