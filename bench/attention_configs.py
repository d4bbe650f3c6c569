"""`decode_attention` per launch config at the shapes a decode step runs, and the KV bytes it reads.

Times one layer's attention kernel (launches in a CUDA graph, replayed: GPU time, not the host's
launch time, which is longer than the kernel at these sizes) for the talker (28-layer cache, pages of
64) at several live lengths and for the code predictor (pages of 16, positions 0..16), at each batch
size, for every config in kernels.ATTENTION_CONFIGS and in --extra, and prints each time with the
rate at which it reads the rows' keys and values (the kernel's memory floor).

    python -m bench.attention_configs --batches 64,256 --extra 16:1:1,32:2:1,64:4:1
"""
from __future__ import annotations

import argparse

import torch

from bench.breakdown import attention_config_name, timed_in_graph
from bench.results import emit
from engine.kv_cache import KVCache
from engine.model import kernels
from engine.model.layers import rope_inv_freq

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128       # Qwen3-TTS 0.6B talker and code predictor


def time_case(rows: int, t: int, keys: int, layers: int, page: int, capacity: int, configs: list[dict],
              reps: int) -> dict:
    """Microseconds per config of one layer's attention: `rows` rows of t new positions after keys-t."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    cache = KVCache(layers, rows, capacity, KV_HEADS, HEAD_DIM, dt, dev, page_size=page, reserve_all=True)
    qkv = torch.randn(rows, t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=dt)
    norm_w = torch.ones(HEAD_DIM, device=dev, dtype=dt)
    inv_freq = rope_inv_freq(HEAD_DIM, 1e6).to(dev)
    start = torch.full((rows,), keys - t, dtype=torch.long, device=dev)
    kv_bytes = rows * keys * KV_HEADS * HEAD_DIM * 2 * 2
    out = {}
    for c in configs:
        name = attention_config_name(c)
        try:
            us = 1000 * timed_in_graph(lambda: kernels.decode_attention(
                qkv, HEADS, KV_HEADS, norm_w, norm_w, 1e-6, inv_freq, cache, layers - 1, start, c), reps)
            out[name] = (round(us, 2), round(kv_bytes / us / 1e3, 1))     # us, GB/s of KV read
        except Exception as e:        # a config this GPU cannot run
            out[name] = f"{type(e).__name__}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--talker-keys", default="64,160,320")
    ap.add_argument("--extra", default="", help="more configs, BLOCK_K:num_warps:num_stages,... (each with and without the prefetch)")
    ap.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    configs = list(kernels.ATTENTION_CONFIGS) + [
        dict(BLOCK_K=int(k), num_warps=int(w), num_stages=int(s), PREFETCH=p, SPLIT=1)
        for k, w, s in (e.split(":") for e in args.extra.split(",") if e) for p in (True, False)]
    for rows in map(int, args.batches.split(",")):
        for keys in map(int, args.talker_keys.split(",")):
            res = time_case(rows, 1, keys, 28, 64, 2048, configs, args.reps)
            emit(dict(peer="qwen3-tts-server", kind="attention_configs", stack="talker", rows=rows, t=1, keys=keys,
                      us_gbps=res), args.out)
        for t, keys in ((2, 2), (1, 9), (1, 16)):
            res = time_case(rows, t, keys, 5, 16, 16, configs, args.reps)
            emit(dict(peer="qwen3-tts-server", kind="attention_configs", stack="predictor", rows=rows, t=t, keys=keys,
                      us_gbps=res), args.out)


if __name__ == "__main__":
    main()
