"""Correctness checks only a CUDA device can run: the CUDA-graph paths against the eager ones.

- prefills replayed from the one-row graphs of their length buckets (padded prompts; alone and three
  admitted together) against the eager prefill: hidden states, and the first code sampled from them;
- vocoder windows of sizes that have no graph (decoded as a run of captured sizes) against one eager
  streaming decode of the same frames;
- the vocoder's Triton kernels (SnakeBeta writing the next conv's context ahead of its output, a
  residual unit's SnakeBeta + 1x1 conv + residual add, the transformer's windowed attention with its
  RoPE) against the PyTorch ops they replace, on streaming windows;
- a scheduler turn with every graph on against the same turn with none (greedy codes, audio);
- a greedy turn before and after the KV cache's pages were handed back and taken again elsewhere;
- the sampling kernel (Gumbel noise hashed in the kernel) against the plain ops' draws;
- a sampled scheduler turn with the decode kernels launched as programmatic dependents against the
  same turn launched plainly (`kernels.launch.PDL`): the same kernels, so the same codes, bit for bit;
- turns joining and leaving a scheduler frame by frame without any engine code waiting for the GPU
  but its read-backs (PyTorch's sync debug mode);
- the attention with a row's keys split over programs against the one-program kernel.
Each check prints a RESULT row with its errors and `ok`; the exit status is 1 if any is not ok.

    python -m bench.gpu_checks --model-dir /tmp/rand06b
"""
from __future__ import annotations

import argparse
import sys
from unittest import mock

import numpy as np
import torch

from bench.precision import err
from engine.graphs import VocoderGraphs
from engine.loader import load_model
from engine.model.vocoder import VocoderStreams
from engine.requests import SamplingParams, SpeechRequest
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from bench.results import emit


def prefill_graph_vs_eager(model) -> dict:
    d = model.config.talker.transformer.hidden_size
    g = torch.Generator(device=model.device).manual_seed(0)
    rows = {}
    prompt = lambda t: (torch.randn(t, d, device=model.device, generator=g.manual_seed(t)) * 0.1).to(model.dtype)  # noqa: E731
    for graphs in (True, False):
        runner = ModelRunner(model, 4, 512)
        if graphs:
            runner.use_cuda_graphs()
        out = []
        for slots, sizes in (([1], [7]), ([1], [50]), ([1], [200]), ([0, 2, 3], [5, 40, 90])):
            runner.admit(slots, [SamplingParams(greedy=True)] * len(slots), [100] * len(slots))
            runner.prefill(slots, [prompt(t) for t in sizes])
            out += [(runner.h[s].clone(), int(runner.c0[s])) for s in slots]
        rows[graphs] = out
    errors = [err(a[0], b[0]) for a, b in zip(rows[True], rows[False])]
    hidden = max(e["max_abs"] for e in errors)
    rel = max(e["rel_rms"] for e in errors)
    same_c0 = sum(a[1] == b[1] for a, b in zip(rows[True], rows[False])) / len(rows[True])
    # padding changes the GEMM shapes, so bf16 rounding may differ: the first codes are reported (random
    # weights leave near-tied logits); the check is the hidden states' relative error, which bf16
    # rounding keeps near 1e-2 (bf16 against fp32: 1.3e-2 for the prefill logits) and a bug does not
    return dict(check="prefill_graph_vs_eager", hidden_max_abs=hidden, hidden_rel_rms=rel, same_first_code=same_c0,
                ok=rel < 0.03)


