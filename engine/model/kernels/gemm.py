"""The decode path's GEMMs with what surrounds them in a transformer layer folded in.

At a handful of rows cuBLAS reads the weights at a quarter of the memory bandwidth; `linear` streams
them in one skinny kernel (tensor-core tiles, or for 1-2 rows a CUDA-core one, whichever times
fastest on the device) that also does the RMSNorm before the GEMM and the SwiGLU gate or the
residual add after it: with `decode_attention`, 5 kernels a layer. A config may load its column
block's whole weight rows into registers before the dependent-launch wait (`PRELOAD`), so that after
it only x is read; the timing at warm-up decides per shape. Past 16 rows the GEMMs are cuBLAS's, with
`rms_norm` and `silu_mul` as kernels of their own and the residual add cuBLAS's, into the stack's own
buffer (addmm_: 8 kernels a layer, where addmm's copy of the residual first made 10).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .launch import (copies_beyond_l2, dependent_launch_start, fastest, launch_kernel, pdl_options, prefetch_rows_l2,
                     tl, triton)

# `linear` asks for its weights only with QWEN3_TTS_LINEAR_PREFETCH=1: one stream on an H100 ran 12%
# faster without (19.6x -> 22.0x, call BK-BL, bench/README.md; it was +3% in call AJ).
LINEAR_PREFETCH = os.environ.get("QWEN3_TTS_LINEAR_PREFETCH", "0") == "1"


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        dependent_launch_start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one kernel: fp32 statistics, the weight applied before the
    cast back (the math of `F.rms_norm`)."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty_like(x)
    _rms_norm_kernel[(x.numel() // n,)](x, y, weight, n, eps, BLOCK=triton.next_power_of_2(n), **pdl_options(x))
    return y


if triton is not None:
    @triton.jit
    def _silu_mul(gate, up, dtype: tl.constexpr):
        """silu(gate) * up of values in `dtype`, rounded as F.silu then a multiply round them."""
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (act * up.to(tl.float32)).to(dtype)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
        tl.store(y_ptr + row * N + cols, _silu_mul(gate, up, y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2 * N] gate/up projection -> [..., N]."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    y = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(gate_up.numel() // (2 * n), triton.cdiv(n, block))](gate_up, y, n, BLOCK=block)
    return y


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _mac(acc, x, w, DOT: tl.constexpr, IEEE: tl.constexpr):
        """acc + x @ w.T: on the tensor cores (DOT), else on the CUDA cores (a handful of rows)."""
        if DOT:
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _prefetch_weights_l2(w_ptr, col0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
        """Ask L2 for the weight rows of the BLOCK_N-wide column block at col0 (`_linear_block`'s)."""
        prefetch_rows_l2(w_ptr + col0 * K, N - col0, K, K, BLOCK_N, BLOCK_K)
        if GATED:
            prefetch_rows_l2(w_ptr + (N + col0) * K, N - col0, K, K, BLOCK_N, BLOCK_K)

    @triton.jit
    def _normed(x, norm_w_ptr, inv, k, K, NORM: tl.constexpr):
        """x's columns k RMS-normed by the rows' statistics `inv` and the norm's weights (NORM), in the
        activation dtype as the separate ops round it; else x as it is."""
        if NORM:
            nw = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * inv[:, None] * nw[None, :]).to(x.dtype)
        return x

    @triton.jit
    def _linear_store(acc, acc_up, y_ptr, r_ptr, M, N, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      GATED: tl.constexpr, RESIDUAL: tl.constexpr):
        """A column block's epilogue: the SwiGLU gate (GATED: acc holds gate, acc_up up) or the residual
        add (RESIDUAL), each intermediate rounded to the activation dtype, then the store to y."""
        dtype = y_ptr.dtype.element_ty
        cols = col0 + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        y = acc.to(dtype)
        if GATED:
            y = _silu_mul(y, acc_up.to(dtype), dtype)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if RESIDUAL:
            r = tl.load(r_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)

    @triton.jit
    def _linear_block(x_ptr, w_ptr, y_ptr, r_ptr, norm_w_ptr, M, N, K, eps, col0,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT: tl.constexpr, IEEE: tl.constexpr, NORM: tl.constexpr,
                      GATED: tl.constexpr, RESIDUAL: tl.constexpr):
        """The BLOCK_N-wide column block at col0 of y [M, N] = x [M, K] @ w.T for all (<= BLOCK_M) rows,
        streaming its weight rows once. NORM: x is RMS-normed first (x's rows, a few KB, are read for
        the statistics). GATED: w is [gate; up] (2N rows) and y = silu(x gate.T) * (x up.T). RESIDUAL:
        y += r. Every intermediate is rounded to the activation dtype where the separate ops round."""
        cols = col0 + tl.arange(0, BLOCK_N)      # output features (weight rows)
        rows = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows[:, None] * K
        w_rows = w_ptr + cols[:, None] * K
        inv = tl.zeros([BLOCK_M], tl.float32)
        if NORM:
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                x = tl.load(x_rows + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
                ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
            inv = tl.rsqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            x = tl.load(x_rows + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
            x = _normed(x, norm_w_ptr, inv, k, K, NORM)
            w_mask = (cols[:, None] < N) & (k[None, :] < K)
            acc = _mac(acc, x, tl.load(w_rows + k[None, :], mask=w_mask, other=0.0), DOT, IEEE)
            if GATED:
                acc_up = _mac(acc_up, x, tl.load(w_rows + N * K + k[None, :], mask=w_mask, other=0.0), DOT, IEEE)
        _linear_store(acc, acc_up, y_ptr, r_ptr, M, N, col0, BLOCK_M, BLOCK_N, GATED, RESIDUAL)

    @triton.jit
    def _skinny_linear_kernel(x_ptr, w_ptr, y_ptr, r_ptr, norm_w_ptr, M, N, K, eps,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              DOT: tl.constexpr, IEEE: tl.constexpr, NORM: tl.constexpr,
                              GATED: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                              PREFETCH: tl.constexpr, PRELOAD: tl.constexpr):
        """`_linear_block` of the column block of program_id(0), its weights asked of L2 before the wait; or
        (PRELOAD, BLOCK_K >= K) the block's whole weight rows loaded into registers before the wait,
        so that after it only x is read: the weights' read overlaps the kernel before."""
        col0 = tl.program_id(0) * BLOCK_N
        if PRELOAD:
            cols = col0 + tl.arange(0, BLOCK_N)
            rows = tl.arange(0, BLOCK_M)
            k = tl.arange(0, BLOCK_K)
            w_at = w_ptr + cols[:, None] * K + k[None, :]
            w_mask = (cols[:, None] < N) & (k[None, :] < K)
            w = tl.load(w_at, mask=w_mask, other=0.0)
            w_up = w
            if GATED:
                w_up = tl.load(w_at + N * K, mask=w_mask, other=0.0)
            dependent_launch_start(PDL)
            x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
            inv = tl.zeros([BLOCK_M], tl.float32)
            if NORM:
                inv = tl.rsqrt(tl.sum(x.to(tl.float32) * x.to(tl.float32), 1) / K + eps)
            x = _normed(x, norm_w_ptr, inv, k, K, NORM)
            acc = _mac(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), x, w, DOT, IEEE)
            acc_up = acc
            if GATED:
                acc_up = _mac(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), x, w_up, DOT, IEEE)
            _linear_store(acc, acc_up, y_ptr, r_ptr, M, N, col0, BLOCK_M, BLOCK_N, GATED, RESIDUAL)
        else:
            if PREFETCH:
                _prefetch_weights_l2(w_ptr, col0, N, K, BLOCK_N, BLOCK_K, GATED)
            dependent_launch_start(PDL)
            _linear_block(x_ptr, w_ptr, y_ptr, r_ptr, norm_w_ptr, M, N, K, eps, col0,
                          BLOCK_M, BLOCK_N, BLOCK_K, DOT, IEEE, NORM, GATED, RESIDUAL)


