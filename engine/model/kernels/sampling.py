"""Sampling a codebook in one kernel.

Temperature, top-k, the Gumbel-max draw and greedy rows are ~15 small kernels as plain ops, 16 times a
frame, plus ~20 for the seeded noise; `sample_rows` is one, the noise and the logits' cast to fp32
included, and the talker's logits processor (~10 more) too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .launch import dependent_launch_start, fastest, launch_kernel, pdl_options, tl, triton


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
        dependent_launch_start(PDL)
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
        args = (logits, out, greedy, temperature, top_k, seed, frame, p.seen, p.penalty, p.min_new_tokens, table, rows,
                codebook, v, logits.stride(0), p.seen.stride(0), p.eos_id, p.suppress_from, table.shape[1],
                rows.stride(0))
        launch_kernel(_sample_rows_kernel, (b,), args,
                      dict(BLOCK=triton.next_power_of_2(v), RADIX_BITS=c["RADIX_BITS"], PROCESS=processing is not None,
                           EMBED=embed is not None, BLOCK_D=triton.next_power_of_2(table.shape[1]) if embed else 1,
                           BITS=16 if logits.dtype == torch.bfloat16 and processing is None else 32,
                           num_warps=c["num_warps"], **pdl_options(logits)), compile_only)
    # timed per power-of-two class of rows: one row is latency-bound, 256 fill the GPU (the graphs'
    # batch buckets meet every class at warm-up, before any eager call can)
    key = ("sample_rows", v, b.bit_length()) + (("processed",) if processing else ()) + (("embed",) if embed else ())
    launch(config or fastest(key, SAMPLE_CONFIGS, launch))
    return out

