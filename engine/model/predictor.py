"""The code predictor ("sub-talker"): codebooks 1..15 of a frame from the talker's hidden state.

MODEL.md section 3. Parameter names mirror `talker.code_predictor.*` of the checkpoint:
`model.layers.N.*`, `model.norm`, `model.codec_embedding.{0..14}` (embeds codebook i+1) and
`lm_head.{0..14}` (predicts codebook i+1), and `small_to_mtp_projection`: the talker-width inputs
projected to the predictor's width where the two differ (1.7B: 2048 -> 1024, with a bias); where they
are the same (0.6B) it is the identity and has no weights (MODEL.md 3.1, T13).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import PredictorConfig
from ..kv_cache import KVCache
from .layers import DecoderStack

# A sampler's (table [V, D], out [B, D]): it writes table[ids] of its picks into out as well
Embed = tuple[torch.Tensor, torch.Tensor]
# sample_fn(logits, group, embed) -> ids (see `CodePredictor.predict`)
SampleFn = Callable[[torch.Tensor, int, "Embed | None"], torch.Tensor]


class PredictorModel(DecoderStack):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int):
        super().__init__(cfg.transformer)
        # The embedding width is the talker's hidden size (MODEL.md T13).
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, talker_hidden)
                                             for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.num_steps = cfg.num_code_groups - 1
        self.model = PredictorModel(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.transformer.hidden_size, cfg.vocab_size, bias=False)
                                     for _ in range(self.num_steps))
        hidden = cfg.transformer.hidden_size
        self.small_to_mtp_projection = nn.Linear(talker_hidden, hidden) if hidden != talker_hidden else None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Talker-width inputs [..., talker_hidden] at the predictor's width (`small_to_mtp_projection`)."""
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def new_cache(self, num_slots: int) -> KVCache:
        """A cache for `num_slots` rows of one frame (num_code_groups positions each).

        It needs no reset between frames: every position a step reads was written earlier in the
        same frame, so one cache, allocated once, serves every frame (CUDA-graph friendly).
        """
        t = self.cfg.transformer
        w = self.lm_head[0].weight
        n = self.cfg.num_code_groups
        return KVCache(t.num_hidden_layers, num_slots, n, t.num_key_value_heads, t.head_dim, w.dtype, w.device,
                       page_size=n, reserve_all=True)

    def predict(self, h: torch.Tensor, c0_embed: torch.Tensor, sample_fn: SampleFn,
                cache: KVCache | None = None) -> torch.Tensor:
        """Codes [B, 15] (codebooks 1..15) of one frame for rows 0..B-1.

        h: [B, D] the talker's final-normed hidden state at the position whose logits gave c0.
        c0_embed: [B, D] the TALKER codec embedding of c0 (`Talker.embed_codec(c0)`; see
          `Talker.predict_codes`, which does this for you).
        sample_fn(logits [B, vocab] in the model's dtype, group, embed) -> ids [B]: picks codebook
          `group` (1..15); MODEL.md 6.3 samples them in fp32 (`engine.sampling.sample` casts them).
          embed: None, or (the next step's codec embedding table, out [B, D]) for it to write the picks'
          rows into (the fused sampling kernel does this as it picks: no lookup kernel of its own).
        cache: from `new_cache(n)` with n >= B, reused across frames; None allocates one.
        Step 1 runs the 2 positions [h, c0_embed] at positions 0, 1; step s runs CPE[s-1](c_{s-1})
        at position s, each input through `project`. Positions restart at 0 every frame (MODEL.md 3.2).
        """
        b = h.shape[0]
        cache = self.new_cache(b) if cache is None else cache
        x = self.project(torch.stack([h, c0_embed], dim=1))
        # positions[p] = [p] * B: each step's start, made at once (one kernel, not one a step)
        positions = torch.arange(self.num_steps + 1, device=h.device)[:, None].expand(-1, b).contiguous()
        start = positions[0]
        codes = []
        for step in range(1, self.num_steps + 1):
            # the final norm of the one position the head reads, folded into the head's GEMM
            hidden = self.model(x, cache, start, kmax=step + 1, final_norm=False)
            logits = self.model.head(hidden[:, -1], self.lm_head[step - 1], normed=False)
            if step < self.num_steps:       # the sampler writes the next step's input, CPE[step-1](ids)
                embedded = torch.empty_like(h)
                codes.append(sample_fn(logits, step, (self.model.codec_embedding[step - 1].weight, embedded)))
                x = self.project(embedded[:, None])
                start = positions[step + 1]
            else:
                codes.append(sample_fn(logits, step, None))
        return torch.stack(codes, dim=1)