def vocoder_runs_vs_eager(model) -> dict:
    dev, b = model.device, 3
    codes = torch.randint(0, 2048, (b, 31, 16), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    idx = torch.arange(b, device=dev)
    eager = VocoderStreams(model.vocoder, 8)
    reference = eager.decode(idx, codes)
    out = {}
    for max_batch in (None, 2):               # 3 streams a replay, or replays of 2 and 1
        streams = VocoderStreams(model.vocoder, 8)
        graphs = VocoderGraphs(streams, [2, 4, 8], max_batch=max_batch)
        pieces, t = [], 0
        for w in (3, 8, 5, 7, 1, 2, 5):           # 31 frames in windows of captured and other sizes
            pieces.append(graphs.decode(idx, codes[:, t:t + w]).clone())
            t += w
        out[max_batch or b] = err(torch.cat(pieces, dim=1), reference)
    # the graphs use the convolution algorithms cuDNN timed fastest, eager its heuristics': bf16
    # rounding apart (bf16 against fp32: 1.7e-2 relative RMS), not more
    return dict(check="vocoder_runs_vs_eager", by_replay_batch=out, ok=all(e["rel_rms"] < 0.03 for e in out.values()))


def _streamed_windows(model, seed: int) -> torch.Tensor:
    """31 random frames of 3 streams decoded through `VocoderStreams` in windows of several sizes."""
    dev, b = model.device, 3
    codes = torch.randint(0, 2048, (b, 31, 16), device=dev, generator=torch.Generator(device=dev).manual_seed(seed))
    idx = torch.arange(b, device=dev)
    streams, pieces, t = VocoderStreams(model.vocoder, 4), [], 0
    for w in (3, 8, 5, 7, 1, 2, 5):
        pieces.append(streams.decode(idx, codes[:, t:t + w]))
        t += w
    return torch.cat(pieces, dim=1)


def vocoder_kernels_vs_torch_ops(model) -> dict:
    from engine.model import kernels, vocoder
    fused = _streamed_windows(model, 4)
    with mock.patch.multiple(vocoder, snake_beta=kernels.snake_beta_reference,
                             residual_tail=kernels.residual_tail_reference,
                             window_attention=kernels.window_attention_reference):
        plain = _streamed_windows(model, 4)
    e = err(fused, plain)
    # the kernels round once where the ops round after each of theirs: bf16 rounding apart, not more
    return dict(check="vocoder_kernels_vs_torch_ops", **e, ok=e["rel_rms"] < 0.03)


def vocoder_channels_last_vs_first(model) -> dict:
    """The streamed windows with the convs over channels-last activations (`vocoder.CHANNELS_LAST`, the
    default) and over channels-first ones: the same audio up to bf16 rounding."""
    from engine.model import vocoder
    with mock.patch.object(vocoder, "CHANNELS_LAST", True):
        last = _streamed_windows(model, 5)
    with mock.patch.object(vocoder, "CHANNELS_LAST", False):
        first = _streamed_windows(model, 5)
    e = err(last, first)
    # cuDNN's kernels for either layout round differently: bf16 rounding apart, not more
    return dict(check="vocoder_channels_last_vs_first", **e, ok=e["rel_rms"] < 0.03)


def scheduler_graphs_vs_eager(model) -> dict:
    """A greedy scheduler turn with every graph on against the same turn with none: codes equal, PCM
    within bf16 rounding. The attention's launch configs are timed per kv length (`kernels.attention._timing_keys`)
    and the graphs' kv buckets are not the eager path's (`engine.graphs` against `runner.kv_bucket`), so
    the two may pick configs that sum in other orders, and a greedy turn on random weights then drifts
    (call CB: from frame 12, in every tree back to 7a371ea, with or without split attention). Here
    every length takes the configs of one, so both launch the same kernels."""
    from engine.model import kernels
    voice = model.make_voice(np.random.default_rng(0).standard_normal(48000).astype(np.float32) * 0.1, 24000)
    out = {}
    one_length = mock.patch.object(kernels, "_timing_keys", lambda cache, kmax=None: min(256, cache.capacity))
    for graphs in (True, False):
        with one_length, Scheduler(model, 4, keep_codes=True, cuda_graphs=graphs) as s:
            h = s.submit(SpeechRequest(text="A short check of the graphs against the eager path.", voice=voice,
                                       language="english", sampling=SamplingParams(greedy=True, min_new_tokens=32), max_frames=30))
            chunks, result = h.collect(timeout=300)
            out[graphs] = (result.codes, np.concatenate([c.pcm for c in chunks]))
    same_shape = len(out[True][1]) == len(out[False][1]) and out[True][0].shape == out[False][0].shape
    codes_equal = float((out[True][0] == out[False][0]).mean()) if same_shape else 0.0
    # the graphs share one memory pool: an output overwritten by another graph's replay shows here
    pcm_diff = float(np.abs(out[True][1] - out[False][1]).max()) if same_shape else float("inf")
    return dict(check="scheduler_graphs_vs_eager", codes_equal=codes_equal, frames=int(out[True][0].shape[0]),
                samples=[len(out[True][1]), len(out[False][1])], pcm_max_abs_diff=round(pcm_diff, 5),
                ok=codes_equal == 1.0 and pcm_diff < 0.05)


def kv_pages_come_and_go(model) -> dict:
    """The KV cache's pages are taken, handed back and taken again at other addresses (NaN-filled
    memory in between) under the captured graphs: a greedy turn gives the same codes before and after."""
    voice = model.make_voice(np.random.default_rng(1).standard_normal(48000).astype(np.float32) * 0.1, 24000)

    def turn(s, text, frames=40):
        return s.submit(SpeechRequest(text=text, voice=voice, language="english", max_frames=frames,
                                      sampling=SamplingParams(greedy=True, min_new_tokens=frames)))

    with Scheduler(model, 4, keep_codes=True) as s:
        text = "The same turn before and after the cache's pages changed."
        before = turn(s, text).collect(timeout=300)[1].codes
        others = [turn(s, f"Other turn number {i} keeps the cache busy.", 120) for i in range(12)]
        for h in others:
            h.collect(timeout=300)
        peak = s.stats().kv_cache_bytes
        cache = s.runner.cache                     # the engine thread is idle now
        freed = cache.trim(0)
        torch.cuda.empty_cache()
        filler = torch.full((freed // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
        after = turn(s, text).collect(timeout=300)[1].codes
        del filler
        held = s.stats().kv_cache_bytes
    equal = before.shape == after.shape and bool((before == after).all())
    return dict(check="kv_pages_come_and_go", frames=int(before.shape[0]), codes_equal=equal,
                kv_cache_mib=[peak >> 20, held >> 20], freed_mib=freed >> 20, ok=equal and freed > 0)


def fused_sampling_vs_plain(model) -> dict:
    """`kernels.sample_rows` draws the same ids as the plain ops (noise from `gumbel_noise`) for 256
    sampled rows of every codebook of a frame: the in-kernel hash and float64 logs follow the plain ones;
    for the talker's codebook with its logits processor folded in (against `TalkerLogitsProcessor`'s
    ops), and for the code predictor's with the picks' embeddings written (against a lookup)."""
    from engine.model import kernels
    from engine.sampling import TalkerLogitsProcessor, gumbel_noise, sample
    dev, b = model.device, 256
    g = torch.Generator(device=dev).manual_seed(2)
    seed = torch.randint(0, 1 << 62, (b,), device=dev, generator=g)
    frame = torch.randint(0, 4000, (b,), device=dev, generator=g)
    greedy, top_p = torch.zeros(b, dtype=torch.bool, device=dev), torch.ones(b, dtype=torch.float64, device=dev)
    temperature = torch.full((b,), 0.9, device=dev)
    top_k = torch.full((b,), 50, dtype=torch.long, device=dev)
    same = total = 0
    for codebook, v in ((0, 3072), *((c, 2048) for c in range(1, 16))):
        logits = torch.randn(b, v, device=dev, generator=g) * 2
        # top_p_any with every top_p at 1: the plain ops' path (its top-p leaves such rows alone)
        plain = sample(logits, greedy, temperature, top_k, top_p, seed, frame, codebook, top_p_any=True,
                       noise=gumbel_noise(seed, frame, codebook, v))
        fused = kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, codebook)
        same += int((plain == fused).sum())
        total += b
        if codebook == 0:       # the talker's processor: penalty on seen ids, EOS before min_new_tokens, suppression
            processor = TalkerLogitsProcessor(v, v - 1000, dev)
            seen = torch.rand(b, v, device=dev, generator=g) < 0.2
            penalty = torch.full((b,), 1.3, device=dev)
            min_new = torch.randint(0, 8000, (b,), device=dev, generator=g)
            plain = sample(processor(logits, seen, frame, penalty, min_new), greedy, temperature, top_k, top_p, seed,
                           frame, codebook, top_p_any=True, noise=gumbel_noise(seed, frame, codebook, v))
            fused = kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, codebook,
                                        processing=kernels.TalkerProcessing(seen, penalty, min_new, processor.eos_id,
                                                                            processor.suppress_from))
        else:                   # the next step's input written as the code predictor's sampler picks
            table = torch.randn(v, 1024, device=dev, generator=g).to(model.dtype)
            rows = torch.empty(b, 1024, device=dev, dtype=model.dtype)
            fused = kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, codebook, embed=(table, rows))
            same += int((rows == table[fused]).all(dim=1).sum())
            total += b
        same += int((plain == fused).sum())
        total += b
    return dict(check="fused_sampling_vs_plain", same_ids=same / total, ok=same == total)


