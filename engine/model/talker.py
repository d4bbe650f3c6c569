"""The talker: a Qwen3-style LM over codec tokens, conditioned on projected text embeddings.

MODEL.md section 2. Parameter names mirror `talker.*` of the checkpoint, so
`load_into(Talker(cfg.talker, cfg.predictor), tensors, "talker.")` loads the whole tree, the code
predictor included. M-RoPE with three identical position axes is plain 1-D RoPE (MODEL.md T15).

Typical use by a runner (all tensors batched, rows = slots):
    cache = talker.new_cache(num_slots, capacity)           # every position reserved
    hidden = talker(embeds, cache, start, slots=slots)       # prefill, right-padded rows
    logits = talker.logits(hidden[rows, lengths - 1])         # [B, vocab] fp32
    ... c0 = sample(...)
    rest = talker.predict_codes(h, c0, sample_fn, cp_cache)   # [B, 15]
    x = talker.embed_frame(cat([c0[:, None], rest], 1), plus=text_term)
    hidden = talker(x[:, None], cache, lengths, kmax=bucket)  # decode over slots 0..B-1
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import PredictorConfig, TalkerConfig
from ..kv_cache import KVCache
from . import kernels
from .layers import DecoderStack
from .predictor import CodePredictor, SampleFn


class TalkerModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.transformer)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.transformer.hidden_size)


class TextProjection(nn.Module):
    """ResizeMLP: fc2(silu(fc1(x))), with biases."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x):
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig, predictor_cfg: PredictorConfig):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.transformer.hidden_size
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, hidden)
        self.codec_head = nn.Linear(hidden, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(predictor_cfg, hidden)
        self.text_table: torch.Tensor | None = None     # E_t of every text id, once `tabulate_text` made it

    def new_cache(self, num_slots: int, capacity: int, reserve_all: bool = True, page_size: int = 64) -> KVCache:
        """A talker KV cache of `num_slots` sequences of up to `capacity` positions, all of them
        writable (`reserve_all`), or taken as the caller reserves them (the runner)."""
        t = self.cfg.transformer
        w = self.codec_head.weight
        return KVCache(t.num_hidden_layers, num_slots, capacity, t.num_key_value_heads, t.head_dim,
                       w.dtype, w.device, page_size=page_size, reserve_all=reserve_all)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """E_t(ids) = text_projection(text_embedding(ids)) -> [..., D] (a row of `text_table` once made)."""
        if self.text_table is not None:
            return F.embedding(ids, self.text_table)
        return self.text_projection(self.model.text_embedding(ids))

    @torch.no_grad()
    def tabulate_text(self, chunk: int = 8192) -> None:
        """Replace the text embedding and its projection by their product, E_t of every text id
        [text vocab, D]: the projection is per token, so a lookup gives what it computes. On the
        0.6B model that is 0.29 GiB in bf16 where the two held 0.59, and a decode step's text costs
        one gather instead of a gather and two GEMMs. Each row is computed as `embed_text` did, in the
        model's dtype (a GPU does the 151,936 rows in a blink; a CPU would take tens of seconds)."""
        table = self.model.text_embedding.weight
        self.text_table = torch.cat([self.text_projection(table[i:i + chunk]) for i in range(0, table.shape[0], chunk)])
        self.model.text_embedding = self.text_projection = None

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """E_c(ids): the talker codec embedding (vocab 3072: codes and control ids) -> [..., D]."""
        return self.model.codec_embedding(ids)

    def embed_frame(self, codes: torch.Tensor, plus: torch.Tensor | None = None) -> torch.Tensor:
        """codes [..., 16] -> [..., D]: E_c(c0) + sum_g CPE[g](c_g) as ONE reduction (MODEL.md T17),
        then `plus` (a decode step's text term) added; on the fused decode path one kernel, launched
        like the step's others, for what were 16 lookups, a stack, a sum and an add."""
        tables = [self.model.codec_embedding] + list(self.code_predictor.model.codec_embedding)
        if self.model.fused_decode:
            return kernels.embedding_sum(codes, [t.weight for t in tables], plus)
        x = torch.stack([t(codes[..., g]) for g, t in enumerate(tables)], dim=-2).sum(dim=-2)
        return x if plus is None else x + plus

    def forward(self, embeds: torch.Tensor, cache: KVCache, start: torch.Tensor,
                slots: torch.Tensor | None = None, kmax: int | None = None) -> torch.Tensor:
        """Final-normed hidden states [B,T,D] of embeds [B,T,D] at positions start[b]..start[b]+T-1.

        K/V are written into the cache at those positions of slot slots[b] (row b = slot b when slots
        is None: the decode pattern, no gather). Query t of row b sees keys 0..start[b]+t. Rows may be
        right-padded: their padded positions produce garbage that lands after their real tokens.
        kmax (python int, > max(start)+T-1 of the rows you use) limits the keys read; None reads the
        whole capacity (exact too, only slower). No host sync either way.
        """
        return self.model(embeds, cache, start, slots, kmax)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """codec_head in the model dtype, then fp32 (MODEL.md 6.2 step 1) -> [..., vocab]."""
        return self.model.head(hidden, self.codec_head).float()

    def predict_codes(self, h: torch.Tensor, c0: torch.Tensor, sample_fn: SampleFn,
                      cache: KVCache | None = None) -> torch.Tensor:
        """Codebooks 1..15 [B,15] of the frame whose first code c0 [B] came from hidden h [B,D]."""
        return self.code_predictor.predict(h, self.embed_codec(c0), sample_fn, cache)
