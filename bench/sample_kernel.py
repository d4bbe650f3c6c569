"""`sample_rows` (temperature, top-k, the Gumbel draw: one kernel a codebook, 16 a frame) in each launch
config it may time, at the shapes a decode step samples: the code predictor's 2,048 bf16 logits and
the talker's 3,072 fp32 ones, at 1 to 256 rows (one row is a single program, latency-bound; 256 fill
the GPU). Microseconds a call, timed in CUDA graphs (GPU time), beside the config its own timing picks.

    python -m bench.sample_kernel --rows 1,16,256
"""
from __future__ import annotations

import argparse

import torch

from bench.breakdown import timed_in_graph
from bench.results import emit
from engine.model import kernels


def config_name(c: dict) -> str:
    return "r{RADIX_BITS}w{num_warps}".format(**c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for b in map(int, args.rows.split(",")):
        for vocab, dtype in ((2048, torch.bfloat16), (3072, torch.float32)):
            logits = (torch.randn(b, vocab, device=dev) * 3).to(dtype)
            greedy = torch.zeros(b, dtype=torch.bool, device=dev)
            temperature = torch.full((b,), 0.9, device=dev)
            top_k = torch.full((b,), args.top_k, dtype=torch.long, device=dev)
            seed, frame = torch.arange(b, device=dev), torch.zeros(b, dtype=torch.long, device=dev)

            def sample(c=None):
                return kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, 3, c)
            sample()
            picked = kernels.launch.fastest_configs[("sample_rows", vocab, b.bit_length())]
            us = {}
            for c in kernels.SAMPLE_CONFIGS:
                us[config_name(c)] = round(1000 * timed_in_graph(lambda: sample(c), args.reps), 2)
            emit(dict(peer="qwen3-tts-server", kind="sample_kernel", rows=b, vocab=vocab, dtype=str(dtype),
                      top_k=args.top_k, picked=config_name(picked), picked_us=us[config_name(picked)],
                      us=dict(sorted(us.items(), key=lambda kv: kv[1]))), args.out)


if __name__ == "__main__":
    main()
