"""bf16 against fp32 on the same random weights: each component's error, and greedy code agreement.

    python -m bench.precision --model-dir /tmp/rand06b [--device cuda]

Components: talker prefill logits, code-predictor logits (first frame), vocoder waveform (random
codes), x-vector and reference codes of a synthetic reference. Then the same greedy request is
synthesized in both precisions (EOS suppressed, `--frames` frames) and the fraction of equal codes is
reported, for codebook 0 and for all 16 (codes diverge for good after the first flip, so the first
differing frame is reported too). The fused decode path (Triton kernels, `DecoderStack._decode`) is
compared with the plain ops in each precision: logits of decode steps after one prefill, and greedy
codes.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine.loader import load_model
from engine.model.kernels import snake_beta, snake_beta_reference
from engine.requests import SamplingParams, SpeechRequest
from engine.sampling import write_embedding
from engine.synth import synthesize
from bench.results import emit


def err(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().flatten(), b.float().flatten()
    return {"max_abs": (a - b).abs().max().item(), "rel_rms": ((a - b).norm() / b.norm().clamp_min(1e-12)).item(),
            "ref_max": b.abs().max().item()}


def set_fused_decode(m, enabled: bool) -> None:
    for stack in (m.talker.model, m.talker.code_predictor.model):
        stack.fused_decode = enabled


def fused_vs_plain_decode(m, embeds: torch.Tensor, steps: int = 4) -> dict:
    """Talker logits of `steps` decode positions after a prefill of `embeds` [1, T, D], fused vs plain."""
    logits = {}
    for fused in (True, False):
        set_fused_decode(m, fused)
        cache = m.talker.new_cache(1, embeds.shape[1] + steps + 1)
        m.talker(embeds, cache, torch.zeros(1, dtype=torch.long, device=m.device))
        g = torch.Generator(device=m.device).manual_seed(0)
        out = []
        for i in range(steps):
            x = torch.randn(1, 1, embeds.shape[-1], device=m.device, generator=g).to(m.dtype) * 0.1
            start = torch.full((1,), embeds.shape[1] + i, dtype=torch.long, device=m.device)
            out.append(m.talker.logits(m.talker(x, cache, start, kmax=cache.capacity)))
        logits[fused] = torch.cat(out)
    set_fused_decode(m, True)
    return err(logits[True], logits[False])


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    models = {name: load_model(args.model_dir, device=args.device, dtype=dt)
              for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    ref = (np.sin(np.arange(3 * 24000) * 2 * np.pi * 140 / 24000) * 0.3).astype(np.float32)
    ref += np.random.default_rng(0).standard_normal(ref.shape).astype(np.float32) * 0.01
    text = "The quick brown fox jumps over the lazy dog while the sun sets behind the distant hills."
    rows = {}
    voices = {n: m.make_voice(ref, 24000, ref_text="A synthetic reference clip.") for n, m in models.items()}
    x = torch.randn(4, 96, 24000, device=args.device) * 3
    la, lb = torch.randn(96, device=args.device) * 0.3, torch.randn(96, device=args.device) * 0.3
    rows["snake_beta_kernel"] = err(snake_beta(x, la, lb), snake_beta_reference(x.double(), la.double(), lb.double()))
    rows["xvector"] = err(voices["bf16"].xvector, voices["fp32"].xvector)
    rows["ref_codes_equal"] = float((voices["bf16"].ref_codes == voices["fp32"].ref_codes).float().mean())
    voice = voices["fp32"]
    outs, forced = {}, []
    for n, m in models.items():      # fp32 first: bf16 is teacher-forced with fp32's codes

        prompt = m.prompts.build(m.tokenizer.text_ids(text), voice, "english")
        x = prompt.embeds.to(m.device, m.dtype)[None]
        cache = m.talker.new_cache(1, x.shape[1] + 1)
        h = m.talker(x, cache, torch.zeros(1, dtype=torch.long, device=m.device))[:, -1]
        logits = m.talker.logits(h)
        c0 = outs["fp32"][3] if n == "bf16" else logits.argmax(-1)
        cp = []

        def pick(lg, g, embed):
            cp.append(lg)
            if n == "fp32":
                forced.append(lg.argmax(-1))
            if embed is not None:
                write_embedding(forced[g - 1], embed)
            return forced[g - 1]
        m.talker.predict_codes(h, c0, pick)
        codes = torch.randint(0, 2048, (1, 50, 16), generator=torch.Generator().manual_seed(0)).to(m.device)
        wav = m.vocoder.decode_unchunked(codes)
        outs[n] = (logits, torch.stack(cp), wav, c0)
        rows[f"fused_vs_plain_decode_{n}_logits"] = fused_vs_plain_decode(m, x)
    rows["talker_logits"] = err(outs["bf16"][0], outs["fp32"][0])
    m = models["fp32"]                     # the fused GPU layout (loader default on CUDA) vs separate ops
    prompt = m.prompts.build(m.tokenizer.text_ids(text), voice, "english")
    x = prompt.embeds.to(m.device, m.dtype)[None]
    fused_logits = []
    for enabled in (True, False):
        m.talker.model.fuse(enabled)
        cache = m.talker.new_cache(1, x.shape[1] + 1)
        fused_logits.append(m.talker.logits(m.talker(x, cache, torch.zeros(1, dtype=torch.long, device=m.device))))
    m.talker.model.fuse(True)
    rows["fused_vs_separate_fp32_logits"] = err(fused_logits[0], fused_logits[1])
    top2 = outs["fp32"][0].topk(2, dim=-1).values[0]
    rows["talker_fp32_top1_margin"] = (top2[0] - top2[1]).item()    # random weights: near-ties
    rows["predictor_logits"] = err(outs["bf16"][1], outs["fp32"][1])
    rows["vocoder_wav"] = err(outs["bf16"][2], outs["fp32"][2])
    if torch.device(args.device).type == "cuda":     # graphed streaming windows == eager ones
        from engine.graphs import VocoderGraphs
        from engine.model.vocoder import VocoderStreams
        voc = models["bf16"].vocoder
        eager, graphed = VocoderStreams(voc, 8), VocoderStreams(voc, 8)
        graphs = VocoderGraphs(graphed, (2, 8))
        slots = torch.tensor([5, 0, 3], device=args.device)
        for s in (eager, graphed):
            s.reset(torch.arange(8, device=args.device))
        pieces = []
        for w in (2, 8, 8, 3):
            codes = torch.randint(0, 2048, (3, w, 16), device=args.device)
            pieces.append((eager.decode(slots, codes), graphs.decode(slots, codes).clone()))
        rows["vocoder_graphs_vs_eager"] = err(torch.cat([g for _, g in pieces], 1), torch.cat([e for e, _ in pieces], 1))
    greedy = SamplingParams(greedy=True, min_new_tokens=args.frames + 2)
    codes = {n: synthesize(m, [SpeechRequest(text=text, voice=voice, language="english", sampling=greedy,
                                             max_frames=args.frames)])[0].codes for n, m in models.items()}
    set_fused_decode(models["bf16"], False)
    codes["bf16_plain"] = synthesize(models["bf16"], [SpeechRequest(text=text, voice=voice, language="english",
                                                                  sampling=greedy, max_frames=args.frames)])[0].codes
    set_fused_decode(models["bf16"], True)
    for name, (x, y) in {"greedy_codes": ("bf16", "fp32"), "greedy_codes_bf16_fused_vs_plain": ("bf16", "bf16_plain")}.items():
        a, b = np.asarray(codes[x]), np.asarray(codes[y])
        differ = np.nonzero((a != b).any(axis=1))[0]
        rows[name] = {"frames": int(a.shape[0]), "agree_c0": float((a[:, 0] == b[:, 0]).mean()),
                      "agree_all": float((a == b).mean()),
                      "first_differing_frame": int(differ[0]) if len(differ) else None}
    row = {"peer": "qwen3-tts-server", "kind": "precision", **rows}
    emit(row, args.out)


if __name__ == "__main__":
    main()