SKINNY_ROWS = 16        # up to this many rows `linear` takes the skinny kernel
GEMV_ROWS = 2           # up to this many, its CUDA-core variant is a candidate too
_DOT_CONFIGS = [dict(kernel="dot", BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st) for n, k, w, st in
                ((16, 256, 4, 4), (16, 128, 4, 4), (16, 512, 4, 3), (16, 256, 2, 4), (32, 256, 4, 4),
                 (16, 128, 2, 6), (32, 128, 4, 4), (16, 64, 2, 8))]
_GEMV_CONFIGS = [dict(kernel="gemv", BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st) for n, k, w, st in
                 ((8, 256, 4, 4), (4, 512, 4, 4), (2, 1024, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (4, 256, 2, 6),
                  (8, 1024, 8, 2), (2, 2048, 8, 2))]


# Configs that load a column block's whole weight rows into registers before the wait (`PRELOAD`): one
# program a few columns wide, no K loop (BLOCK_K = K rounded up to a power of two). Candidates where
# the block's weight rows and x's rows fit PRELOAD_THREAD_BYTES a thread: beyond, ptxas spills (sm_90,
# the 0.6B model's shapes). QWEN3_TTS_PRELOAD=0 leaves them out.
PRELOAD = os.environ.get("QWEN3_TTS_PRELOAD", "1") != "0"
PRELOAD_THREAD_BYTES = 320
_PRELOAD_CONFIGS = [dict(kernel=kind, BLOCK_N=n, num_warps=w, num_stages=1, PRELOAD=True) for kind, n, w in
                    (("gemv", 4, 4), ("gemv", 4, 8), ("gemv", 8, 4), ("gemv", 8, 8), ("gemv", 16, 8), ("gemv", 32, 8),
                     ("gemv", 16, 16), ("dot", 16, 8))]


def linear_configs(rows: int, k: int, gated: bool = False, element_size: int = 2) -> list[dict]:
    """The launch configs `linear` times for this many rows of K inputs (the first is taken untimed)."""
    gemv = rows <= GEMV_ROWS
    configs = _DOT_CONFIGS + (_GEMV_CONFIGS if gemv else [])
    if PRELOAD:
        configs = configs + [c for c in _PRELOAD_CONFIGS if (gemv or c["kernel"] == "dot")
                             and _preload_fits(c, k, gated, element_size)]
    return configs


def _whole_width_config(rows: int, n: int, k: int) -> dict:
    """One program for all N columns (up to 4096 a program): in Triton's interpreter a grid's programs
    run one after another, ~16 ms each, and a 16-column config made the tiny model's code-predictor
    head (2048 columns) 128 of them, 2 s a call."""
    return dict(kernel="gemv" if rows <= GEMV_ROWS else "dot", BLOCK_N=min(4096, triton.next_power_of_2(n)),
                BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4, num_stages=1)


def _preload_fits(config: dict, k: int, gated: bool, element_size: int) -> bool:
    """Whether a PRELOAD config's registers hold its block's weight rows (gate and up rows when gated)
    and x's rows, K padded to a power of two, within PRELOAD_THREAD_BYTES a thread."""
    x_rows = 16 if config["kernel"] == "dot" else GEMV_ROWS
    weight_rows = config["BLOCK_N"] * (2 if gated else 1)
    row_bytes = (1 << (k - 1).bit_length()) * element_size
    return (x_rows + weight_rows) * row_bytes <= PRELOAD_THREAD_BYTES * 32 * config["num_warps"]


def linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           gated: bool = False, residual: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
    """x @ weight.T (no bias) for the fused decode path, with what surrounds a GEMM in a transformer
    layer folded in: the RMSNorm before it (`norm_weight`, `eps`), the SwiGLU gate after it (`gated`:
    weight is [gate; up], the result silu(gate) * up) or the residual add after it (`residual`).

    Up to SKINNY_ROWS rows it is one skinny kernel (the fastest of `linear_configs` for its shapes,
    timed once on the GPU); beyond, where cuBLAS is good, the RMSNorm and gate are kernels of their own
    and the residual add is cuBLAS's (beta = 1). in_place: the residual is the caller's own buffer and
    dead after the call, so beyond SKINNY_ROWS the add is done into it (addmm_) instead of into a copy
    of it (addmm copies the residual into its output first: a kernel a call).
    """
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    x2 = x.reshape(rows, k)
    r2 = None if residual is None else residual.reshape(rows, n)
    if rows > SKINNY_ROWS:
        if norm_weight is not None:
            x2 = rms_norm(x2, norm_weight, eps)
        if gated:
            y = silu_mul(F.linear(x2, weight))
        elif r2 is not None:
            y = r2.addmm_(x2, weight.t()) if in_place else torch.addmm(r2, x2, weight.t())
        else:
            y = F.linear(x2, weight)
        return y.view(*x.shape[:-1], n)
    x2 = x2.contiguous()
    r2 = None if r2 is None else r2.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)

    def launch(c, compile_only=False, weight=weight):
        skinny_linear(x2, weight, y, c, norm_weight, eps, gated, r2, compile_only)

    def copies():       # weights a decode step streams from memory, one layer after another
        count = copies_beyond_l2(weight.numel() * weight.element_size(), weight.device)
        return [launch] + [functools.partial(launch, weight=weight.clone()) for _ in range(count - 1)]

    key = linear_timing_key(rows, n, k, x.dtype, norm_weight is not None, gated, r2 is not None)
    launch(fastest(key, linear_configs(rows, k, gated, weight.element_size()), launch, copies,
                   off_gpu=_whole_width_config(rows, n, k)))
    return y.view(*x.shape[:-1], n)


