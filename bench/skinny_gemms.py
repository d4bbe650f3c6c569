"""A decode layer's four GEMMs at 1-16 rows (the skinny kernel's range), in every launch config
`kernels.linear` may time, on the GPU as a CUDA graph replays them: alone (each call on its own copy of
the weights, more than L2 holds, as a decode step streams its layers') and in a chain of layers
(qkv -> output -> gate/up -> down, one weight copy a layer, dependent launches as served), also with
the weights' L2 prefetch on and off and without dependent launches. Beside them: cuBLAS, and the config
`linear`'s own timing picks at warm-up (since 17a5e2f also in a CUDA graph over weight copies; before,
eagerly by `triton.testing.do_bench`).

    python -m bench.skinny_gemms --rows 1,8 [--extra gemv:8:1024:8:2,dot:32:512:8:3]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.breakdown import timed_in_graph
from bench.results import emit
from engine.model import kernels


def parse_config(text: str) -> dict:
    kernel, n, k, warps, stages = text.split(":")
    return dict(kernel=kernel, BLOCK_N=int(n), BLOCK_K=int(k), num_warps=int(warps), num_stages=int(stages))


def name_of(c: dict) -> str:
    """kernel:BLOCK_N:BLOCK_K:warps:stages, BLOCK_K "pre" for a config that preloads its weights."""
    block_k = "pre" if c.get("PRELOAD") else c["BLOCK_K"]
    return f"{c['kernel']}:{c['BLOCK_N']}:{block_k}:{c['num_warps']}:{c['num_stages']}"


class Gemm:
    """One of a layer's GEMMs: `copies` weights, its input, residual and output buffers."""

    def __init__(self, name, n, k, norm, gated, residual, rows, copies, extra):
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        self.name, self.n, self.k, self.norm, self.gated, self.residual = name, n, k, norm, gated, residual
        self.weights = [torch.randn(2 * n if gated else n, k, **bf16) * k ** -0.5 for _ in range(copies)]
        self.x = torch.randn(rows, k, **bf16)
        self.r = torch.randn(rows, n, **bf16) if residual else None
        self.nw = torch.rand(k, **bf16) + 0.5 if norm else None
        self.out = torch.empty(rows, n, **bf16)
        self.configs = kernels.linear_configs(rows, k, gated) + [
            c for c in extra if c["kernel"] == "dot" or rows <= kernels.GEMV_ROWS]
        self.times = {}      # us alone per config name (`main`)

    def run(self, config, copy, x=None):
        kernels.skinny_linear(self.x if x is None else x, self.weights[copy], self.out, config, self.nw, 1e-6,
                              self.gated, self.r)

    def picked(self, rows) -> dict:
        kernels.linear(self.x, self.weights[0], self.nw, 1e-6, self.gated, self.r)
        key = kernels.linear_timing_key(rows, self.n, self.k, self.x.dtype, self.norm, self.gated, self.residual)
        return kernels.launch.fastest_configs[key]