def _turns_either_way(model, module, name: str, values: tuple, max_batch: int, turns: list[tuple[str, int, int]],
                      voice_seed: int) -> tuple[bool, float, int]:
    """Seeded, sampled turns (text, max_frames = min_new_tokens, seed), all submitted at once to a
    scheduler of `max_batch` slots, once with `module.name` set to each of the two `values`: whether
    every turn's codes are equal, the largest PCM difference (inf where codes differ) and the frames."""
    voice = model.make_voice(np.random.default_rng(voice_seed).standard_normal(48000).astype(np.float32) * 0.1,
                             24000)
    out = []
    for value in values:
        with mock.patch.object(module, name, value), Scheduler(model, max_batch, keep_codes=True) as s:
            handles = [s.submit(SpeechRequest(text=text, voice=voice, language="english", max_frames=frames,
                                              sampling=SamplingParams(seed=seed, min_new_tokens=frames)))
                       for text, frames, seed in turns]
            out.append([h.collect(timeout=300) for h in handles])
    equal, pcm_diff, frames = True, 0.0, 0
    for (chunks_a, a), (chunks_b, b) in zip(*out):
        same = a.codes.shape == b.codes.shape and bool((a.codes == b.codes).all())
        pa, pb = np.concatenate([c.pcm for c in chunks_a]), np.concatenate([c.pcm for c in chunks_b])
        equal &= same
        pcm_diff = max(pcm_diff, float(np.abs(pa - pb).max()) if same else float("inf"))
        frames += int(a.codes.shape[0])
    return equal, pcm_diff, frames


