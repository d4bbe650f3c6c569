"""Building blocks shared by every transformer of the model (talker, code predictor, codec).

Numerics follow the official code (MODEL.md sections 2 and 11): RMSNorm statistics in fp32, RoPE
cos/sin computed in fp32 and cast to the activation dtype, rotate_half pairing (i, i + head_dim/2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import kernels
from .kernels import decode_attention, linear, qk_norm_rope, rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, cast back, then scaled by the weight in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:     # one fused kernel; same math, fp32 statistics (weight applied before the cast back)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LayerScale(nn.Module):
    """Learned per-channel scale of a residual branch (the codec transformers)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

        self.gate_up_weight = None          # set by `fuse` (GPU): [gate; up] as one GEMM

    def fuse(self) -> None:
        """One [2*hidden, dim] weight for gate and up; the two parameters become views of it."""
        w = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        n = self.gate_proj.weight.shape[0]
        self.gate_proj.weight.data, self.up_proj.weight.data = w[:n], w[n:]
        self.gate_up_weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """1 / theta^(2i/head_dim), computed in fp32 on the CPU as the official init does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [*positions.shape, head_dim] in `dtype` (computed in fp32)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, T, head_dim] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def causal_mask(start: torch.Tensor, t: int, kmax: int) -> torch.Tensor:
    """Boolean mask [B, 1, t, kmax]: query i of row b sees keys j <= start[b] + i.

    Built from tensors only (no host sync), so one mask serves every layer of a forward and the
    decode step keeps static shapes for a given (t, kmax).
    """
    query_pos = start[:, None] + torch.arange(t, device=start.device)              # [B, t]
    keys = torch.arange(kmax, device=start.device)
    return (keys[None, None, :] <= query_pos[:, :, None])[:, None]                 # [B, 1, t, kmax]


# Every SDPA back end but cuDNN's for the talker's prefill: cuDNN builds a plan for each new shape
# (~40 ms, up to 1 s on an H200), and the eager prefill of a group of admissions meets a new
# (rows, length) almost every time; the other back ends cost the same per call after the first.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q, k, v, mask):
    """softmax(q k^T / sqrt(d)) v under a boolean mask; q [B,H,T,D], k/v [B,H,K,D], mask [B,1,T,K].

    SDPA everywhere but on CUDA over a handful of keys (the code predictor's <= 16 per frame), where
    one matmul + softmax + matmul beats SDPA's kernels (PERF_NOTES.md); softmax is taken in fp32.
    """
    if q.is_cuda and k.shape[-2] <= 32:
        scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return probs.to(v.dtype) @ v
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """Qwen3 attention: QK-norm before RoPE, grouped KV heads, K/V kept in a slot cache.

    GQA uses the repeat-interleave layout (KV head j serves Q heads j*g .. j*g+g-1). Instead of
    repeating K/V, the g query heads of a group are folded into the query length, so every KV head is
    read once: [B, Hq, T, Dh] -> [B, Hkv, g*T, Dh] with the mask tiled g times.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.qkv_weight = None              # set by `fuse` (GPU): [q; k; v] as one GEMM

    def fuse(self) -> None:
        """One QKV weight (the three parameters become views of it) and fused QK-norm + RoPE."""
        w = torch.cat([self.q_proj.weight.data, self.k_proj.weight.data, self.v_proj.weight.data])
        nq, nk = self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]
        self.q_proj.weight.data, self.k_proj.weight.data, self.v_proj.weight.data = w[:nq], w[nq:nq + nk], w[nq + nk:]
        self.qkv_weight = w

    def _qkv(self, x, cos, sin):
        """q [B,H,T,Dh] normed and rotated, k [B,T,Hkv,Dh] normed and rotated, v [B,T,Hkv,Dh]."""
        b, t, _ = x.shape
        if self.qkv_weight is not None:
            nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv_weight).split([nq, nk, nk], dim=-1)
            q = qk_norm_rope(q.view(b, t, self.heads, self.head_dim), self.q_norm.weight, self.q_norm.eps, cos, sin)
            k = qk_norm_rope(k.view(b, t, self.kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps, cos, sin)
            return q.transpose(1, 2), k, v.view(b, t, self.kv_heads, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin).transpose(1, 2), v

    def forward(self, x, cos, sin, cache, layer: int, start, slots, mask):
        """x [B,T,hidden]; writes this step's K/V at positions start[b]+t, attends over mask's keys."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        cache.write(layer, k, v, start, slots)
        keys, values = cache.read(layer, b, mask.shape[-1], slots)                  # [B, kmax, Hkv, Dh]
        g = self.heads // self.kv_heads
        q = q.reshape(b, self.kv_heads, g * t, self.head_dim)
        out = attend(q, keys.transpose(1, 2), values.transpose(1, 2), mask.repeat(1, 1, g, 1))
        return self.o_proj(out.reshape(b, self.heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1))

    def decode(self, h, norm: RMSNorm, cache, layer: int, start, inv_freq, kmax=None, own_h: bool = False):
        """h + self(norm(h)) for the decode pattern (rows = slots 0..B-1, a few new positions each): the
        norm in the QKV GEMM, the attention core in one kernel (`kernels.decode_attention`, its launch
        config timed for rows of up to kmax keys), the residual add in the output GEMM (into h itself
        where `own_h`: h is the stack's own buffer, read by no one after). Needs `fuse`."""
        qkv = linear(h, self.qkv_weight, norm.weight, norm.eps)
        out = decode_attention(qkv, self.heads, self.kv_heads, self.q_norm.weight, self.k_norm.weight,
                               self.q_norm.eps, inv_freq, cache, layer, start, kmax=kmax)
        return linear(out, self.o_proj.weight, residual=h, in_place=own_h)


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, cache, layer: int, start, slots, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, layer, start, slots, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode(self, h, cache, layer: int, start, inv_freq, kmax=None, own_h: bool = False):
        """`forward` for the fused decode path: 3 GEMMs with the norms, the gate and the residual adds
        folded in (`kernels.linear`), and the attention kernel. The residual adds may write into the
        buffer they add to where it is the stack's own (the attention's: `own_h`, h is not the stack's
        input; the MLP's always, its h made by the attention's add)."""
        h = self.self_attn.decode(h, self.input_layernorm, cache, layer, start, inv_freq, kmax, own_h)
        norm, mlp = self.post_attention_layernorm, self.mlp
        act = linear(h, mlp.gate_up_weight, norm.weight, norm.eps, gated=True)
        return linear(act, mlp.down_proj.weight, residual=h, in_place=True)


class DecoderStack(nn.Module):
    """`layers.N` + final `norm` with 1-D RoPE over a KVCache (the talker's and code predictor's `model`).

    Subclasses add their embeddings, so parameter names stay those of the checkpoint.
    """

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)
        self.fused_decode = False           # set by `fuse` on CUDA: decode forwards take `_decode`
        self.fused_weights: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # by `fuse`: each layer's QKV and gate/up

    def fuse(self, enabled: bool = True) -> None:
        """GPU layout: fused QKV and gate/up GEMMs, fused QK-norm + RoPE (same parameters, fewer
        kernels), and on CUDA the fused decode path. `enabled=False` goes back to the separate
        projections (the fused weights are kept, the parameters stay views of them)."""
        if enabled and self.fused_weights is None:
            for layer in self.layers:
                layer.self_attn.fuse()
                layer.mlp.fuse()
            self.fused_weights = [(l.self_attn.qkv_weight, l.mlp.gate_up_weight) for l in self.layers]
        for layer, (qkv, gate_up) in zip(self.layers, self.fused_weights or []):
            layer.self_attn.qkv_weight, layer.mlp.gate_up_weight = (qkv, gate_up) if enabled else (None, None)
        attn = self.layers[0].self_attn
        self.fused_decode = (enabled and kernels.triton is not None and self.norm.weight.is_cuda
                             and kernels.decode_attention_supports(attn.head_dim))

    def forward(self, x, cache, start, slots=None, kmax=None, final_norm: bool = True):
        """x [B,T,D] at positions start[b]..start[b]+T-1 of slot slots[b] (row b when None).

        Returns the final-normed hidden states [B,T,D] (without the final norm if not `final_norm`:
        `head(..., normed=False)` applies it). Attention covers keys 0..kmax-1 (default: the
        whole cache capacity); kmax must exceed max(start)+T-1 for the rows whose outputs are used.
        """
        t = x.shape[1]
        if self.fused_decode and slots is None and t <= 2:
            x = self._decode(x, cache, start, kmax)
            return rms_norm(x, self.norm.weight, self.norm.eps) if final_norm else x
        kmax = cache.capacity if kmax is None else kmax
        positions = start[:, None] + torch.arange(t, device=start.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        mask = causal_mask(start, t, kmax)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start, slots, mask)
        return self.norm(x) if final_norm else x

    def head(self, hidden: torch.Tensor, head: nn.Linear, normed: bool = True) -> torch.Tensor:
        """An output head (no bias) on final hidden states, or on hidden states not yet final-normed
        (`normed=False`): on the fused decode path the skinny GEMM kernel, launched like the layers'
        (`kernels.linear`), with the norm folded in, else the modules."""
        if self.fused_decode:
            return linear(hidden, head.weight, None if normed else self.norm.weight, self.norm.eps)
        return head(hidden if normed else self.norm(hidden))

    def _decode(self, x, cache, start, kmax=None):
        """The layers of `forward` for decode steps (rows = slots 0..B-1, T <= 2): the same math in 5
        kernels a layer at up to 16 rows (8 beyond), the norms, gate and residual adds folded into the
        GEMMs and the attention core in one kernel. Attention reads each row's live keys: kmax only
        says what length its launch config is timed for."""
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, cache, i, start, self.inv_freq, kmax, own_h=i > 0)   # x: the caller's, then ours
        return x