def isolated_us(fn, copies, reps) -> float:
    calls = iter(range(1 << 30))
    return 1000 * timed_in_graph(lambda: fn(next(calls) % copies), reps, launches=copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--copies", type=int, default=16, help="weight copies (layers of the chain)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--extra", default="", help="more configs, kernel:BLOCK_N:BLOCK_K:warps:stages,...")
    ap.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    d, q = args.hidden, args.heads * args.head_dim
    extra = [parse_config(c) for c in args.extra.split(",") if c]
    for rows in map(int, args.rows.split(",")):
        gemms = [Gemm("qkv", q + 2 * args.kv_heads * args.head_dim, d, True, False, False, rows, args.copies, extra),
                 Gemm("o", d, q, False, False, True, rows, args.copies, extra),
                 Gemm("gate_up", args.intermediate, d, True, True, False, rows, args.copies, extra),
                 Gemm("down", d, args.intermediate, False, False, True, rows, args.copies, extra)]
        picks, best = {}, {}
        for g in gemms:        # every variant compiled side by side first, as `linear`'s own timing does
            kernels.launch.compile_candidates(g.configs, lambda c, compile_only=False, g=g: kernels.skinny_linear(
                g.x, g.weights[0], g.out, c, g.nw, 1e-6, g.gated, g.r, compile_only))
        for g in gemms:
            times = g.times
            for c in g.configs:
                try:
                    times[name_of(c)] = isolated_us(lambda i, c=c: g.run(c, i), args.copies, args.reps)
                except Exception as e:          # a config this GPU cannot build
                    times[name_of(c)] = float("inf")
                    print(f"{g.name} {rows} {name_of(c)}: {type(e).__name__}: {str(e)[:200]}")
            # the picked config on one weight copy over and over (L2-resident): its latency, not its read
            picks[g.name] = g.picked(rows)
            hot = isolated_us(lambda i: g.run(picks[g.name], 0), args.copies, args.reps)
            cublas = isolated_us(lambda i: F.linear(g.x, g.weights[i]), args.copies, args.reps)
            best[g.name] = min(g.configs, key=lambda c: times[name_of(c)])
            mb = g.weights[0].numel() * 2 / 1e6
            emit(dict(peer="qwen3-tts-server", kind="skinny_gemm", gemm=g.name, rows=rows, n=g.n, k=g.k, weight_mb=mb,
                      hot_us=round(hot, 2), cublas_us=round(cublas, 2), picked=name_of(picks[g.name]),
                      picked_us=round(times[name_of(picks[g.name])], 2), best=name_of(best[g.name]),
                      best_us=round(times[name_of(best[g.name])], 2),
                      us={c: round(t, 2) for c, t in sorted(times.items(), key=lambda kv: kv[1])}), args.out)

        qkv, o, gate_up, down = gemms

        def chain(choice, hot=False):
            """Per layer us of `copies` layers in a row, with the configs in `choice` (name -> config);
            `hot`: every layer on the first weight copy (L2-resident: the chain's latency alone)."""
            def layers(_):
                for i in range(args.copies):
                    i = 0 if hot else i
                    qkv.run(choice["qkv"], i, x=o.r)
                    o.run(choice["o"], i)
                    gate_up.run(choice["gate_up"], i, x=o.out)
                    down.run(choice["down"], i, x=gate_up.out)
            return 1000 * timed_in_graph(lambda: layers(0), args.reps, launches=1) / args.copies

        rows_out = dict(picked=chain(picks), best_alone=chain(best), picked_hot=chain(picks, hot=True))
        # the fastest alone among the configs that stream their weights after the wait (as before PRELOAD)
        streamed = {g.name: min((c for c in g.configs if not c.get("PRELOAD")), key=lambda c: g.times[name_of(c)])
                    for g in gemms}
        rows_out["best_alone_streamed"] = chain(streamed)
        saved = kernels.launch.PDL, kernels.gemm.LINEAR_PREFETCH
        kernels.gemm.LINEAR_PREFETCH = not saved[1]
        rows_out["picked_prefetch" if kernels.gemm.LINEAR_PREFETCH else "picked_no_prefetch"] = chain(picks)
        kernels.launch.PDL = False
        rows_out["picked_no_pdl"] = chain(picks)
        kernels.launch.PDL, kernels.gemm.LINEAR_PREFETCH = saved
        # each GEMM's configs in the chain, the others at their picks
        in_chain = {}
        for g in gemms:
            times = {}
            for c in g.configs:
                try:
                    times[name_of(c)] = round(chain(dict(picks, **{g.name: c})), 2)
                except Exception:
                    times[name_of(c)] = float("inf")
            in_chain[g.name] = dict(sorted(times.items(), key=lambda kv: kv[1])[:5])
        emit(dict(peer="qwen3-tts-server", kind="skinny_chain", rows=rows,
                  layer_us={k: round(v, 2) for k, v in rows_out.items()}, in_chain_top5=in_chain), args.out)


if __name__ == "__main__":
    main()
