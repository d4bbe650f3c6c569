"""The vocoder's fused kernels, each with the plain PyTorch ops as its reference.

SnakeBeta is ~56% of the vocoder's GPU time as four separate elementwise kernels (PERF_NOTES.md);
one Triton kernel reads x once and writes y once. At many streams the vocoder is bound by passes over
its high-rate activations: a SnakeBeta writes the next conv's left context ahead of its output (no
concatenated copy), and a residual unit's second SnakeBeta, 1x1 conv and residual add (with both
convs' biases) are one kernel, `residual_tail`. The 12 Hz transformer's sliding-window attention,
RoPE included, is one kernel too, `window_attention` (as separate ops, ~10 small kernels a layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .launch import fastest, launch_kernel, tl, triton


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


def window_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, first_key: torch.Tensor) -> torch.Tensor:
    """Causal sliding-window attention of the new frames' queries q [B, t, H, D] over the keys and
    values k, v [B, S + t, H_kv, D] of [context, new frames] (S = window - 1), rotate-half RoPE at
    local positions first (cos, sin [S + t, D]: key j at j, query i at S + i; rounded op by op, as the
    official `x * cos + rotate_half(x) * sin`). Query i sees keys i..i+S from `first_key[b]` on (the
    context's keys before a stream's first frame are not real). Returns [B, t, H, D]."""
    t, s = q.shape[1], k.shape[1] - q.shape[1]

    def rope(x, cos, sin):                       # x [B, heads, T, D]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    key = torch.arange(s + t, device=q.device)
    query = torch.arange(t, device=q.device)[:, None]
    mask = (key >= query) & (key <= query + s) & (key >= first_key[:, None, None])           # [B, t, S + t]
    out = F.scaled_dot_product_attention(rope(q.transpose(1, 2), cos[s:], sin[s:]),
                                         rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2),
                                         attn_mask=mask[:, None], enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _sin(x, dtype: tl.constexpr):
        """sin of fp32 x for a result rounded to `dtype`. For a 16-bit one, the hardware's approximation
        (sin.approx: absolute error < 2^-20 on [-pi, pi]) after a reduction to that range (2 pi in two
        parts): a few instructions where libdevice's exact sinf takes ~40, which made it the SnakeBeta's
        largest cost, and an error far below the result's rounding. fp32 keeps the exact one."""
        if dtype == tl.float32:
            return tl.sin(x)
        n = tl.floor(x * 0.15915494309189535 + 0.5)
        return libdevice.fast_sinf(x - n * 6.28125 - n * 0.0019353071795864769)

    @triton.jit
    def _snake(x, log_alpha, log_beta, bias, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
        """SnakeBeta of fp32 x (a per-channel bias added first, rounded as the conv's own bias add
        rounds), rounded to `dtype`; the per-channel parameters broadcast against x."""
        if HAS_BIAS:
            x = (x + bias.to(tl.float32)).to(dtype).to(tl.float32)
        inv_beta = 1.0 / (tl.exp(log_beta.to(tl.float32)) + 1e-9)
        s = _sin(x * tl.exp(log_alpha.to(tl.float32)), dtype)
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

    @triton.jit
    def _rope_rounded(x1, x2, cos_at, sin_at, HALF: tl.constexpr, dtype: tl.constexpr):
        """Rotate-half RoPE of fp32 halves [R, HALF] with the cos/sin rows at `cos_at`/`sin_at` ([R]
        pointers), each product and the sum rounded to `dtype` as the separate ops round them."""
        i = tl.arange(0, HALF)[None, :]
        c1 = tl.load(cos_at[:, None] + i).to(tl.float32)
        c2 = tl.load(cos_at[:, None] + HALF + i).to(tl.float32)
        s1 = tl.load(sin_at[:, None] + i).to(tl.float32)
        s2 = tl.load(sin_at[:, None] + HALF + i).to(tl.float32)
        r1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
        r2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
        return r1.to(dtype), r2.to(dtype)

    @triton.jit
    def _window_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cos_ptr, sin_ptr, first_ptr, t, S, scale,
                                 stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt, stride_ob, stride_ot,
                                 G: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                                 IEEE: tl.constexpr):
        """BLOCK_Q queries of one stream and head against the keys they see, BLOCK_K at a time (online
        softmax): q and each key block rotated in registers, scores and weights in fp32."""
        HALF: tl.constexpr = D // 2
        PRECISION: tl.constexpr = "ieee" if IEEE else "tf32"
        dtype = out_ptr.dtype.element_ty
        h = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        kv = h // G
        i = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)                  # query i is at position S + i
        qm = (i < t)[:, None]
        d = tl.arange(0, HALF)[None, :]
        q_at = q_ptr + b * stride_qb + i[:, None] * stride_qt + h * D + d
        pos = tl.minimum(S + i, S + t - 1)
        q1, q2 = _rope_rounded(tl.load(q_at, mask=qm, other=0.0).to(tl.float32),
                               tl.load(q_at + HALF, mask=qm, other=0.0).to(tl.float32),
                               cos_ptr + pos * D, sin_ptr + pos * D, HALF, dtype)
        m = tl.full([BLOCK_Q], -1e30, tl.float32)          # finite: padding rows, which see no key, stay 0
        l = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, D], tl.float32)
        lo = tl.maximum(tl.program_id(0) * BLOCK_Q, tl.load(first_ptr + b))
        hi = tl.minimum(tl.program_id(0) * BLOCK_Q + BLOCK_Q - 1 + S, S + t - 1)      # last key, inclusive
        for j0 in range(lo, hi + 1, BLOCK_K):
            j = j0 + tl.arange(0, BLOCK_K)
            jc = tl.minimum(j, hi)[:, None]
            k_at = k_ptr + b * stride_kb + jc * stride_kt + kv * D + d
            k1, k2 = _rope_rounded(tl.load(k_at).to(tl.float32), tl.load(k_at + HALF).to(tl.float32),
                                   cos_ptr + tl.minimum(j, hi) * D, sin_ptr + tl.minimum(j, hi) * D, HALF, dtype)
            scores = (tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
                      + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)) * scale
            seen = (j[None, :] >= i[:, None]) & (j[None, :] <= i[:, None] + S) & (j[None, :] <= hi)
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            vals = tl.load(v_ptr + b * stride_vb + jc * stride_vt + kv * D + tl.arange(0, D)[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(dtype), vals, input_precision=PRECISION)
            m = m_new
        out = out_ptr + b * stride_ob + i[:, None] * stride_ot + h * D + tl.arange(0, D)[None, :]
        tl.store(out, (acc / tl.maximum(l, 1e-30)[:, None]).to(dtype), mask=qm)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     first_key: torch.Tensor) -> torch.Tensor:
    """`window_attention_reference` in one kernel on CUDA (the separate ops: two RoPEs of five
    kernels each and an attention whose tiles are mostly padding at a window's few queries)."""
    d = q.shape[-1]
    if triton is None or not q.is_cuda or d < 32 or d & (d - 1) or any(x.stride(-1) != 1 or x.stride(2) != d
                                                                       for x in (q, k, v)):
        return window_attention_reference(q, k, v, cos, sin, first_key)
    return window_attention_triton(q, k, v, cos, sin, first_key)


