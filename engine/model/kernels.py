"""Fused GPU kernels where a profile shows the time, each with the plain PyTorch op as its reference.

- SnakeBeta is ~56% of the vocoder's GPU time as four separate elementwise kernels (PERF_NOTES.md);
  one Triton kernel reads x once and writes y once. At many streams the vocoder is bound by passes
  over its high-rate activations: a SnakeBeta writes the next conv's left context ahead of its
  output (no concatenated copy), and a residual unit's second SnakeBeta, 1x1 conv and residual add
  (with both convs' biases) are one kernel, `residual_tail`.
- QK-norm + RoPE: per attention layer, RMSNorm of each q and k head followed by rotate-half RoPE is
  ~12 small kernels; one kernel per tensor does both (the prefill path).
- The decode step (1 talker + 15 code-predictor forwards of 1-2 positions, 103 layers per frame) is
  bound by kernel launches at small batch, ~25 a layer as plain ops. `decode_attention` does a layer's
  whole attention core in one kernel (QK-norm, RoPE from the positions, K/V cache write, causal
  attention over the row's cache; at a few rows a long context's keys may be cut over several programs
  a KV head, the last to finish merging their partials; over a short cache, the code predictor's 16
  positions, a kernel that takes a few KV heads or all of a row's at once, the new keys from registers
  and the older ones loaded before the wait, is timed beside it). At a handful of rows cuBLAS reads
  the weights at a quarter of the memory bandwidth; `linear` streams them in one skinny kernel
  (tensor-core tiles, or for 1-2 rows a CUDA-core one, whichever times fastest on the device) that
  also does the RMSNorm before the GEMM and the SwiGLU gate or the residual add after it: 5 kernels a
  layer. Past 16 rows the GEMMs are cuBLAS's, with `rms_norm` and `silu_mul` as kernels of their own
  and the residual add cuBLAS's, into the stack's own buffer (addmm_: 8 kernels a layer, where
  addmm's copy of the residual first made 10).
- A frame's embedding for the next talker step (16 lookups in 16 tables, summed, plus the text
  term) was ~18 plain kernels a step; `embedding_sum` is one.
- Sampling a codebook (temperature, top-k, Gumbel-max draw, greedy rows) is ~15 small kernels as
  plain ops, 16 times a frame, plus ~20 for the seeded noise; `sample_rows` is one, noise and the
  logits' cast to fp32 included, and the talker's logits processor (~10 more) too.
- The end of a step (each moving row's new hidden state and first code, its counters and status, the
  frames packed for the host) was ~20 elementwise kernels; `advance_rows` is one.
- Even at 5 kernels a layer a one-row step is ~550 kernels of a few microseconds, each paying a launch
  gap after the one before. On Hopper and later the decode path's kernels are launched as programmatic
  dependents (`PDL`): the GPU starts each while the one before still runs, and it waits
  (griddepcontrol.wait) before reading or writing anything. A code-predictor step is such a chain
  from end to end: its layers, output head, and sampling (which writes the next token's embedding
  as it picks). The weights a `linear` streams do not depend on the kernel before it, nor do the keys
  and values `decode_attention` reads from earlier steps, so each asks L2 for them before it waits:
  their read from memory overlaps the kernel before instead of following it. A `linear` config may go
  further (`PRELOAD`): a narrow column block loads its whole weight rows into registers before the
  wait, so that after it only x is read; the timing at warm-up decides per shape.
Elsewhere (CPU, no Triton) the PyTorch expressions run; `bench/precision.py` compares the two on GPU.
The tests run the Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:      # CPU-only installs
    triton = None

compiles = 0             # Triton kernel variants this process compiled (or loaded from the disk cache)


def _count_compiles() -> None:
    """Count each kernel variant Triton builds on first use: a variant first met while serving stalls
    the engine for as long as its compile takes (the scheduler logs the count with a slow iteration)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        return
    chained = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        global compiles
        compiles += 1
        return chained(**kwargs) if chained is not None else None
    knobs.runtime.jit_post_compile_hook = hook


if triton is not None:
    _count_compiles()

# Programmatic dependent launch of the decode path's kernels (see above); QWEN3_TTS_PDL=0 turns it off.
PDL = os.environ.get("QWEN3_TTS_PDL", "1") != "0"
# With PDL, `linear` and `decode_attention` may ask L2 for their weights / older keys and values before
# they wait (see `_prefetch_rows_l2`); QWEN3_TTS_PREFETCH=0: they never do.
PREFETCH = os.environ.get("QWEN3_TTS_PREFETCH", "1") != "0"
# `linear` asks for its weights only with QWEN3_TTS_LINEAR_PREFETCH=1: one stream on an H100 ran 12%
# faster without (19.6x -> 22.0x, call BK-BL, bench/README.md; it was +3% in call AJ); `decode_attention`
# where its timing picks it (ATTENTION_CONFIGS).
LINEAR_PREFETCH = os.environ.get("QWEN3_TTS_LINEAR_PREFETCH", "0") == "1"


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(x: torch.Tensor, prefetch: bool | None = None) -> dict:
    """Launch options of a decode-path kernel for data on x's device: the `PDL` constexpr (the kernel
    waits for its predecessor first) and Triton's `launch_pdl`, on a GPU that has them; for a kernel
    with a `PREFETCH` constexpr (`prefetch` not None: whether that kernel wants it), that too: it asks L2
    for its data while it waits."""
    on = PDL and x.is_cuda and _pdl_capable(x.device)
    options = dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)
    return options if prefetch is None else dict(options, PREFETCH=on and PREFETCH and prefetch)


def snake_beta_reference(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor,
                         bias: torch.Tensor | None = None, left: torch.Tensor | None = None) -> torch.Tensor:
    """SnakeBeta of x [B, C, T] (plus a per-channel `bias` first, as a separate add would):
    x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel; after `left` [B, C, L] if given
    (the next conv's left context: [left, snake(x)] along time)."""
    if bias is not None:
        x = x + bias[None, :, None]
    alpha = torch.exp(log_alpha)[None, :, None]
    beta = torch.exp(log_beta)[None, :, None]
    y = x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)
    return y if left is None else torch.cat([left, y], dim=-1)


