"""Attention kernels: QK-norm + RoPE for the prefill, the whole attention core of a decode step, and
K/V cache reads and writes.

Per attention layer, RMSNorm of each q and k head followed by rotate-half RoPE is ~12 small kernels;
`qk_norm_rope` does both in one kernel per tensor (the prefill path). `decode_attention` does a
decode layer's whole attention core in one kernel: QK-norm, RoPE from the positions, the K/V cache
write, causal attention over the row's cache. At a few rows a long context's keys may be cut over
several programs a KV head, the last to finish merging their partials; over a short cache (the code
predictor's 16 positions) a kernel that takes a few KV heads or all of a row's at once, the new keys
from registers and the older ones loaded before the wait, is timed beside it.
"""
from __future__ import annotations

import functools
import os

import torch

from .launch import (copies_beyond_l2, dependent_launch_start, fastest, launch_kernel, pdl_options, prefetch_rows_l2,
                     tl, triton)


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
            prefetch_rows_l2(k_cache + at, k_end - k0, D, HKV * D, BLOCK_K, D)
            prefetch_rows_l2(v_cache + at, k_end - k0, D, HKV * D, BLOCK_K, D)

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
        dependent_launch_start(PDL)
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
        dependent_launch_start(PDL)
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
        (written two or more kernels back, so complete: see `launch`) load before the wait."""
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
        dependent_launch_start(PDL)
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
            launch_kernel(_short_attention_kernel, (b, kv_heads // kvh), args,
                          dict(shapes, KVH=kvh, M=_query_rows(t, heads * kvh, kv_heads),
                               NEW=max(16, triton.next_power_of_2(t * kvh)),
                               OLD=max(16, triton.next_power_of_2(cache.capacity) * kvh), PRELOAD_KV=c["PRELOAD_KV"],
                               num_stages=1, **pdl_options(qkv)), compile_only)
            return
        options = dict(shapes, M=m, BLOCK_K=_key_block(cache, c["BLOCK_K"]), num_stages=c["num_stages"],
                       **pdl_options(qkv, prefetch=c["PREFETCH"]))
        if c["SPLIT"] == 1:
            launch_kernel(_decode_attention_kernel, (b, kv_heads), args, options, compile_only)
        else:
            parts = torch.empty(b * kv_heads * c["SPLIT"] * m * (head_dim + 2), dtype=torch.float32, device=qkv.device)
            counters = _arrival_counters(qkv.device, f"split attention, {t} positions", b * kv_heads)
            launch_kernel(_split_attention_kernel, (b, kv_heads, c["SPLIT"]), args[:2] + (parts, counters) + args[2:],
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
        config = fastest(key, attention_configs(cache), launch_on_scratch, scratch_layers)
    launch(config)
    return out


def attention_timing_key(rows: int, t: int, heads: int, kv_heads: int, dtype: torch.dtype, cache,
                         kmax: int | None) -> tuple:
    """The key `decode_attention`'s configs are timed under (`fastest`)."""
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