def window_attention_triton(q, k, v, cos, sin, first_key) -> torch.Tensor:
    """`window_attention`'s kernel: q, k, v may be views whose rows (a frame's heads, each
    contiguous) are strided; the result is contiguous."""
    b, t, h, d = q.shape
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    block_q = 16
    _window_attention_kernel[(triton.cdiv(t, block_q), h, b)](
        q, k, v, out, cos.contiguous(), sin.contiguous(), first_key, t, k.shape[1] - t, d ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        G=h // k.shape[2], D=d, BLOCK_Q=block_q, BLOCK_K=64, IEEE=q.dtype == torch.float32, num_warps=4)
    return out


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
        args = (x, y, log_alpha, log_beta, x if bias is None else bias, x if left is None else left, c, t, n_left,
                *x.stride(), *y.stride(), 0 if left is None else left.stride(0))
        launch_kernel(_snake_beta_kernel, grid, args,
                      dict(HAS_BIAS=bias is not None, HAS_LEFT=left is not None, **cfg), compile_only)
    if config is None:
        key = ("snake_beta", c, triton.next_power_of_2(b * (n_left + t)), x.dtype, adjacent, bias is not None,
               left is not None)
        config = fastest(key, SNAKE_CONFIGS[adjacent], launch)
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
        args = (x, y, out, log_alpha, log_beta, y_bias, weight.reshape(c, c), bias, bias if x_bias is None else x_bias,
                c, t, *x.stride(), *y.stride(), *out.stride())
        launch_kernel(_residual_tail_kernel, grid, args,
                      dict(BLOCK_CO=cfg["BLOCK_CO"], BLOCK_CI=cfg.get("BLOCK_CI", 32), BLOCK_T=cfg["BLOCK_T"],
                           IEEE=x.dtype == torch.float32, HAS_X_BIAS=x_bias is not None, num_warps=cfg["num_warps"],
                           num_stages=cfg.get("num_stages", 3)), compile_only)
    if config is None:
        key = ("residual_tail", c, triton.next_power_of_2(b * t), x.dtype, _channels_adjacent(y))
        config = fastest(key, residual_tail_configs(c), launch)
    launch(config)
    return out
