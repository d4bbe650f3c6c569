"""Fused GPU kernels where a profile shows the time, each with the plain PyTorch op as its reference.

- SnakeBeta is ~56% of the vocoder's GPU time as four separate elementwise kernels (PERF_NOTES.md);
  one Triton kernel reads x once and writes y once.
- QK-norm + RoPE: per attention layer, RMSNorm of each q and k head followed by rotate-half RoPE is
  ~12 small kernels; one kernel per tensor does both. The decode step runs 103 attention layers, so at
  small batch this is a large share of its kernel count.
Elsewhere (CPU, no Triton) the PyTorch expressions run; `bench/precision.py` compares the two on GPU.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:      # CPU-only installs
    triton = None


def snake_beta_reference(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel."""
    alpha = torch.exp(log_alpha)[None, :, None]
    beta = torch.exp(log_beta)[None, :, None]
    return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


if triton is not None:
    @triton.jit
    def _snake_beta_kernel(x_ptr, y_ptr, a_ptr, b_ptr, C, T, BLOCK: tl.constexpr):
        row = tl.program_id(0)                      # one (batch, channel) row of T samples
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < T
        c = row % C
        alpha = tl.exp(tl.load(a_ptr + c).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(b_ptr + c).to(tl.float32)) + 1e-9)
        x = tl.load(x_ptr + row * T + col, mask=mask).to(tl.float32)
        s = tl.sin(x * alpha)
        tl.store(y_ptr + row * T + col, (x + inv_beta * s * s).to(y_ptr.dtype.element_ty), mask=mask)


def snake_beta(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    if triton is None or not x.is_cuda:
        return snake_beta_reference(x, log_alpha, log_beta)
    x = x.contiguous()
    y = torch.empty_like(x)
    b, c, t = x.shape
    block = 1024
    _snake_beta_kernel[(b * c, triton.cdiv(t, block))](x, y, log_alpha, log_beta, c, t, BLOCK=block)
    return y


def qk_norm_rope_reference(x, weight, eps, cos, sin):
    """x [B, T, H, D] -> RMSNorm over D (times weight), then RoPE with cos/sin [B, T, D]."""
    x32 = x.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float())
    half = x.shape[-1] // 2
    rot = torch.cat((-n[..., half:], n[..., :half]), dim=-1)
    return (n * cos.float()[:, :, None] + rot * sin.float()[:, :, None]).to(x.dtype)


if triton is not None:
    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, y_ptr, w_ptr, cos_ptr, sin_ptr, H, stride_bt, eps,
                             D: tl.constexpr, HALF: tl.constexpr):
        row = tl.program_id(0)                     # one head vector: (b*T + t) * H + h
        bt, h = row // H, row % H
        i = tl.arange(0, HALF)
        src = x_ptr + bt * stride_bt + h * D
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        n1 = x1 * inv * tl.load(w_ptr + i).to(tl.float32)
        n2 = x2 * inv * tl.load(w_ptr + HALF + i).to(tl.float32)
        c1 = tl.load(cos_ptr + bt * D + i).to(tl.float32)
        c2 = tl.load(cos_ptr + bt * D + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + bt * D + i).to(tl.float32)
        s2 = tl.load(sin_ptr + bt * D + HALF + i).to(tl.float32)
        dst = y_ptr + row * D
        tl.store(dst + i, (n1 * c1 - n2 * s1).to(y_ptr.dtype.element_ty))
        tl.store(dst + HALF + i, (n2 * c2 + n1 * s2).to(y_ptr.dtype.element_ty))


def qk_norm_rope(x, weight, eps, cos, sin):
    """Fused `qk_norm_rope_reference` on CUDA: x [B, T, H, D] may be a strided view (a slice of a fused
    QKV projection) as long as each head vector is contiguous; returns a contiguous [B, T, H, D]."""
    b, t, h, d = x.shape
    if triton is None or not x.is_cuda or d & (d - 1) or x.stride(-1) != 1 or x.stride(2) != d or x.stride(0) != t * x.stride(1):
        return qk_norm_rope_reference(x, weight, eps, cos, sin)
    y = torch.empty((b, t, h, d), dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    _qk_norm_rope_kernel[(b * t * h,)](x, y, weight, cos, sin, h, x.stride(1), eps, D=d, HALF=d // 2)
    return y