def linear_timing_key(rows: int, n: int, k: int, dtype: torch.dtype, norm: bool, gated: bool, residual: bool) -> tuple:
    """The key `linear`'s skinny kernel is timed under (`fastest`): the CUDA-core variants are timed
    for each row count they serve (1 and 2 rows want different configs); the tensor-core one pads to 16
    rows, so one timing serves all its row counts."""
    return ("linear", n, k, dtype, rows if rows <= GEMV_ROWS else SKINNY_ROWS, norm, gated, residual)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: dict,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                  residual: torch.Tensor | None = None, compile_only: bool = False) -> None:
    """out [M, N] = `linear`(x [M, K], weight) with one launch config of `linear_configs(M, K)`."""
    (m, k), n = x.shape, out.shape[1]
    dot = config["kernel"] == "dot"
    preload = config.get("PRELOAD", False)
    launch_kernel(_skinny_linear_kernel, (triton.cdiv(n, config["BLOCK_N"]),),
                  (x, weight, out, x if residual is None else residual, x if norm_weight is None else norm_weight,
                   m, n, k, eps),
                  dict(BLOCK_M=16 if dot else GEMV_ROWS, BLOCK_N=config["BLOCK_N"],
                       BLOCK_K=triton.next_power_of_2(k) if preload else config["BLOCK_K"], DOT=dot,
                       IEEE=x.dtype == torch.float32, NORM=norm_weight is not None, GATED=gated,
                       RESIDUAL=residual is not None, PRELOAD=preload, num_warps=config["num_warps"],
                       num_stages=config["num_stages"], **pdl_options(x, prefetch=LINEAR_PREFETCH and not preload)),
                  compile_only)
