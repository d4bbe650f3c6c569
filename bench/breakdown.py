"""Where a frame's time goes: talker, code predictor, sampling, vocoder and host, by batch size.

Times (CUDA events, median of `--reps`) on a runner whose B slots hold prompts of `--prompt` positions:
  step_graph   ModelRunner.step with CUDA graphs (what the scheduler runs per frame)
  step_eager   the same step without graphs
  step_graph_plain, kernels_fused / kernels_plain: the same with the plain ops instead of the fused
               decode path, and the GPU kernels one eager step launches each way
  talker       one talker forward (B rows, 1 position)       \\
  predictor    the 15 code-predictor steps with sampling      } eager, to split step_eager
  sample       one talker logits processing + sampling        /
  attention_us one talker layer's attention kernel per launch config (kernels.ATTENTION_CONFIGS), in
               CUDA graphs
  vocoder_wN   VocoderStreams.decode of N frames for B streams, per frame (eager, under cuDNN's
               heuristics; _graph: replayed from CUDA graphs as the scheduler's, at most its default
               vocoder batch of streams a replay)

    python -m bench.breakdown --model-dir /tmp/rand06b --batches 1,64,256
"""
from __future__ import annotations

import argparse
import statistics

import torch

from engine.loader import load_model
from engine.requests import SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import VOCODER_BATCH
from engine.sampling import sample_subtalker, sample_talker
from engine.graphs import VocoderGraphs, capture_graph
from engine.model import kernels
from engine.model.vocoder import VocoderStreams
from bench.precision import set_fused_decode
from bench.results import emit


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() on the current stream."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timed_in_graph(fn, reps: int, launches: int = 20) -> float:
    """Median milliseconds of one fn() on the GPU alone: `launches` calls captured in a CUDA graph and
    replayed (a kernel of a few microseconds, launched from Python, is timed at the host's pace)."""
    def calls():
        for _ in range(launches):
            fn()
    graph, _ = capture_graph(calls, None)     # after one eager run (compiles, lazy inits)
    return timed(graph.replay, reps) / launches


def kernel_count(fn) -> int:
    """GPU kernels fn() launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def attention_config_name(c: dict) -> str:
    """k64w4s3 (keys a block, warps, stages), with "-nopf" where it does not prefetch and "-split4"
    where four programs share a row's keys."""
    return ("k{BLOCK_K}w{num_warps}s{num_stages}".format(**c) + ("" if c["PREFETCH"] else "-nopf")
            + (f"-split{c['SPLIT']}" if c.get("SPLIT", 1) > 1 else ""))


def attention_configs(model, runner, batch: int, reps: int) -> dict:
    """Microseconds of one talker layer's `decode_attention` per launch config on the GPU, on the
    runner's cache (the kernel picks its config on a scratch cache of kernels.attention.ATTENTION_TIMING_KEYS
    keys a row)."""
    attn = model.talker.model.layers[0].self_attn
    width = (attn.heads + 2 * attn.kv_heads) * attn.head_dim
    qkv = torch.randn(batch, 1, width, device=model.device, dtype=model.dtype)
    cache = runner.cache
    start = runner.length[:batch]
    out = {}
    for config in kernels.ATTENTION_CONFIGS:
        name = attention_config_name(config)
        try:
            out[name] = 1000 * timed_in_graph(lambda: kernels.decode_attention(
                qkv, attn.heads, attn.kv_heads, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                model.talker.model.inv_freq, cache, 0, start, config), reps)
        except Exception as e:        # a config this GPU cannot run
            out[name] = f"{type(e).__name__}"
    return out


@torch.no_grad()
def breakdown(model, batch: int, prompt: int, reps: int, windows: list[int]) -> dict:
    dev, dt = model.device, model.dtype
    d = model.config.talker.transformer.hidden_size
    runner = ModelRunner(model, batch, prompt + 64)
    slots = list(range(batch))
    runner.admit(slots, [SamplingParams(seed=i, min_new_tokens=10 ** 6) for i in slots], [10 ** 6] * batch)
    runner.prefill(slots, [torch.randn(prompt, d, device=dev, dtype=dt) * 0.1 for _ in slots])
    text = torch.randn(batch, d, device=dev, dtype=dt) * 0.1
    active = [True] * batch

    def reset():      # keep lengths constant across repetitions
        runner.length[:batch] = prompt
        runner.lengths[:batch] = prompt

    out = {"batch": batch, "prompt": prompt}
    out["step_eager_ms"] = timed(lambda: (reset(), runner.step(batch, active, text)), reps)
    runner.use_cuda_graphs()
    out["step_graph_ms"] = timed(lambda: (reset(), runner.step(batch, active, text)), reps)
    runner.graphs = None
    for fused in (True, False):
        set_fused_decode(model, fused)
        out["kernels_fused" if fused else "kernels_plain"] = kernel_count(lambda: (reset(), runner.step(batch, active, text)))
    runner.use_cuda_graphs()             # set_fused_decode(model, False) holds: plain-op graphs
    out["step_graph_plain_ms"] = timed(lambda: (reset(), runner.step(batch, active, text)), reps)
    runner.graphs = None
    set_fused_decode(model, True)
    kmax = -(-(prompt + 1) // 64) * 64
    x = torch.randn(batch, 1, d, device=dev, dtype=dt) * 0.1
    start = runner.length[:batch].clone()
    out["talker_ms"] = timed(lambda: model.talker(x, runner.cache, start, kmax=kmax), reps)
    params = runner.params.head(batch)
    frame = runner.generated[:batch]
    out["predictor_ms"] = timed(lambda: model.talker.predict_codes(
        runner.h[:batch], runner.c0[:batch], lambda lg, g, e: sample_subtalker(lg, g, frame, params, embed=e), runner.cp_cache), reps)
    logits = torch.randn(batch, model.config.talker.vocab_size, device=dev)
    out["sample_ms"] = timed(lambda: sample_talker(runner.processor, logits, runner.seen[:batch], frame, params), reps)
    picked = [c for k, c in kernels.launch.fastest_configs.items() if k[0] == "attention" and k[1] == batch]
    out["attention_picked"] = [attention_config_name(c) for c in picked]
    out["attention_us"] = attention_configs(model, runner, batch, reps)
    streams = VocoderStreams(model.vocoder, batch)
    idx = torch.arange(batch, device=dev)
    graphs = VocoderGraphs(streams, windows, max_batch=VOCODER_BATCH)
    for w in windows:
        codes = torch.randint(0, 2048, (batch, w, 16), device=dev)
        streams.reset(idx)
        out[f"vocoder_w{w}_ms_per_frame"] = timed(lambda: streams.decode(idx, codes), reps) / w
        out[f"vocoder_w{w}_graph_ms_per_frame"] = timed(lambda: graphs.decode(idx, codes), reps) / w
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=200, help="cache positions per row (prompt + frames so far)")
    ap.add_argument("--windows", default="2,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skinny-rows", type=int, default=kernels.SKINNY_ROWS,
                    help="rows up to which the fused decode path's GEMMs use the skinny kernel (0: cuBLAS)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels.gemm.SKINNY_ROWS = args.skinny_rows
    model = load_model(args.model_dir, device="cuda", dtype=getattr(torch, args.dtype))
    for b in (int(x) for x in args.batches.split(",")):
        row = {"peer": "qwen3-tts-server", "kind": "breakdown", "dtype": args.dtype, "skinny_rows": args.skinny_rows,
               **breakdown(model, b, args.prompt, args.reps, [int(w) for w in args.windows.split(",")])}
        emit(row, args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