def dependent_launch_vs_plain(model) -> dict:
    """A seeded, sampled turn through the scheduler's graphs with `kernels.launch.PDL` on and off. A kernel
    that read its predecessor's output before waiting for it would show as different codes. (The
    vocoder launches plainly either way; its graphs may take other cuDNN algorithms: not bit for bit.)"""
    from engine.model.kernels import launch
    equal, pcm_diff, frames = _turns_either_way(
        model, launch, "PDL", (True, False), 4, [("Kernels launched while the one before still runs.", 40, 7)], 2)
    return dict(check="dependent_launch_vs_plain", frames=frames, codes_equal=equal,
                pcm_max_abs_diff=round(pcm_diff, 5), ok=equal and pcm_diff < 0.05)


def vocoder_stream_vs_steps_stream(model) -> dict:
    """Seeded, sampled turns through the scheduler with the vocoder on a stream of its own and on the
    steps' stream: three sessions on two slots, so the third takes the slot of one that ended (its
    stream state is reset while the vocoder may still be decoding the last window of the one before).
    A read of frames before the step wrote them, or a reset racing a decode, shows as other audio."""
    from engine import streaming
    turns = [(f"Turn {i}: audio decoded beside the steps.", frames, 11 + i) for i, frames in enumerate((20, 40, 30))]
    equal, pcm_diff, _ = _turns_either_way(model, streaming, "VOCODER_STREAM", ("1", "0"), 2, turns, 3)
    return dict(check="vocoder_stream_vs_steps_stream", sessions=len(turns), codes_equal=equal,
                pcm_max_abs_diff=round(pcm_diff, 5), ok=equal and pcm_diff < 0.05)


