"""Fused GPU kernels where a profile shows the time, each with the plain PyTorch op as its reference.

SnakeBeta is ~56% of the vocoder's GPU time as four separate elementwise kernels (PERF_NOTES.md);
one Triton kernel reads x once and writes y once. Elsewhere (CPU, no Triton) the PyTorch expression
runs, and the tests compare the two.
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
