"""The two ends of a decode step: the frame's embedding in, the rows' state update out.

A frame's embedding for the next talker step (16 lookups in 16 tables, summed, plus the text term)
was ~18 plain kernels a step; `embedding_sum` is one. The end of a step (each moving row's new hidden
state and first code, its counters and status, the frames packed for the host) was ~20 elementwise
kernels; `advance_rows` is one.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .launch import dependent_launch_start, launch_kernel, pdl_options, tl, triton


if triton is not None:
    @triton.jit
    def _embedding_sum_kernel(ids_ptr, anchor_ptr, offsets_ptr, plus_ptr, y_ptr, N, G: tl.constexpr,
                              HAS_PLUS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        dependent_launch_start(PDL)
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
                                                **pdl_options(anchor))
    return y


if triton is not None:
    @triton.jit
    def _advance_rows_kernel(act_ptr, new_c0_ptr, hidden_ptr, frames_ptr, alive_ptr, h_ptr, c0_ptr, seen_ptr,
                             generated_ptr, length_ptr, limit_ptr, packed_ptr, D, stride_hidden, stride_h,
                             stride_seen, eos_id, capacity, CODES: tl.constexpr, BLOCK_CODES: tl.constexpr,
                             BLOCK_D: tl.constexpr, RUNNING: tl.constexpr, EOS: tl.constexpr, LIMIT: tl.constexpr,
                             PDL: tl.constexpr):
        """`advance_rows` of row program_id(0)."""
        dependent_launch_start(PDL)
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
    args = (act, new_c0, hidden, frames, state.alive, state.h, state.c0, state.seen, state.generated, state.length,
            state.limit, packed, d, hidden.stride(0), state.h.stride(0), state.seen.stride(0), eos_id, capacity)
    launch_kernel(_advance_rows_kernel, (n,), args,
                  dict(CODES=codes, BLOCK_CODES=triton.next_power_of_2(codes), BLOCK_D=triton.next_power_of_2(d),
                       RUNNING=running, EOS=eos, LIMIT=limit, num_warps=4, **pdl_options(hidden)))
    return packed