def scheduler_does_not_wait_for_the_gpu(model) -> dict:
    """Turns joining and leaving a scheduler's slots frame by frame (12 turns of varied lengths through 4
    slots), with PyTorch's sync debug mode on: no engine code may wait for the GPU but where it reads
    results back (events, which the mode does not flag), captures a CUDA graph or times a kernel's launch
    configs (a shape's first use) and empties the allocator with no session left. Any other wait leaves the
    GPU idle while the host works: under steady load each admission's status read and each `t[idx] = 0` did
    (bench/README, eighteenth session)."""
    import traceback
    import warnings
    voice = model.make_voice(np.random.default_rng(4).standard_normal(48000).astype(np.float32) * 0.1, 24000)
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return
        stack = [f for f in traceback.extract_stack() if "/engine/" in f.filename]
        if stack and not any(f.name in ("release_cached_memory", "capture_graph", "fastest") for f in stack):
            site = " < ".join(f"{f.filename.rsplit('/engine/')[-1]}:{f.lineno} {f.line}" for f in reversed(stack[-2:]))
            sites[site] = sites.get(site, 0) + 1

    with Scheduler(model, 4) as s:
        def turns(seed0):
            lengths = np.random.default_rng(seed0).integers(6, 30, 12)
            handles = [s.submit(SpeechRequest(text=f"Turn {i} of a steady load.", voice=voice, language="english",
                                              max_frames=int(n), sampling=SamplingParams(seed=seed0 + i,
                                                                                         min_new_tokens=int(n))))
                       for i, n in enumerate(lengths)]
            return [h.collect(timeout=300) for h in handles]
        turns(0)            # graphs captured on first use, the allocator warmed
        with warnings.catch_warnings():          # which puts the filters and showwarning back
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                results = turns(100)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    complete = all(r.reason == "max_frames" for _, r in results)
    return dict(check="scheduler_does_not_wait_for_the_gpu", turns=len(results), waits=sum(sites.values()),
                sites=sorted(sites, key=sites.get, reverse=True)[:6], ok=complete and not sites)


def split_attention_vs_one_program(model) -> dict:
    """`decode_attention` with a row's keys cut over 2 or 4 programs (partials merged by the last to
    arrive) against the one-program kernel, at the talker's first layer over random earlier keys, 1 and
    4 rows of up to 500 keys: the output (the merge sums in another order: bf16 rounding apart) and the
    K/V written, 200 launches each (a merge that read a partial before it was written would differ in
    some), and every arrival counter back at 0."""
    from engine.model import kernels
    g = torch.Generator(device=model.device).manual_seed(5)
    talker = model.talker
    attn = talker.model.layers[0].self_attn
    args = (attn.heads, attn.kv_heads, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, talker.model.inv_freq)
    rows, worst, kv_equal, counters = [], 0.0, True, []
    for b in (1, 4):
        cache = talker.new_cache(b, 512)
        start = torch.randint(1, 500, (b,), device=model.device, generator=g)
        kv = [torch.randn(b, 512, cache.kv_heads, cache.head_dim, device=model.device, generator=g).to(model.dtype)
              for _ in range(2)]
        qkv = torch.randn(b, 1, (attn.heads + 2 * attn.kv_heads) * attn.head_dim, device=model.device,
                          generator=g).to(model.dtype)
        for config in kernels.ATTENTION_CONFIGS:
            if config is not kernels.ATTENTION_CONFIGS[0] and config["SPLIT"] == 1:
                continue
            cache.write(0, *kv, torch.zeros(b, dtype=torch.long, device=model.device))
            outs = [kernels.decode_attention(qkv, *args, cache, 0, start, config) for _ in range(200)]
            written = torch.cat(cache.read(0, b, 512), dim=-1)
            if config["SPLIT"] == 1:
                expected, expected_kv = outs[0], written
                continue
            e = max(err(o, expected)["rel_rms"] for o in outs)
            worst = max(worst, e)
            kv_equal &= torch.equal(written, expected_kv)
            rows.append(f"{b} rows, split {config['SPLIT']}, {config['BLOCK_K']} keys a block: {e:.1e}")
        counters.append(int(kernels.attention._arrival_counters(qkv.device, "split attention, 1 positions", b * attn.kv_heads).sum()))
    return dict(check="split_attention_vs_one_program", rel_rms=rows, worst_rel_rms=worst, kv_equal=kv_equal,
                counters_after=counters, ok=worst < 0.01 and kv_equal and counters == [0, 0])