def residual_tail_reference(x: torch.Tensor, y: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor,
                            y_bias: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The end of a vocoder residual unit, x + conv1x1(SnakeBeta(y + y_bias)) + bias, for x and y
    [B, C, T] (y: the unit's dilated conv output, its bias `y_bias` left out) and the 1x1 conv's
    weight [C, C, 1] and bias [C]; `x_bias`, if given, is a bias x still lacks (the upsampling conv's
    before a block's first unit). Each bias added as the separate ops would add it."""
    if x_bias is not None:
        x = x + x_bias[None, :, None]
    h = snake_beta_reference(y, log_alpha, log_beta, y_bias)
    return x + (F.conv1d(h, weight) + bias[None, :, None])


if triton is not None:
    @triton.jit
    def _snake(x, log_alpha, log_beta, bias, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
        """SnakeBeta of fp32 x (a per-channel bias added first, rounded as the conv's own bias add
        rounds), rounded to `dtype`; the per-channel parameters broadcast against x."""
        if HAS_BIAS:
            x = (x + bias.to(tl.float32)).to(dtype).to(tl.float32)
        inv_beta = 1.0 / (tl.exp(log_beta.to(tl.float32)) + 1e-9)
        s = tl.sin(x * tl.exp(log_alpha.to(tl.float32)))
        return (x + inv_beta * s * s).to(dtype)

    @triton.jit
    def _snake_beta_kernel(x_ptr, y_ptr, a_ptr, b_ptr, bias_ptr, left_ptr, C, T, L, stride_xb, stride_xc, stride_xt,
                           stride_yb, stride_yc, stride_yt, stride_left, HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
        """A [BLOCK_C channels, BLOCK_T samples] tile of one stream's [left, snake(x)] (x, y in either
        layout: the strides say which of channels or samples are adjacent)."""
        col0 = tl.program_id(0) * BLOCK_T
        col = col0 + tl.arange(0, BLOCK_T)                              # output sample: L of left, T of x
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        b = tl.program_id(2).to(tl.int64)
        cm = c < C
        mask = cm[:, None] & (col < L + T)[None, :]
        x = tl.load(x_ptr + b * stride_xb + c[:, None] * stride_xc + (col - L)[None, :] * stride_xt,
                    mask=mask & (col >= L)[None, :]).to(tl.float32)
        y = _snake(x, tl.load(a_ptr + c, mask=cm)[:, None], tl.load(b_ptr + c, mask=cm)[:, None],
                   tl.load(bias_ptr + c, mask=cm)[:, None], HAS_BIAS, y_ptr.dtype.element_ty)
        y_ptrs = y_ptr + b * stride_yb + c[:, None] * stride_yc + col[None, :] * stride_yt
        tl.store(y_ptrs, y, mask=mask & (col >= L)[None, :])
        # left ([C, L] a stream, samples adjacent) copied as it is ahead of the new samples, by the tiles
        # that hold any of it only: with channels adjacent in y, that copy is a transpose through shared
        # memory, which the other tiles (most of them) need not pay
        if HAS_LEFT and col0 < L:
            in_left = mask & (col < L)[None, :]
            tl.store(y_ptrs, tl.load(left_ptr + b * stride_left + c[:, None] * L + col[None, :], mask=in_left),
                     mask=in_left)

    @triton.jit
    def _residual_tail_kernel(x_ptr, y_ptr, out_ptr, a_ptr, b_ptr, y_bias_ptr, w_ptr, bias_ptr, x_bias_ptr, C, T,
                              stride_xb, stride_xc, stride_xt, stride_yb, stride_yc, stride_yt,
                              stride_ob, stride_oc, stride_ot, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr,
                              BLOCK_T: tl.constexpr, IEEE: tl.constexpr, HAS_X_BIAS: tl.constexpr):
        """A [BLOCK_CO channels, BLOCK_T samples] tile of one stream's output: the SnakeBeta of y's
        tile, channel block by channel block, into the 1x1 conv's GEMM (tensor cores), then its bias
        and the residual x (plus x's own bias first, HAS_X_BIAS). y and x are read once, out written
        once (the separate ops: 3 passes). x, y and out in either layout (the strides say which of
        channels or samples are adjacent)."""
        dtype = out_ptr.dtype.element_ty
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        co = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)
        b = tl.program_id(2).to(tl.int64)
        acc = tl.zeros([BLOCK_CO, BLOCK_T], tl.float32)
        for ci0 in range(0, C, BLOCK_CI):
            ci = ci0 + tl.arange(0, BLOCK_CI)
            cm = ci < C
            y = tl.load(y_ptr + b * stride_yb + ci[:, None] * stride_yc + t[None, :] * stride_yt,
                        mask=cm[:, None] & (t[None, :] < T), other=0.0)
            h = _snake(y.to(tl.float32), tl.load(a_ptr + ci, mask=cm, other=0.0)[:, None],
                       tl.load(b_ptr + ci, mask=cm, other=0.0)[:, None],
                       tl.load(y_bias_ptr + ci, mask=cm, other=0.0)[:, None], True, dtype)
            w = tl.load(w_ptr + co[:, None] * C + ci[None, :], mask=(co[:, None] < C) & cm[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(w, h, input_precision="ieee")
            else:
                acc += tl.dot(w, h)
        mask = (co[:, None] < C) & (t[None, :] < T)
        conv = acc.to(dtype).to(tl.float32) + tl.load(bias_ptr + co, mask=co < C, other=0.0).to(tl.float32)[:, None]
        x = tl.load(x_ptr + b * stride_xb + co[:, None] * stride_xc + t[None, :] * stride_xt, mask=mask,
                    other=0.0).to(tl.float32)
        if HAS_X_BIAS:                          # rounded as the conv's own bias add rounds
            x = (x + tl.load(x_bias_ptr + co, mask=co < C, other=0.0).to(tl.float32)[:, None]).to(dtype).to(tl.float32)
        tl.store(out_ptr + b * stride_ob + co[:, None] * stride_oc + t[None, :] * stride_ot,
                 (x + conv.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def snake_beta(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor,
               bias: torch.Tensor | None = None, left: torch.Tensor | None = None) -> torch.Tensor:
    """`snake_beta_reference` in one pass over x on CUDA (`left` copied in the same pass: no
    concatenated copy of the whole activation for the conv after it)."""
    if triton is None or not x.is_cuda:
        return snake_beta_reference(x, log_alpha, log_beta, bias, left)
    return snake_beta_triton(x, log_alpha, log_beta, bias, left)


def _channels_adjacent(x: torch.Tensor) -> bool:
    """Whether x [B, C, T] has its channels adjacent in memory (the vocoder's channels-last layout)."""
    return x.shape[1] > 1 and x.stride(1) == 1


def new_samples(like: torch.Tensor, samples: int) -> torch.Tensor:
    """An empty [B, C, samples] tensor in like's [B, C, T] layout: its channels adjacent in memory
    (strides (samples * C, 1, C), the vocoder's activations on CUDA) if like's are, else contiguous."""
    b, c, _ = like.shape
    if _channels_adjacent(like):
        return like.new_empty(b, samples, c).transpose(1, 2)
    return like.new_empty(b, c, samples)


# Launch configs `snake_beta` times per shape (the first is taken untimed): tiles of BLOCK_C channels by
# BLOCK_T samples, for tensors whose channels are adjacent in memory (`vocoder.CHANNELS_LAST`) and for
# those whose samples are. Each was the fastest at some of the vocoder's widths (an H100, 8-frame windows
# of 32 streams, bench/README.md): channels-last, 16 x 256 from 96 to 384 channels, 16 x 128 (2 warps)
# at 768 and 1536, 256 x 16 or 128 x 32 at 1536; channels-first, 2 x 512 at every width.
SNAKE_CONFIGS = {True: [dict(BLOCK_C=c, BLOCK_T=t, num_warps=w) for c, t, w in
                        ((16, 256, 4), (16, 128, 2), (128, 32, 4), (256, 16, 4), (32, 128, 4))],
                 False: [dict(BLOCK_C=c, BLOCK_T=t, num_warps=w) for c, t, w in ((2, 512, 4), (1, 1024, 4))]}


def snake_beta_triton(x, log_alpha, log_beta, bias=None, left=None, config: dict | None = None) -> torch.Tensor:
    """`snake_beta` with one of `SNAKE_CONFIGS` for y's layout (default: the fastest for these shapes,
    timed once on the GPU)."""
    b, c, t = x.shape
    n_left = 0 if left is None else left.shape[-1]
    if left is not None and left[0].stride() != (n_left, 1):     # rows of a stream's state are [C, L] blocks
        left = left.contiguous()
    y = new_samples(x, n_left + t)
    adjacent = _channels_adjacent(y)

    def launch(cfg, compile_only=False):
        grid = (triton.cdiv(n_left + t, cfg["BLOCK_T"]), triton.cdiv(c, cfg["BLOCK_C"]), b)
        _launch(_snake_beta_kernel, grid,
                (x, y, log_alpha, log_beta, x if bias is None else bias, x if left is None else left, c, t, n_left,
                 *x.stride(), *y.stride(), 0 if left is None else left.stride(0)),
                dict(HAS_BIAS=bias is not None, HAS_LEFT=left is not None, **cfg), compile_only)
    if config is None:
        key = ("snake_beta", c, triton.next_power_of_2(b * (n_left + t)), x.dtype, adjacent, bias is not None,
               left is not None)
        config = _fastest(key, SNAKE_CONFIGS[adjacent], launch)
    launch(config)
    return y


def residual_tail(x: torch.Tensor, y: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor,
                  y_bias: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`residual_tail_reference` in one kernel on CUDA: at the decoder's high rates a residual unit's
    SnakeBeta, 1x1 conv and residual add each made a pass over its largest activations (with cuDNN's
    layout conversions around the conv); this reads y and x once and writes the output once."""
    if triton is None or not x.is_cuda:
        return residual_tail_reference(x, y, log_alpha, log_beta, y_bias, weight, bias, x_bias)
    return residual_tail_triton(x, y, log_alpha, log_beta, y_bias, weight, bias, x_bias=x_bias)


# Launch configs `residual_tail` times per shape (the first is taken untimed): tiles of BLOCK_CO output
# channels by BLOCK_T samples, stepping through the input channels BLOCK_CI (default 32) at a time in
# num_stages (default 3). A tile computes the SnakeBeta of every input channel once, so a block of 256
# channels computes it half as often as one of 128 where channels are many (the low rates). On an H100
# (bench.vocoder_tiles, bench/README.md) 64 x 128 tiles and steps of 64 or 128 channels were 1.5-3x
# slower at every width and either layout, and 4 stages no faster than 3.
RESIDUAL_TAIL_CONFIGS = [dict(BLOCK_CO=co, BLOCK_T=t, num_warps=w) for co, t, w in
                         ((128, 64, 4), (128, 128, 8), (256, 64, 8))]


def residual_tail_configs(channels: int) -> list[dict]:
    """The configs `residual_tail` times for this many channels (no block wider than needed)."""
    return [c for c in RESIDUAL_TAIL_CONFIGS if c["BLOCK_CO"] <= max(128, triton.next_power_of_2(channels))]


def residual_tail_triton(x, y, log_alpha, log_beta, y_bias, weight, bias, config: dict | None = None,
                         x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`residual_tail` with one of `residual_tail_configs` (default: the fastest for these shapes,
    timed once on the GPU)."""
    b, c, t = x.shape
    out = new_samples(y, t)

    def launch(cfg, compile_only=False):
        grid = (triton.cdiv(t, cfg["BLOCK_T"]), triton.cdiv(c, cfg["BLOCK_CO"]), b)
        _launch(_residual_tail_kernel, grid,
                (x, y, out, log_alpha, log_beta, y_bias, weight.reshape(c, c), bias, bias if x_bias is None else x_bias,
                 c, t, *x.stride(), *y.stride(), *out.stride()),
                dict(BLOCK_CO=cfg["BLOCK_CO"], BLOCK_CI=cfg.get("BLOCK_CI", 32), BLOCK_T=cfg["BLOCK_T"],
                     IEEE=x.dtype == torch.float32, HAS_X_BIAS=x_bias is not None, num_warps=cfg["num_warps"],
                     num_stages=cfg.get("num_stages", 3)), compile_only)
    if config is None:
        key = ("residual_tail", c, triton.next_power_of_2(b * t), x.dtype, _channels_adjacent(y))
        config = _fastest(key, residual_tail_configs(c), launch)
    launch(config)
    return out


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


_fastest_config: dict = {}
_fastest_time: dict = {}       # key -> milliseconds of its `_fastest_config` (timed keys only)
log = logging.getLogger(__name__)

# The configs `_fastest` is about to time are first compiled side by side in threads (Triton releases
# the GIL while it compiles): on a fresh machine, most of the server's warm-up went to compiling them
# one after the other (~1.7 s each). QWEN3_TTS_PARALLEL_COMPILE=0 compiles each at its first launch.
PARALLEL_COMPILE = os.environ.get("QWEN3_TTS_PARALLEL_COMPILE", "1") != "0"


def _fastest(key, configs: list[dict], launch, copies=None, off_gpu: dict | None = None) -> dict:
    """The fastest launch config of a kernel for `key` (its shapes), timed once on the GPU; the first
    config while a CUDA graph is being captured, and elsewhere (`off_gpu` where given: in Triton's
    interpreter, which runs a grid's programs one after another in Python, the fewer the better).
    launch(config, compile_only=False): runs the kernel with that config, or only compiles it.
    copies(): launch functions like `launch` over copies of what the kernel streams from memory (its
    weights, a cache's layers), together more than L2 holds: with them the configs are timed as a CUDA
    graph replays calls over the copies one after the other (`_graph_time`), as a decode step's graph
    runs a layer's kernel after the one before, each on data not in L2. Without, each is timed eagerly
    by `triton.testing.do_bench`, which flushes L2 between runs."""
    best = _fastest_config.get(key)
    if best is None:
        if not torch.cuda.is_available():
            return off_gpu or configs[0]
        if torch.cuda.is_current_stream_capturing():
            return configs[0]
        _compile_candidates(configs, launch)
        if copies is None:
            time = lambda c: triton.testing.do_bench(lambda: launch(c), warmup=2, rep=10)  # noqa: E731
        else:
            launches = copies()
            time = lambda c: _graph_time(launches, c)  # noqa: E731
        times = [_time(time, c) for c in configs]
        _fastest_time[key] = min(times)
        best = _fastest_config[key] = configs[times.index(_fastest_time[key])]
    return best


def copies_beyond_l2(nbytes: int, device: torch.device, most: int = 64) -> int:
    """How many copies of `nbytes` of data together hold twice the GPU's L2 (at least 1, at most `most`)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(most, -(-2 * l2 // nbytes)))


GRAPH_TIMING_CALLS = 64      # calls a timing graph replays (cycling the copies): a replay of ~0.3 ms


def _graph_time(launches: list, config: dict, replays: int = 7) -> float:
    """Milliseconds a call takes as a CUDA graph replays GRAPH_TIMING_CALLS calls with `config`, the
    functions of `launches` in turn (the median of `replays`). Dependent launches overlap each call
    with the one before, as in a decode step; launched from Python instead, calls of a few
    microseconds would be timed at the host's pace. Captured on a stream of the timing's own, errors
    local to this thread."""
    calls = [functools.partial(f, config) for f in launches] * -(-GRAPH_TIMING_CALLS // len(launches))
    for call in calls[:len(launches)]:      # compiles, and a config that does not build fails here
        call()
    stream = _timing_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for call in calls:
                call()
        finally:
            graph.capture_end()
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
    torch.cuda.current_stream().wait_stream(stream)
    stream.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2] / len(calls)


@functools.cache
def _timing_stream(device: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)


@functools.cache
def _compile_pool() -> ThreadPoolExecutor:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=min(32, cpus), thread_name_prefix="triton-compile")


def _compile_candidates(configs: list[dict], launch) -> None:
    """Compile every config's kernel variant at once on a thread pool and wait for them all (Triton's
    `AsyncCompileMode`). Where that fails, parallel compiles are off for the process: each variant
    then compiles at its first launch, as it always may (a variant that does not compile fails there)."""
    global PARALLEL_COMPILE
    if not PARALLEL_COMPILE or len(configs) < 2:
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        with AsyncCompileMode(_compile_pool(), ignore_errors=True):
            for c in configs:
                launch(c, compile_only=True)
    except Exception as e:      # an older Triton, or an API that moved: lose the speed, not the kernels
        PARALLEL_COMPILE = False
        log.warning("parallel Triton compiles are off (%s: %s); kernels compile at first launch",
                    type(e).__name__, e)


def _launch(kernel, grid: tuple, args: tuple, options: dict, compile_only: bool = False) -> None:
    """kernel[grid](*args, **options), or, with `compile_only`, only its compile (`_compile_candidates`)."""
    if compile_only:
        kernel.warmup(*args, grid=grid, **options)
    else:
        kernel[grid](*args, **options)


def _time(time, config) -> float:
    """time(config): milliseconds of a launch with `config`; infinite for a config this GPU cannot
    build (too much shared memory, or a compile or ptxas failure on an architecture the configs were
    not tested on): the others are timed and the warm-up goes on."""
    try:
        return time(config)
    except (triton.runtime.errors.OutOfResources, triton.runtime.errors.PTXASError,
            triton.compiler.errors.CompilationError) as e:
        log.warning("kernel config %s does not build on this GPU (%s); timing the others", config, type(e).__name__)
        return float("inf")


if triton is not None:
    @triton.jit
    def _dependent_launch_start(PDL: tl.constexpr):
        """A decode-path kernel's first statement: launched while the kernel before still runs (`PDL`),
        it waits for that one's results, then lets the next kernel launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _prefetch_rows_l2(base, rows, row_len, stride, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """Ask L2 for the first `row_len` elements of rows [0, rows) at `base` (`stride` elements apart),
        one prefetch a 128-byte line. A decode-path kernel does this for what it will read that the
        kernel before it does not write (its weights, a cache's older keys) while it still waits for
        that kernel (`PDL`): the memory's latency is paid in the shadow of the kernel before."""
        LINE: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth     # elements a line
        r = tl.minimum(tl.arange(0, BLOCK_ROWS), rows - 1)[:, None]
        for c0 in range(0, row_len, BLOCK_COLS):
            c = tl.minimum(c0 + tl.arange(0, BLOCK_COLS // LINE) * LINE, row_len - 1)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [(base + r * stride + c).to(tl.int64, bitcast=True)],
                                      dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _dependent_launch_start(PDL)
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
    _rms_norm_kernel[(x.numel() // n,)](x, y, weight, n, eps, BLOCK=triton.next_power_of_2(n), **_pdl(x))
    return y


if triton is not None:
    @triton.jit
    def _embedding_sum_kernel(ids_ptr, anchor_ptr, offsets_ptr, plus_ptr, y_ptr, N, G: tl.constexpr,
                              HAS_PLUS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _dependent_launch_start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        acc = tl.zeros([BLOCK], tl.float32)
        for g in tl.static_range(G):
            table = anchor_ptr + tl.load(offsets_ptr + g)
            acc += tl.load(table + tl.load(ids_ptr + row * G + g) * N + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        y = acc.to(dtype)
        if HAS_PLUS:
            y = (y.to(tl.float32) + tl.load(plus_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(y_ptr + row * N + cols, y, mask=mask)


_table_offsets: dict[tuple, torch.Tensor] = {}


def embedding_sum(ids: torch.Tensor, tables: list[torch.Tensor], plus: torch.Tensor | None = None) -> torch.Tensor:
    """sum_g tables[g][ids[..., g]] (+ plus) -> [..., N] in one kernel: the G rows summed in fp32 and
    rounded once (as torch's sum over their stack rounds), then `plus` added as a separate add would.
    The tables are found as offsets from the first one's storage, a device tensor made at the first
    call for these tables (an eager call, before any CUDA graph captures one): they must not move."""
    ids = ids.contiguous()
    g, n = ids.shape[-1], tables[0].shape[1]
    anchor = tables[0]
    key = tuple(t.data_ptr() for t in tables)
    offsets = _table_offsets.get(key)
    if offsets is None:
        size = anchor.element_size()
        offsets = _table_offsets[key] = torch.tensor([(p - key[0]) // size for p in key], device=anchor.device)
    y = torch.empty(*ids.shape[:-1], n, dtype=anchor.dtype, device=anchor.device)
    plus = None if plus is None else plus.expand_as(y).contiguous()
    _embedding_sum_kernel[(ids.numel() // g,)](ids, anchor, offsets, y if plus is None else plus, y, n, G=g,
                                                HAS_PLUS=plus is not None, BLOCK=triton.next_power_of_2(n),
                                                **_pdl(anchor))
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
        _prefetch_rows_l2(w_ptr + col0 * K, N - col0, K, K, BLOCK_N, BLOCK_K)
        if GATED:
            _prefetch_rows_l2(w_ptr + (N + col0) * K, N - col0, K, K, BLOCK_N, BLOCK_K)

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
            _dependent_launch_start(PDL)
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
            _dependent_launch_start(PDL)
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
    launch(_fastest(key, linear_configs(rows, k, gated, weight.element_size()), launch, copies,
                    off_gpu=_whole_width_config(rows, n, k)))
    return y.view(*x.shape[:-1], n)


def linear_timing_key(rows: int, n: int, k: int, dtype: torch.dtype, norm: bool, gated: bool, residual: bool) -> tuple:
    """The key `linear`'s skinny kernel is timed under (`_fastest`): the CUDA-core variants are timed
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
    _launch(_skinny_linear_kernel, (triton.cdiv(n, config["BLOCK_N"]),),
            (x, weight, out, x if residual is None else residual, x if norm_weight is None else norm_weight,
             m, n, k, eps),
            dict(BLOCK_M=16 if dot else GEMV_ROWS, BLOCK_N=config["BLOCK_N"],
                 BLOCK_K=triton.next_power_of_2(k) if preload else config["BLOCK_K"], DOT=dot,
                 IEEE=x.dtype == torch.float32, NORM=norm_weight is not None, GATED=gated,
                 RESIDUAL=residual is not None, PRELOAD=preload, num_warps=config["num_warps"],
                 num_stages=config["num_stages"], **_pdl(x, prefetch=LINEAR_PREFETCH and not preload)), compile_only)


if triton is not None:
    @triton.jit
    def _cos_sin(pos, inv_freq, dtype: tl.constexpr):
        """RoPE's cos and sin at fp32 positions, rounded to `dtype` as the reference computes them
        (fp32, then cast to the activation dtype), as fp32."""
        f = pos * inv_freq
        return tl.cos(f).to(dtype).to(tl.float32), tl.sin(f).to(dtype).to(tl.float32)

    @triton.jit
    def _rope(x1, x2, pos, inv_freq, dtype: tl.constexpr):
        """Rotate-half RoPE of fp32 halves at fp32 positions."""
        c, s = _cos_sin(pos, inv_freq, dtype)
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def _rope_rows(x1, x2, t_rows, start, inv_freq, T: tl.constexpr, dtype: tl.constexpr):
        """`_rope` of rows [R, D/2] at positions start + t_rows (t_rows < T): cos and sin computed once
        a position ([D/2] each, T of them) and picked for each row, not once an element."""
        c = tl.zeros_like(x1)
        s = tl.zeros_like(x1)
        for t in tl.static_range(T):
            c_t, s_t = _cos_sin((start + t).to(tl.float32), inv_freq, dtype)
            at = (t_rows == t)[:, None]
            c = tl.where(at, c_t[None, :], c)
            s = tl.where(at, s_t[None, :], s)
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def _normed_rotated_rows(at, valid, w_ptr, t_rows, start, inv_freq, eps, T: tl.constexpr, D: tl.constexpr,
                             dtype: tl.constexpr):
        """Heads [R, D] read at `at` (a row's first half; rows not `valid` are zero): RMS-normed with the
        norm's weights and rotated (`_rope_rows`), as two halves in `dtype`."""
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        x1 = tl.load(at, mask=valid[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
        x1 = x1 * inv[:, None] * tl.load(w_ptr + i).to(tl.float32)[None, :]
        x2 = x2 * inv[:, None] * tl.load(w_ptr + HALF + i).to(tl.float32)[None, :]
        x1, x2 = _rope_rows(x1, x2, t_rows, start, inv_freq, T, dtype)
        return x1.to(dtype), x2.to(dtype)

    @triton.jit
    def _write_new_kv(qkv, k_cache, v_cache, pages, start, k_w_ptr, inv_freq, stride_qkv_t, capacity, eps, kvh,
                      T: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
        """KV head kvh's T new keys (RMS-normed, rotated) and values to the cache (positions past the
        capacity land in the scratch page)."""
        HALF: tl.constexpr = D // 2
        dtype = k_cache.dtype.element_ty
        i = tl.arange(0, HALF)
        d = tl.arange(0, D)
        kw1 = tl.load(k_w_ptr + i).to(tl.float32)
        kw2 = tl.load(k_w_ptr + HALF + i).to(tl.float32)
        for t in tl.static_range(T):
            src = qkv + t * stride_qkv_t + (HQ + kvh) * D
            k1 = tl.load(src + i).to(tl.float32)
            k2 = tl.load(src + HALF + i).to(tl.float32)
            inv = tl.rsqrt((tl.sum(k1 * k1, 0) + tl.sum(k2 * k2, 0)) / D + eps)
            r1, r2 = _rope(k1 * inv * kw1, k2 * inv * kw2, (start + t).to(tl.float32), inv_freq, dtype)
            pos = tl.minimum(start + t, capacity)
            dst = tl.multiple_of(tl.load(pages + pos // PAGE) + (pos % PAGE) * (HKV * D), 16)
            tl.store(k_cache + dst + i, r1.to(dtype))
            tl.store(k_cache + dst + HALF + i, r2.to(dtype))
            tl.store(v_cache + dst + d, tl.load(qkv + t * stride_qkv_t + (HQ + HKV + kvh) * D + d))

    @triton.jit
    def _group_queries(qkv, start, q_w_ptr, inv_freq, stride_qkv_t, eps, kvh, dtype: tl.constexpr,
                       T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr):
        """The G query heads of KV head kvh at each of the T positions, one row each (padded to M),
        RMS-normed and rotated, as two halves in the cache's dtype."""
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        r = tl.arange(0, M)
        t_r = r // G
        head = kvh * G + r % G
        return _normed_rotated_rows(qkv + t_r[:, None] * stride_qkv_t + head[:, None] * D + i[None, :], r < T * G,
                                    q_w_ptr, t_r, start, inv_freq, eps, T, D, dtype)

    @triton.jit
    def _attend(q1, q2, last, k_cache, v_cache, pages, k_begin, k_end, scale,
                HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr):
        """Online softmax of the M query rows over keys k_begin .. k_end-1 (k_begin a multiple of
        BLOCK_K), each row causally up to its position `last`: the running max, the sum of exp and the
        unnormalised output [M, D], all fp32."""
        HALF: tl.constexpr = D // 2
        dtype = k_cache.dtype.element_ty
        i = tl.arange(0, HALF)
        d = tl.arange(0, D)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            idx = k0 + tl.arange(0, BLOCK_K)
            in_range = idx < k_end
            # A block lies in one page (BLOCK_K divides PAGE): one offset load, then the rows as in a
            # contiguous cache. Offsets are multiples of 16 elements (pages are 512-byte aligned):
            # said so, the key and value rows load as wide vectors.
            page = tl.multiple_of(tl.load(pages + k0 // PAGE), 16)
            at = (k0 % PAGE + tl.arange(0, BLOCK_K)) * (HKV * D)
            kp = k_cache + page + at[:, None]
            keys1 = tl.load(kp + i[None, :], mask=in_range[:, None], other=0.0)
            keys2 = tl.load(kp + HALF + i[None, :], mask=in_range[:, None], other=0.0)
            if IEEE:
                s = (tl.dot(q1, tl.trans(keys1), input_precision="ieee")
                     + tl.dot(q2, tl.trans(keys2), input_precision="ieee"))
            else:
                s = tl.dot(q1, tl.trans(keys1)) + tl.dot(q2, tl.trans(keys2))
            s = tl.where((idx[None, :] <= last[:, None]) & in_range[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache + page + at[:, None] + d[None, :], mask=in_range[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _store_heads(out, o, stride_out_t, kvh, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M: tl.constexpr):
        """The rows of `_group_queries` (o [M, D]) to their heads and positions of out."""
        r = tl.arange(0, M)
        d = tl.arange(0, D)
        dst = out + (r // G)[:, None] * stride_out_t + (kvh * G + r % G)[:, None] * D + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=(r < T * G)[:, None])

    @triton.jit
    def _new_keys_then_queries(qkv, k_cache, v_cache, pages, start, q_w_ptr, k_w_ptr, inv_freq_ptr, stride_qkv_t,
                               capacity, eps, kvh, T: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr,
                               HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr, PAGE: tl.constexpr):
        """KV head kvh's new keys and values to the cache (every key is then read back from it), and
        its `_group_queries`."""
        inv_freq = tl.load(inv_freq_ptr + tl.arange(0, D // 2))
        _write_new_kv(qkv, k_cache, v_cache, pages, start, k_w_ptr, inv_freq, stride_qkv_t, capacity, eps, kvh,
                      T, HQ, HKV, D, PAGE)
        tl.debug_barrier()
        return _group_queries(qkv, start, q_w_ptr, inv_freq, stride_qkv_t, eps, kvh, k_cache.dtype.element_ty,
                              T, G, D, M)

    @triton.jit
    def _attention_group(qkv, out, k_cache, v_cache, pages, start, q_w_ptr, k_w_ptr, inv_freq_ptr,
                         stride_qkv_t, stride_out_t, capacity, eps, scale, kvh,
                         T: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         M: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """KV head kvh of one row: its T new keys (normed, rotated) and values to the cache, then its G
        query heads at each of the T positions attend causally over the row's keys. qkv, out: the row's
        [T, ...] projections and output; k_cache, v_cache: the layer's K and V of head kvh in a page;
        pages: the row's page offsets from them; start: the row's first new position."""
        q1, q2 = _new_keys_then_queries(qkv, k_cache, v_cache, pages, start, q_w_ptr, k_w_ptr, inv_freq_ptr,
                                        stride_qkv_t, capacity, eps, kvh, T, G, HQ, HKV, D, M, PAGE)
        last = start + tl.arange(0, M) // G
        m_i, l_i, acc = _attend(q1, q2, last, k_cache, v_cache, pages, 0, tl.minimum(start + T, capacity + 1),
                                scale, HKV, D, M, PAGE, BLOCK_K, IEEE)
        _store_heads(out, acc / l_i[:, None], stride_out_t, kvh, T, G, D, M)

    @triton.jit
    def _prefetch_older_kv(k_cache, v_cache, pages, k_begin, k_end, HKV: tl.constexpr, D: tl.constexpr,
                           PAGE: tl.constexpr, BLOCK_K: tl.constexpr):
        """Ask L2 for the keys and values k_begin .. k_end-1 written by earlier steps, found through the
        page table as it is before the wait (at worst stale: then the hints miss, the reads stay exact)."""
        for k0 in range(k_begin, k_end, BLOCK_K):
            at = tl.load(pages + k0 // PAGE) + (k0 % PAGE) * (HKV * D)
            _prefetch_rows_l2(k_cache + at, k_end - k0, D, HKV * D, BLOCK_K, D)
            _prefetch_rows_l2(v_cache + at, k_end - k0, D, HKV * D, BLOCK_K, D)

    @triton.jit
    def _decode_attention_kernel(
            qkv_ptr, out_ptr, anchor_ptr, table_ptr, start_ptr, q_w_ptr, k_w_ptr, inv_freq_ptr,
            stride_qkv_b, stride_qkv_t, stride_out_b, stride_out_t, stride_table, k_offset, v_offset,
            capacity, eps, scale,
            T: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
            M: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
            PREFETCH: tl.constexpr):
        """`_attention_group` of row program_id(0), KV head program_id(1)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        pages = table_ptr + b * stride_table      # row b's page offsets from the anchor (`KVCache`)
        k_cache = anchor_ptr + k_offset + kvh * D
        v_cache = anchor_ptr + v_offset + kvh * D
        if PREFETCH:
            _prefetch_older_kv(k_cache, v_cache, pages, 0, tl.minimum(tl.load(start_ptr + b), capacity),
                               HKV, D, PAGE, BLOCK_K)
        _dependent_launch_start(PDL)
        _attention_group(qkv_ptr + b * stride_qkv_b, out_ptr + b * stride_out_b, k_cache, v_cache, pages,
                         tl.load(start_ptr + b), q_w_ptr, k_w_ptr, inv_freq_ptr, stride_qkv_t, stride_out_t,
                         capacity, eps, scale, kvh, T, G, HQ, HKV, D, M, PAGE, BLOCK_K, IEEE)

    @triton.jit
    def _split_range(start, T: tl.constexpr, capacity, split, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
        """Keys [k_begin, k_end) of program `split` of SPLIT for a row whose new positions start at
        `start`: whole blocks, as even a share as they allow (later programs may get none)."""
        end = tl.minimum(start + T, capacity + 1)
        per = tl.cdiv(tl.cdiv(end, BLOCK_K), SPLIT) * BLOCK_K
        return split * per, tl.minimum(end, split * per + per)

    @triton.jit
    def _split_attention_kernel(
            qkv_ptr, out_ptr, part_ptr, counter_ptr, anchor_ptr, table_ptr, start_ptr, q_w_ptr, k_w_ptr,
            inv_freq_ptr, stride_qkv_b, stride_qkv_t, stride_out_b, stride_out_t, stride_table, k_offset, v_offset,
            capacity, eps, scale,
            T: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
            M: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
            PREFETCH: tl.constexpr, SPLIT: tl.constexpr):
        """`_attention_group` of row program_id(0), KV head program_id(1) with its keys cut in SPLIT
        ranges of whole blocks, one a program (program_id(2)): at a few rows, a long context's blocks are
        read side by side instead of one after another. Every program writes the same new keys and
        values (so each reads back its own write), leaves its softmax partials in `part_ptr` and counts
        itself in at `counter_ptr`; the last to arrive merges the partials, writes the output and sets
        the counter back to 0 for the next launch. A row of fewer than SPLIT blocks of keys is not cut:
        its first program does it all as `_decode_attention_kernel` would, the others leave at once
        (one kernel serves a graph's every length: the decode graphs have one kv bucket)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        pages = table_ptr + b * stride_table
        k_cache = anchor_ptr + k_offset + kvh * D
        v_cache = anchor_ptr + v_offset + kvh * D
        if PREFETCH:     # this program's share of the keys as the positions are before the wait (a hint)
            older = tl.load(start_ptr + b)
            k_begin, k_end = _split_range(older, T, capacity, split, SPLIT, BLOCK_K)
            _prefetch_older_kv(k_cache, v_cache, pages, k_begin, tl.minimum(k_end, tl.minimum(older, capacity)),
                               HKV, D, PAGE, BLOCK_K)
        _dependent_launch_start(PDL)
        start = tl.load(start_ptr + b)
        if tl.minimum(start + T, capacity + 1) < SPLIT * BLOCK_K:
            if split == 0:
                _attention_group(qkv_ptr + b * stride_qkv_b, out_ptr + b * stride_out_b, k_cache, v_cache, pages, start,
                                 q_w_ptr, k_w_ptr, inv_freq_ptr, stride_qkv_t, stride_out_t, capacity, eps, scale, kvh,
                                 T, G, HQ, HKV, D, M, PAGE, BLOCK_K, IEEE)
        else:
            k_begin, k_end = _split_range(start, T, capacity, split, SPLIT, BLOCK_K)
            q1, q2 = _new_keys_then_queries(qkv_ptr + b * stride_qkv_b, k_cache, v_cache, pages, start, q_w_ptr, k_w_ptr,
                                            inv_freq_ptr, stride_qkv_t, capacity, eps, kvh, T, G, HQ, HKV, D, M, PAGE)
            r = tl.arange(0, M)
            d = tl.arange(0, D)
            m_i, l_i, acc = _attend(q1, q2, start + r // G, k_cache, v_cache, pages, k_begin, k_end, scale,
                                    HKV, D, M, PAGE, BLOCK_K, IEEE)
            # partials of (row, KV head): SPLIT x [M] maxima, [M] sums, [M, D] outputs, fp32
            group = b * HKV + kvh
            part = part_ptr + group * SPLIT * M * (D + 2)
            tl.store(part + split * M + r, m_i)
            tl.store(part + (SPLIT + split) * M + r, l_i)
            tl.store(part + 2 * SPLIT * M + split * M * D + r[:, None] * D + d[None, :], acc)
            tl.debug_barrier()                                     # the program's threads have all written
            arrived = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:                               # the last: every partial is written
                tl.debug_barrier()
                tl.store(counter_ptr + group, 0)
                m_all = tl.full([M], float("-inf"), tl.float32)
                for s in tl.static_range(SPLIT):
                    m_all = tl.maximum(m_all, tl.load(part + s * M + r, cache_modifier=".cg"))
                l_all = tl.zeros([M], tl.float32)
                o = tl.zeros([M, D], tl.float32)
                for s in tl.static_range(SPLIT):
                    w = tl.exp(tl.load(part + s * M + r, cache_modifier=".cg") - m_all)
                    w = tl.where(m_all == float("-inf"), 0.0, w)        # padding rows: no key at all
                    l_all += w * tl.load(part + (SPLIT + s) * M + r, cache_modifier=".cg")
                    o += w[:, None] * tl.load(part + 2 * SPLIT * M + s * M * D + r[:, None] * D + d[None, :],
                                              cache_modifier=".cg")
                _store_heads(out_ptr + b * stride_out_b, o / l_all[:, None], stride_out_t, kvh, T, G, D, M)

    @triton.jit
    def _key_value_rows(at, k_offset, v_offset, valid, D: tl.constexpr):
        """Cached keys (as two halves) and values [R, D] of the rows at `at` (rows not `valid`: zero)."""
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        k1 = tl.load(at + k_offset + i[None, :], mask=valid[:, None], other=0.0)
        k2 = tl.load(at + k_offset + HALF + i[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(at + v_offset + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
        return k1, k2, v

    @triton.jit
    def _short_attention_kernel(
            qkv_ptr, out_ptr, anchor_ptr, table_ptr, start_ptr, q_w_ptr, k_w_ptr, inv_freq_ptr,
            stride_qkv_b, stride_qkv_t, stride_out_b, stride_out_t, stride_table, k_offset, v_offset,
            capacity, eps, scale,
            T: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
            KVH: tl.constexpr, M: tl.constexpr, NEW: tl.constexpr, OLD: tl.constexpr, PAGE: tl.constexpr,
            IEEE: tl.constexpr, PDL: tl.constexpr, PRELOAD_KV: tl.constexpr):
        """`_attention_group` of row program_id(0) for KVH KV heads at once (program_id(1) says which)
        over a short cache (OLD / KVH positions at most: the code predictor's 16): one tile of queries,
        a row per (position, head), against one tile of older keys, a row per (position, KV head), and
        one of the T new keys, taken from registers (the program writes them to the cache too); a mask
        keeps each query to its KV head and its causal past. A few dependent loads for all of a row's
        heads, where a program a KV head pays them for each. With PRELOAD_KV the older keys and values
        (written two or more kernels back, so complete: see the module docstring) load before the wait."""
        HALF: tl.constexpr = D // 2
        GK: tl.constexpr = G * KVH                   # query heads of the program
        dtype = anchor_ptr.dtype.element_ty
        b = tl.program_id(0)
        kv0 = tl.program_id(1) * KVH
        qkv = qkv_ptr + b * stride_qkv_b
        pages = table_ptr + b * stride_table
        i = tl.arange(0, HALF)
        d = tl.arange(0, D)
        start = tl.load(start_ptr + b)
        c_old = tl.arange(0, OLD)
        j_old = c_old // KVH
        old_valid = j_old < tl.minimum(start, capacity)
        old_at = (anchor_ptr + tl.load(pages + j_old // PAGE, mask=old_valid, other=0)
                  + (j_old % PAGE) * (HKV * D) + (kv0 + c_old % KVH) * D)[:, None]
        if PRELOAD_KV:
            k1_old, k2_old, v_old = _key_value_rows(old_at, k_offset, v_offset, old_valid, D)
        _dependent_launch_start(PDL)
        if not PRELOAD_KV:
            k1_old, k2_old, v_old = _key_value_rows(old_at, k_offset, v_offset, old_valid, D)
        inv_freq = tl.load(inv_freq_ptr + i)
        # queries, a row per (position t, query head of the program), normed and rotated
        r = tl.arange(0, M)
        t_q = r // GK
        head = kv0 * G + r % GK
        q_valid = r < T * GK
        q1, q2 = _normed_rotated_rows(qkv + t_q[:, None] * stride_qkv_t + head[:, None] * D + i[None, :], q_valid,
                                      q_w_ptr, t_q, start, inv_freq, eps, T, D, dtype)
        # the T new keys (normed, rotated) and values, a row per (position t, KV head), to the cache
        c_new = tl.arange(0, NEW)
        t_new = c_new // KVH
        h_new = kv0 + c_new % KVH
        new_valid = c_new < T * KVH
        k1, k2 = _normed_rotated_rows(qkv + t_new[:, None] * stride_qkv_t + (HQ + h_new)[:, None] * D + i[None, :],
                                      new_valid, k_w_ptr, t_new, start, inv_freq, eps, T, D, dtype)
        v_new = tl.load(qkv + t_new[:, None] * stride_qkv_t + (HQ + HKV + h_new)[:, None] * D + d[None, :],
                        mask=new_valid[:, None], other=0.0)
        pos = tl.minimum(start + t_new, capacity)
        new_at = (anchor_ptr + tl.load(pages + pos // PAGE, mask=new_valid, other=0)
                  + (pos % PAGE) * (HKV * D) + h_new * D)[:, None]
        tl.store(new_at + k_offset + i[None, :], k1, mask=new_valid[:, None])
        tl.store(new_at + k_offset + HALF + i[None, :], k2, mask=new_valid[:, None])
        tl.store(new_at + v_offset + d[None, :], v_new, mask=new_valid[:, None])
        # softmax over the older keys and the new ones at or before the query's position
        kv_q = (r % GK) // G
        if IEEE:
            s_old = (tl.dot(q1, tl.trans(k1_old), input_precision="ieee")
                     + tl.dot(q2, tl.trans(k2_old), input_precision="ieee"))
            s_new = tl.dot(q1, tl.trans(k1), input_precision="ieee") + tl.dot(q2, tl.trans(k2), input_precision="ieee")
        else:
            s_old = tl.dot(q1, tl.trans(k1_old)) + tl.dot(q2, tl.trans(k2_old))
            s_new = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
        s_old = tl.where(((c_old % KVH)[None, :] == kv_q[:, None]) & old_valid[None, :], s_old * scale, float("-inf"))
        s_new = tl.where(((c_new % KVH)[None, :] == kv_q[:, None]) & (t_new[None, :] <= t_q[:, None])
                         & new_valid[None, :], s_new * scale, float("-inf"))
        m = tl.maximum(tl.max(s_old, 1), tl.max(s_new, 1))
        m = tl.where(q_valid, m, 0.0)                        # padding rows: no key at all
        p_old = tl.exp(s_old - m[:, None])
        p_new = tl.exp(s_new - m[:, None])
        l = tl.sum(p_old, 1) + tl.sum(p_new, 1)
        if IEEE:
            o = (tl.dot(p_old.to(dtype), v_old, input_precision="ieee")
                 + tl.dot(p_new.to(dtype), v_new, input_precision="ieee"))
        else:
            o = tl.dot(p_old.to(dtype), v_old) + tl.dot(p_new.to(dtype), v_new)
        o = o / tl.maximum(l, 1e-30)[:, None]
        tl.store(out_ptr + b * stride_out_b + t_q[:, None] * stride_out_t + head[:, None] * D + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])


def decode_attention_supports(head_dim: int) -> bool:
    """Head sizes the kernel takes: a power of two, each half at least a tensor-core tile (16)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


# The configs `decode_attention` times: keys a block, launch options, and whether it asks L2 for the
# older keys and values before its wait (on an H100 the timing kept that for the talker up to 8 rows
# and dropped it from 12 up, call BP); SPLIT > 1: a row's keys read by that many programs a KV head
# side by side (`_split_attention_kernel`), for long contexts at a few rows
ATTENTION_CONFIGS = [dict(BLOCK_K=k, num_warps=w, num_stages=st, PREFETCH=p, SPLIT=1) for p in (True, False)
                     for k, w, st in ((64, 4, 3), (64, 4, 2), (64, 8, 3), (32, 4, 3), (32, 2, 3), (128, 4, 3),
                                      (128, 8, 3), (128, 8, 2))]
ATTENTION_CONFIGS += [dict(BLOCK_K=k, num_warps=4, num_stages=3, PREFETCH=True, SPLIT=split)
                      for split in (2, 4) for k in (64, 32)]
# ... and over a short cache (the code predictor's 16 positions), `_short_attention_kernel`'s: KV heads a
# program, launch options, whether the older keys and values load before the wait; those whose key tile
# (positions x KV heads) holds at most SHORT_ATTENTION_MAX_KEYS rows. QWEN3_TTS_SHORT_ATTENTION=0: none.
SHORT_ATTENTION = os.environ.get("QWEN3_TTS_SHORT_ATTENTION", "1") != "0"
SHORT_ATTENTION_CONFIGS = [dict(KVH=h, num_warps=w, PRELOAD_KV=p) for h, w, p in
                           ((8, 8, True), (8, 8, False), (4, 8, True), (4, 4, True), (4, 4, False), (2, 4, True),
                            (2, 4, False), (1, 4, True), (1, 2, True))]
SHORT_ATTENTION_MAX_KEYS = 256
ATTENTION_TIMING_KEYS = 256      # live keys per row on the scratch cache the configs are timed on, unless told
ATTENTION_TIMING_MIN_KEYS = 128  # ... and at least (the eager decode's smallest kv bucket)
# ... and at most: the decode graphs have one kv bucket, the capacity (8,448 positions by default), and
# 256 rows of that many keys would be 8.9 GB of scratch cache at warm-up, at lengths a turn seldom reaches
# (rows shorter than a split config's blocks run whole: `_split_attention_kernel`)
ATTENTION_TIMING_MAX_KEYS = 512


def _query_rows(t: int, heads: int, kv_heads: int) -> int:
    """Rows of an attention program's query tile: a KV head's query heads at each of t positions,
    padded to a power of two of at least 16 (a tensor-core tile)."""
    return max(16, triton.next_power_of_2(t * heads // kv_heads))


def attention_configs(cache) -> list[dict]:
    """The configs `decode_attention` times for a cache: ATTENTION_CONFIGS, and over a short one the
    SHORT_ATTENTION_CONFIGS whose KV heads divide the cache's and whose key tile fits."""
    short = [c for c in SHORT_ATTENTION_CONFIGS if SHORT_ATTENTION and cache.kv_heads % c["KVH"] == 0
             and triton.next_power_of_2(cache.capacity) * c["KVH"] <= SHORT_ATTENTION_MAX_KEYS]
    return ATTENTION_CONFIGS + short


def _key_block(cache, most: int) -> int:
    """Keys an attention program reads a block: at most `most`, within one page, no more than the
    cache holds (rounded up to a power of two), and at least a tensor-core tile (16)."""
    return max(16, min(most, triton.next_power_of_2(cache.capacity), cache.page_size))


def decode_attention(qkv: torch.Tensor, heads: int, kv_heads: int, q_norm_weight: torch.Tensor,
                     k_norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, cache, layer: int,
                     start: torch.Tensor, config: dict | None = None, kmax: int | None = None) -> torch.Tensor:
    """The attention core of a decode forward in one kernel -> [B, T, heads * head_dim].

    qkv [B, T, (heads + 2 * kv_heads) * head_dim]: the fused QKV projection of T new positions
    start[b] .. start[b]+T-1 of row b, which is slot b of `layer` in `cache` (an `engine.kv_cache.
    KVCache`, whose pages, a power of two >= 16 positions, the kernel finds through its table). Q and K are RMS-normed per head and
    rotated (RoPE from the positions and inv_freq, fp32), the new K/V are written to the cache, and
    each query attends causally over keys 0 .. its own position. Reads exactly the row's live keys:
    no mask, no kv bucket.
    config: one of `attention_configs(cache)`; by default the fastest for these shapes, timed once on the GPU on
    a scratch cache of `kmax` keys a row (the most a row holds in this call: an eager decode's kv
    bucket, within ATTENTION_TIMING_MIN_KEYS .. ATTENTION_TIMING_MAX_KEYS; ATTENTION_TIMING_KEYS when
    not told; the live lengths at warm-up say nothing of the load, and timing must not write into live
    rows) with as many layers as overflow L2, read one after another as a decode step does. Splitting a
    row's keys over programs pays only for long rows.
    """
    b, t, width = qkv.shape
    head_dim, page = cache.head_dim, cache.page_size
    if (width != (heads + 2 * kv_heads) * head_dim or kv_heads != cache.kv_heads
            or not decode_attention_supports(head_dim) or page < 16 or page & (page - 1)):
        raise ValueError(f"decode_attention: unsupported shapes qkv {tuple(qkv.shape)}, "
                         f"cache of {cache.kv_heads} x {head_dim}, pages of {page}")
    qkv = qkv.contiguous()
    out = torch.empty(b, t, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    m = _query_rows(t, heads, kv_heads)

    def launch(c, cache=cache, layer=layer, start=start, out=out, compile_only=False):
        k_offset, v_offset = cache.layer_offsets(layer)
        args = (qkv, out, cache.anchor, cache.table, start, q_norm_weight, k_norm_weight, inv_freq,
                qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1), cache.table.stride(0),
                k_offset, v_offset, cache.capacity, eps, head_dim ** -0.5)
        shapes = dict(T=t, G=heads // kv_heads, HQ=heads, HKV=kv_heads, D=head_dim, PAGE=cache.page_size,
                      IEEE=qkv.dtype == torch.float32, num_warps=c["num_warps"])
        if "KVH" in c:      # a short cache's kernel: KVH KV heads a program
            kvh = c["KVH"]
            _launch(_short_attention_kernel, (b, kv_heads // kvh), args,
                    dict(shapes, KVH=kvh, M=_query_rows(t, heads * kvh, kv_heads),
                         NEW=max(16, triton.next_power_of_2(t * kvh)),
                         OLD=max(16, triton.next_power_of_2(cache.capacity) * kvh), PRELOAD_KV=c["PRELOAD_KV"],
                         num_stages=1, **_pdl(qkv)), compile_only)
            return
        options = dict(shapes, M=m, BLOCK_K=_key_block(cache, c["BLOCK_K"]), num_stages=c["num_stages"],
                       **_pdl(qkv, prefetch=c["PREFETCH"]))
        if c["SPLIT"] == 1:
            _launch(_decode_attention_kernel, (b, kv_heads), args, options, compile_only)
        else:
            parts = torch.empty(b * kv_heads * c["SPLIT"] * m * (head_dim + 2), dtype=torch.float32, device=qkv.device)
            _launch(_split_attention_kernel, (b, kv_heads, c["SPLIT"]),
                    args[:2] + (parts, _arrival_counters(qkv.device, f"split attention, {t} positions", b * kv_heads))
                    + args[2:],
                    dict(options, SPLIT=c["SPLIT"]), compile_only)

    keys = _timing_keys(cache, kmax)

    @functools.cache
    def scratch():
        layer_bytes = b * keys * 2 * kv_heads * head_dim * qkv.element_size()
        return _timing_cache(cache, copies_beyond_l2(layer_bytes, qkv.device), b, t, start, keys)

    def launch_on_scratch(c, compile_only=False):
        scratch_cache, scratch_start = scratch()
        launch(c, scratch_cache, 0, scratch_start, compile_only=compile_only)

    def scratch_layers():
        scratch_cache, scratch_start = scratch()
        return [functools.partial(launch, cache=scratch_cache, layer=i, start=scratch_start)
                for i in range(scratch_cache.num_layers)]

    if config is None:
        key = attention_timing_key(b, t, heads, kv_heads, qkv.dtype, cache, kmax)
        config = _fastest(key, attention_configs(cache), launch_on_scratch, scratch_layers)
    launch(config)
    return out


def attention_timing_key(rows: int, t: int, heads: int, kv_heads: int, dtype: torch.dtype, cache,
                         kmax: int | None) -> tuple:
    """The key `decode_attention`'s configs are timed under (`_fastest`)."""
    return ("attention", rows, t, heads, kv_heads, cache.head_dim, dtype, cache.capacity, cache.page_size,
            _timing_keys(cache, kmax))


@functools.cache
def _arrival_counters(device: torch.device, kernel: str, n: int) -> torch.Tensor:
    """`n` arrival counters of a kernel whose last program of a group counts itself in and sets the
    group's back to 0: zero between launches, so one set serves every launch of that kernel on a
    stream (the decode steps'). Made at the configs' timing, outside any CUDA graph."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _timing_keys(cache, kmax: int | None = None) -> int:
    """Live keys a row of `_timing_cache` holds for a call whose rows hold up to kmax keys."""
    return min(max(kmax or ATTENTION_TIMING_KEYS, ATTENTION_TIMING_MIN_KEYS), ATTENTION_TIMING_MAX_KEYS, cache.capacity)


def _timing_cache(cache, layers: int, rows: int, t: int, start: torch.Tensor, keys: int):
    """A scratch cache like `cache` (`layers` layers, `rows` slots of `keys` keys, every page its own)
    and the start of rows whose T new positions end it: what a kernel that writes into the cache is
    timed on (the live lengths at warm-up say nothing of the load, and timing must not write into
    live rows)."""
    scratch = type(cache)(layers, rows, keys, cache.kv_heads, cache.head_dim, cache.anchor.dtype, cache.anchor.device,
                          cache.page_size, reserve_all=True, separate_pages=cache.separate_pages)
    return scratch, torch.full((rows,), max(0, keys - t), dtype=start.dtype, device=start.device)


if triton is not None:
    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, anchor_ptr, table_ptr, start_ptr, rows_ptr, stride_kb, stride_kt,
                         stride_vb, stride_vt, stride_table, k_offset, v_offset, capacity,
                         PAGE: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr):
        """K and V [kv_heads * head_dim] of row b's position t to its slot's page."""
        b, t = tl.program_id(0), tl.program_id(1)
        pos = tl.minimum(tl.load(start_ptr + b) + t, capacity)
        page = tl.load(table_ptr + tl.load(rows_ptr + b) * stride_table + pos // PAGE)
        dst = anchor_ptr + page + (pos % PAGE) * HD
        e = tl.arange(0, BLOCK)
        mask = e < HD
        tl.store(dst + k_offset + e, tl.load(k_ptr + b * stride_kb + t * stride_kt + e, mask=mask), mask=mask)
        tl.store(dst + v_offset + e, tl.load(v_ptr + b * stride_vb + t * stride_vt + e, mask=mask), mask=mask)

    @triton.jit
    def _kv_read_kernel(k_ptr, v_ptr, anchor_ptr, table_ptr, rows_ptr, stride_b, stride_table, k_offset,
                        v_offset, PAGE: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr):
        """K and V of position `pos` of row b's slot into rows [B, kmax, HD]."""
        b, pos = tl.program_id(0), tl.program_id(1)
        page = tl.load(table_ptr + tl.load(rows_ptr + b) * stride_table + pos // PAGE)
        src = anchor_ptr + page + (pos % PAGE) * HD
        e = tl.arange(0, BLOCK)
        mask = e < HD
        dst = b * stride_b + pos * HD + e
        tl.store(k_ptr + dst, tl.load(src + k_offset + e, mask=mask), mask=mask)
        tl.store(v_ptr + dst, tl.load(src + v_offset + e, mask=mask), mask=mask)


def kv_write(cache, layer: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, rows: torch.Tensor) -> None:
    """`KVCache.write` for pages in chunks of their own (found by offset): k, v [B, T, kv_heads, head_dim]."""
    b, t, h, d = k.shape
    k, v = (x if x.stride(2) == d and x.stride(3) == 1 else x.contiguous() for x in (k, v))   # [H, D] dense
    k_offset, v_offset = cache.layer_offsets(layer)
    _kv_write_kernel[(b, t)](k, v, cache.anchor, cache.table, start, rows, k.stride(0), k.stride(1),
                             v.stride(0), v.stride(1), cache.table.stride(0), k_offset, v_offset, cache.capacity,
                             PAGE=cache.page_size, HD=h * d, BLOCK=triton.next_power_of_2(h * d))


def kv_read(cache, layer: int, rows: torch.Tensor, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`KVCache.read` for pages in chunks of their own (found by offset) -> k, v [B, kmax, kv_heads, head_dim]."""
    b, h, d = rows.shape[0], cache.kv_heads, cache.head_dim
    k = torch.empty(b, kmax, h, d, dtype=cache.anchor.dtype, device=cache.anchor.device)
    v = torch.empty_like(k)
    k_offset, v_offset = cache.layer_offsets(layer)
    _kv_read_kernel[(b, kmax)](k, v, cache.anchor, cache.table, rows, k.stride(0), cache.table.stride(0),
                               k_offset, v_offset, PAGE=cache.page_size, HD=h * d, BLOCK=triton.next_power_of_2(h * d))
    return k, v


if triton is not None:
    @triton.jit
    def _kth_largest(x, k, RADIX_BITS: tl.constexpr, BITS: tl.constexpr):
        """The k-th largest of the fp32 block x (k >= 1), found exactly without sorting: x's bits as
        order-preserving integers in [0, 2^32), fixed RADIX_BITS bits at a time from the top, down to the
        top BITS bits (16 where x holds bf16 values: their fp32 bits below are zero). Each
        round is one histogram of the next digit below the prefix found so far (elements outside the
        prefix's range clamped to the end bins, which leaves the count at or above every digit but the
        lowest exact, and that one is always taken) and keeps the largest digit with at least k
        elements at or above it: O(V) a round, where comparing each element with every candidate
        digit was O(V * 2^RADIX_BITS) (20 us a call for one row on an H100, call BQ)."""
        RADIX: tl.constexpr = 1 << RADIX_BITS
        bits = x.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648
        ans = k.to(tl.int64) * 0
        for j in tl.static_range(BITS // RADIX_BITS):
            shift = 32 - RADIX_BITS * (j + 1)
            digit = tl.minimum(tl.maximum((key - ans) >> shift, 0), RADIX - 1).to(tl.int32)
            hist = tl.histogram(digit, RADIX)
            at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
            ans = ans + ((tl.sum((at_or_above >= k).to(tl.int32), 0) - 1).to(tl.int64) << shift)
        b = (ans - 2147483648).to(tl.int32)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _mix64(z):
        """splitmix64's finalizer on uint64 (shifts are logical, products wrap): `sampling.mix64`."""
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _gumbel_noise(seed, frame, codebook, tokens):
        """`sampling.gumbel_noise` of one row's tokens, bit for bit: the counter-based hash of
        (seed, frame, codebook, token), then -log(-log(u)) in float64."""
        key = _mix64(seed.to(tl.uint64, bitcast=True))
        counter = ((frame * 32 + codebook) << 12) + tokens.to(tl.int64)
        bits = _mix64(key + counter.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
        u = ((bits >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16       # 2^-52
        return -tl.log(-tl.log(u))

    @triton.jit
    def _sample_rows_kernel(logits_ptr, out_ptr, greedy_ptr, temperature_ptr, top_k_ptr, seed_ptr, frame_ptr,
                            seen_ptr, penalty_ptr, min_new_ptr, table_ptr, embed_ptr, codebook, V, stride_logits,
                            stride_seen, eos, suppress_from, D, stride_embed, BLOCK: tl.constexpr,
                            RADIX_BITS: tl.constexpr, PROCESS: tl.constexpr, EMBED: tl.constexpr,
                            BLOCK_D: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr):
        """`sample_rows` of row program_id(0). The top-k threshold is found on the logits before the
        temperature divides them (division by a positive temperature keeps their order, so the k-th
        largest quotient is the quotient of the k-th largest): on bf16 logits, from their 16 bits
        instead of the quotients' 32."""
        _dependent_launch_start(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < V
        logits = tl.load(logits_ptr + row * stride_logits + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if PROCESS:     # `sampling.TalkerLogitsProcessor` first; the row's frame is its tokens generated so far
            seen = tl.load(seen_ptr + row * stride_seen + cols, mask=mask, other=0) != 0
            penalty = tl.load(penalty_ptr + row)
            logits = tl.where(seen, tl.where(logits < 0, logits * penalty, tl.div_rn(logits, penalty)), logits)
            eos_blocked = tl.load(frame_ptr + row) < tl.load(min_new_ptr + row)
            logits = tl.where(tl.where(cols == eos, eos_blocked, cols >= suppress_from), float("-inf"), logits)
        if tl.load(greedy_ptr + row) != 0:
            pick = tl.argmax(logits, 0)
        else:
            temperature = tl.load(temperature_ptr + row)
            warped = tl.div_rn(logits, temperature)     # IEEE division, as torch
            k = tl.load(top_k_ptr + row)
            k = tl.where(k > 0, tl.minimum(k, V), V).to(tl.int32)
            threshold = tl.div_rn(_kth_largest(logits, k, RADIX_BITS, BITS), temperature)
            warped = tl.where(warped < threshold, float("-inf"), warped)
            noise = _gumbel_noise(tl.load(seed_ptr + row), tl.load(frame_ptr + row), codebook, cols)
            pick = tl.argmax(warped.to(tl.float64) + noise, 0)
        tl.store(out_ptr + row, pick.to(tl.int64))
        if EMBED:       # the pick's embedding: the next code-predictor step's input
            d = tl.arange(0, BLOCK_D)
            tl.store(embed_ptr + row * stride_embed + d, tl.load(table_ptr + pick.to(tl.int64) * D + d, mask=d < D),
                     mask=d < D)


SAMPLE_CONFIGS = [dict(num_warps=w, RADIX_BITS=r) for r in (8, 4) for w in (4, 8, 16, 2)]  # `sample_rows` times these


class TalkerProcessing(NamedTuple):
    """What `sampling.TalkerLogitsProcessor` needs of a batch, for `sample_rows` to apply it first:
    seen [B, V] bool (each row's c0 ids so far), penalty [B] fp32, min_new_tokens [B] int64 (against
    the rows' `frame`: their tokens generated so far), EOS's id and the first suppressed id (every id
    from there on but EOS is suppressed)."""
    seen: torch.Tensor
    penalty: torch.Tensor
    min_new_tokens: torch.Tensor
    eos_id: int
    suppress_from: int


def sample_rows(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                seed: torch.Tensor, frame: torch.Tensor, codebook: int, config: dict | None = None,
                processing: TalkerProcessing | None = None, embed: tuple | None = None) -> torch.Tensor:
    """`engine.sampling.sample` without top-p in one kernel: ids [B] of logits [B, V] (fp32, or bf16
    made fp32 as it is loaded: no cast kernel before it), after the talker's logits processor where
    `processing` is given (the ~10 elementwise kernels it was). The Gumbel noise of (seed, frame,
    codebook) is hashed in the kernel: as a [B, V] float64 tensor made by ~20 elementwise kernels a
    codebook, it cost 8-12% of a decode step on an H200 (bench/README.md). embed = (table [V', D], out
    [B, D]): each row's pick's table row is written to out as well (a code-predictor step's next input,
    without a lookup kernel of its own). config: one of SAMPLE_CONFIGS; by default the fastest for these
    shapes, timed once on the GPU."""
    b, v = logits.shape
    logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.long, device=logits.device)
    p = processing or TalkerProcessing(greedy, temperature, top_k, 0, v)     # unread placeholders
    table, rows = embed or (logits, logits)                                   # the same
    if embed is not None and (rows.stride(-1) != 1 or table.stride(-1) != 1 or rows.shape[-1] != table.shape[1]):
        raise ValueError(f"sample_rows: embed needs rows [B, D] and a table [V, D], got {tuple(rows.shape)} "
                         f"and {tuple(table.shape)}")

    def launch(c, compile_only=False):
        _launch(_sample_rows_kernel, (b,),
                (logits, out, greedy, temperature, top_k, seed, frame, p.seen, p.penalty, p.min_new_tokens, table, rows,
                 codebook, v, logits.stride(0), p.seen.stride(0), p.eos_id, p.suppress_from, table.shape[1],
                 rows.stride(0)),
                dict(BLOCK=triton.next_power_of_2(v), RADIX_BITS=c["RADIX_BITS"], PROCESS=processing is not None,
                     EMBED=embed is not None, BLOCK_D=triton.next_power_of_2(table.shape[1]) if embed else 1,
                     BITS=16 if logits.dtype == torch.bfloat16 and processing is None else 32,
                     num_warps=c["num_warps"], **_pdl(logits)), compile_only)
    # timed per power-of-two class of rows: one row is latency-bound, 256 fill the GPU (the graphs'
    # batch buckets meet every class at warm-up, before any eager call can)
    key = ("sample_rows", v, b.bit_length()) + (("processed",) if processing else ()) + (("embed",) if embed else ())
    launch(config or _fastest(key, SAMPLE_CONFIGS, launch))
    return out


if triton is not None:
    @triton.jit
    def _advance_rows_kernel(act_ptr, new_c0_ptr, hidden_ptr, frames_ptr, alive_ptr, h_ptr, c0_ptr, seen_ptr,
                             generated_ptr, length_ptr, limit_ptr, packed_ptr, D, stride_hidden, stride_h,
                             stride_seen, eos_id, capacity, CODES: tl.constexpr, BLOCK_CODES: tl.constexpr,
                             BLOCK_D: tl.constexpr, RUNNING: tl.constexpr, EOS: tl.constexpr, LIMIT: tl.constexpr,
                             PDL: tl.constexpr):
        """`advance_rows` of row program_id(0)."""
        _dependent_launch_start(PDL)
        row = tl.program_id(0)
        alive = tl.load(alive_ptr + row) != 0
        moves = (tl.load(act_ptr + row) != 0) & alive
        new = tl.load(new_c0_ptr + row)
        generated = tl.load(generated_ptr + row) + moves.to(tl.int64)
        length = tl.load(length_ptr + row) + moves.to(tl.int64)
        over = (generated > tl.load(limit_ptr + row)) | (length >= capacity)
        status = tl.where(moves, tl.where(new == eos_id, EOS, tl.where(over, LIMIT, RUNNING)), RUNNING)
        if moves:
            d = tl.arange(0, BLOCK_D)
            tl.store(h_ptr + row * stride_h + d, tl.load(hidden_ptr + row * stride_hidden + d, mask=d < D), mask=d < D)
            tl.store(c0_ptr + row, new)
            tl.store(seen_ptr + row * stride_seen + new, moves)
            tl.store(generated_ptr + row, generated)
            tl.store(length_ptr + row, length)
        tl.store(alive_ptr + row, alive & (status == RUNNING))
        codes = tl.arange(0, BLOCK_CODES)
        packed = packed_ptr + row * (CODES + 2)
        tl.store(packed + codes, tl.load(frames_ptr + row * CODES + codes, mask=codes < CODES), mask=codes < CODES)
        tl.store(packed + CODES, status.to(tl.int64))
        tl.store(packed + CODES + 1, moves.to(tl.int64))


class RowState(NamedTuple):
    """A decode batch's per-row state that a step advances (`engine.runner.ModelRunner`'s, rows 0..n-1):
    alive bool [n] (not finished), h [n, D] (the hidden state that gave c0), c0 [n] (the pending first
    code), seen bool [n, V] (each row's c0 ids so far), generated [n] (c0 tokens sampled so far),
    length [n] (positions in the talker's cache), limit [n] (most frames)."""
    alive: torch.Tensor
    h: torch.Tensor
    c0: torch.Tensor
    seen: torch.Tensor
    generated: torch.Tensor
    length: torch.Tensor
    limit: torch.Tensor


def advance_rows(act: torch.Tensor, new_c0: torch.Tensor, hidden: torch.Tensor, frames: torch.Tensor, state: RowState,
                 eos_id: int, capacity: int, statuses: tuple[int, int, int]) -> torch.Tensor:
    """The end of a decode step in one kernel (one program a row) for what were ~20 elementwise
    kernels: each row that moves (act and alive) takes hidden as h and new_c0 as c0, marks new_c0
    seen and counts one more c0 and cache position; every row's status is EOS if it moved and
    new_c0 is EOS, LIMIT if it moved past its limit or filled the cache, else RUNNING; a row not
    RUNNING is no longer alive. Returns [n, frames + 2] int64: the frame's codes, the status, whether
    the row moved. statuses: the (RUNNING, EOS, LIMIT) values."""
    n, codes = frames.shape
    d = hidden.shape[-1]
    if hidden.stride(-1) != 1 or state.h.stride(-1) != 1 or not frames.is_contiguous() or state.seen.stride(-1) != 1:
        raise ValueError("advance_rows: hidden, h, seen and frames need contiguous rows")
    packed = torch.empty(n, codes + 2, dtype=torch.long, device=frames.device)
    running, eos, limit = statuses
    _launch(_advance_rows_kernel, (n,),
            (act, new_c0, hidden, frames, state.alive, state.h, state.c0, state.seen, state.generated, state.length,
             state.limit, packed, d, hidden.stride(0), state.h.stride(0), state.seen.stride(0), eos_id, capacity),
            dict(CODES=codes, BLOCK_CODES=triton.next_power_of_2(codes), BLOCK_D=triton.next_power_of_2(d),
                 RUNNING=running, EOS=eos, LIMIT=limit, num_warps=4, **_pdl(hidden)))
    return packed
