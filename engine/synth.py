"""One-shot synthesis: whole texts in, codes and 24 kHz audio out (CLI, golden tests, offline use).

Several requests run as one batch, frame-synchronously, like the official batched
`generate_voice_clone`: every row steps together until all have finished. The audio is decoded once
at the end with the official chunked decode (MODEL.md 7.7): x-vector rows decode their codes; ICL
rows decode ref_codes ++ codes and drop the reference part with the official proportional cut (T7).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .requests import SpeechRequest
from .runner import EOS, LIMIT, RUNNING, ModelRunner

REASONS = {EOS: "eos", LIMIT: "max_frames"}


@dataclass
class SynthResult:
    codes: np.ndarray     # [frames, 16] int64
    wav: np.ndarray       # float32 [samples], 24 kHz
    reason: str           # "eos" | "max_frames"


def icl_cut(ref_frames: int, total_frames: int, samples_per_frame: int) -> int:
    """Samples of the reference to drop: the official float formula, off-by-one included (MODEL.md 9.2)."""
    return int(ref_frames / max(total_frames, 1) * (total_frames * samples_per_frame))


@torch.no_grad()
def synthesize(model, requests: list[SpeechRequest]) -> list[SynthResult]:
    """Generate every request in one batch, then decode. `model` is an `engine.loader.TTSModel`.
    The cache takes its pages as the rows grow (`ModelRunner.step`)."""
    if not requests:
        return []
    builder = model.prompts
    default_frames = model.config.generation.max_new_tokens - 1
    prompts = builder.build_many([(model.tokenizer.text_ids(r.text), r.voice, r.language, r.non_streaming_text)
                                  for r in requests])
    refused = next((p for p in prompts if isinstance(p, ValueError)), None)
    if refused is not None:
        raise refused
    limits = [default_frames if r.max_frames is None else r.max_frames for r in requests]
    if any(f < 0 for f in limits):
        raise ValueError("max_frames must be >= 0")
    b = len(requests)
    needed = max(p.embeds.shape[0] + f for p, f in zip(prompts, limits))   # final cache length
    runner = ModelRunner(model, b, needed)
    # Trailing text per row, padded with tts_pad; step k adds column min(k, last).
    width = max(p.trailing.shape[0] for p in prompts) + 1
    trailing = builder.tts_pad.expand(b, width, -1).clone()
    for i, p in enumerate(prompts):
        trailing[i, :p.trailing.shape[0]] = p.trailing

    slots = list(range(b))
    runner.admit(slots, [r.sampling for r in requests], limits)
    status = runner.prefill(slots, [p.embeds for p in prompts])
    frames: list[list[torch.Tensor]] = [[] for _ in range(b)]
    k = 0
    while any(s == RUNNING for s in status):
        active = [s == RUNNING for s in status]
        out = runner.step(b, active, trailing[:, min(k, width - 1)]).result()
        for i in np.flatnonzero(active):
            frames[i].append(out.frames[i])
            status[i] = int(out.status[i])
        k += 1
    groups = model.config.talker.num_code_groups
    codes = [torch.stack(f) if f else torch.zeros(0, groups, dtype=torch.long) for f in frames]
    wavs = decode(model, codes, [r.voice.ref_codes if r.voice.icl else None for r in requests])
    return [SynthResult(c.numpy(), w, REASONS[s]) for c, w, s in zip(codes, wavs, status)]


@torch.no_grad()
def decode(model, codes: list[torch.Tensor], ref_codes: list[torch.Tensor | None]) -> list[np.ndarray]:
    """Batched official decode of each row's codes (prefixed by its reference codes in ICL mode)."""
    spf = model.config.samples_per_frame
    full = [c if r is None else torch.cat([r.to(c.dtype), c]) for c, r in zip(codes, ref_codes)]
    total = max(f.shape[0] for f in full)
    if total == 0:
        return [np.zeros(0, dtype=np.float32) for _ in codes]
    padded = torch.full((len(full), total, model.config.talker.num_code_groups), -1, dtype=torch.long)
    for i, f in enumerate(full):
        padded[i, :f.shape[0]] = f
    lengths = torch.tensor([f.shape[0] for f in full])
    wav, samples = model.vocoder.decode(padded.to(model.device), lengths)
    wav = wav.float().cpu().numpy()
    out = []
    for i, (f, r) in enumerate(zip(full, ref_codes)):
        w = wav[i, :int(samples[i])]
        if r is not None:
            w = w[icl_cut(r.shape[0], f.shape[0], spf):]
        out.append(np.ascontiguousarray(w, dtype=np.float32))
    return out