def short_attention_vs_per_head(model) -> dict:
    """`decode_attention` over the code predictor's short cache in every `_short_attention_kernel`
    config (a row's KV heads in one program, or a few) against one program a KV head, at its first
    layer over random earlier keys: 1, 2 and 256 rows, 1 and 2 new positions, rows with no earlier key
    and with 14; 20 launches each (the same output every time), and the keys and values written."""
    from engine.model import kernels
    g = torch.Generator(device=model.device).manual_seed(6)
    predictor = model.talker.code_predictor
    attn = predictor.model.layers[0].self_attn
    args = (attn.heads, attn.kv_heads, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
            predictor.model.inv_freq)
    rows, worst, kv_equal, repeatable = [], 0.0, True, True
    for b, t in ((1, 1), (1, 2), (2, 1), (2, 2), (256, 1), (256, 2)):
        cache = predictor.new_cache(b)
        kv = [torch.randn(b, cache.capacity, attn.kv_heads, attn.head_dim, device=model.device, generator=g).to(model.dtype)
              for _ in range(2)]
        start = (torch.arange(b, device=model.device) % 2) * (cache.capacity - t)
        qkv = torch.randn(b, t, (attn.heads + 2 * attn.kv_heads) * attn.head_dim, device=model.device,
                          generator=g).to(model.dtype)
        results = []                    # (output, K/V cached) of the per-head kernel, then each short config
        for config in [kernels.ATTENTION_CONFIGS[0]] + [c for c in kernels.attention_configs(cache) if "KVH" in c]:
            cache.write(0, *kv, torch.zeros(b, dtype=torch.long, device=model.device))
            outs = [kernels.decode_attention(qkv, *args, cache, 0, start, config) for _ in range(20)]
            repeatable &= all(torch.equal(o, outs[0]) for o in outs)
            results.append((outs[0], torch.cat(cache.read(0, b, cache.capacity), dim=-1)))
        (expected, expected_kv), *short = results
        for out, written in short:
            worst = max(worst, err(out, expected)["rel_rms"])
            kv_equal &= torch.equal(written, expected_kv)
        rows.append(f"{b} rows, {t} positions: worst so far {worst:.1e}")
    return dict(check="short_attention_vs_per_head", rel_rms=rows, worst_rel_rms=worst, kv_equal=kv_equal,
                repeatable=repeatable, ok=worst < 0.01 and kv_equal and repeatable)


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated names of the checks to run (default: all)")
    args = ap.parse_args()
    checks = (prefill_graph_vs_eager, vocoder_runs_vs_eager, vocoder_kernels_vs_torch_ops,
              vocoder_channels_last_vs_first, scheduler_graphs_vs_eager, kv_pages_come_and_go, fused_sampling_vs_plain,
              dependent_launch_vs_plain, vocoder_stream_vs_steps_stream, scheduler_does_not_wait_for_the_gpu,
              split_attention_vs_one_program, short_attention_vs_per_head)
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {c.__name__ for c in checks}
        if unknown:
            ap.error(f"unknown checks: {', '.join(sorted(unknown))}")
        checks = [c for c in checks if c.__name__ in names]
    model = load_model(args.model_dir, device="cuda", dtype=getattr(torch, args.dtype))
    ok = True
    for check in checks:
        row = {"peer": "qwen3-tts-server", "kind": "gpu_check", "dtype": args.dtype, **check(model)}
        ok &= row["ok"]
        emit(row, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
