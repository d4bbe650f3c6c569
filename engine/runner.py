"""The batched generation step over slots: prefill of new rows, and one decode step for all rows.

`ModelRunner` owns the talker KV cache, the code-predictor cache and every per-slot state tensor on
the device: cache length, the last final-normed hidden state `h` and the pending first code `c0`
sampled from it, the repetition-penalty history, the count of c0 tokens generated, the frame limit,
and the sampling parameters (seeds included). It has no threads and no queue: the one-shot
synthesizer (`engine.synth`) and the streaming scheduler drive it.

Frame accounting (MODEL.md 6.4, T8). A row's k-th sampled c0 (k = 0 at the end of its prefill) is
"pending" until the next `step` completes frame k with the code predictor and feeds it back. A
sampled EOS is never a frame; a row whose limit is `max_frames` stops when its c0 number
`max_frames` is sampled (the official max_new_tokens = max_frames + 1 gives max_frames frames). EOS
is masked for k < min_new_tokens (officially 2), so a row makes at least that many frames unless its
limit is lower.

Protocol (slots are integers 0..max_batch-1; the caller owns the allocation):
    runner.admit(slots, params, max_frames)          # O(1) per slot: fresh state
    runner.reserve(slots, positions)                 # optional: cache pages ahead of need
    status = runner.prefill(slots, chunks, last)     # any slots; one talker forward; chunked prompts OK
    step = runner.step(n, active, text_embeds)       # slots 0..n-1, one frame for every active row
    step.frames                                      # [n, 16] on the device at once
    out = step.result()                              # later: out.status[b] (RUNNING / EOS / LIMIT)
    runner.release(slots)                            # a finished row's pages back; its slot may be admitted again.
Decode runs over the contiguous slot range 0..n-1 with no gather; a row that is inactive in a step
(free, finished, still prefilling, or waiting for text) is computed but none of its state changes.
Rows of one decode batch must be packed into the low slots by the caller to keep n small.

A step may be launched before the previous one's result is read (the scheduler does, to keep the
GPU busy while the host works): a row that finished in the previous step stays finished on the
device (`alive`) even if the caller still marks it active, and its result says it did not advance.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .host import ToHost, to_device
from .model import kernels
from .requests import SamplingParams
from .sampling import (SamplingTensors, TalkerLogitsProcessor, all_greedy, fused_sampling, sample_subtalker,
                       sample_talker, subtalker_noise)

RUNNING, EOS, LIMIT = 0, 1, 2


@dataclass
class StepResult:
    frames: torch.Tensor       # [n, 16] int64 on the host (rows that did not advance: garbage)
    status: np.ndarray         # per row: RUNNING, EOS (next c0 was EOS: no more frames) or LIMIT
    advanced: np.ndarray       # per row: made a frame (active, and not finished by an earlier step)


class LaunchedStep:
    """A decode step queued on the device: its frames are usable there at once, its result on the
    host once the device has run it."""

    def __init__(self, packed: torch.Tensor):
        self.frames = packed[:, :-2]    # [n, 16] on the device, valid until the next step
        self._host = ToHost(packed)

    def result(self) -> StepResult:
        packed = self._host.wait().clone()    # kept codes must not pin the transfer buffer
        return StepResult(packed[:, :-2], packed[:, -2].numpy(), packed[:, -1].numpy().astype(bool))


class ModelRunner:
    def __init__(self, model, max_batch: int, capacity: int, kv_bucket: int = 64, page_size: int = 64):
        """model: an `engine.loader.TTSModel` (uses `.talker`, `.config`, `.device`).

        capacity: talker positions per slot (prompt + frames); a row whose cache would overflow
        finishes with LIMIT. The cache's pages are taken as rows reach them (`prefill`, `step`) or
        ahead (`reserve`), and given back by `release`; page_size: positions a page.
        kv_bucket: attention reads keys up to the live maximum length rounded up to this multiple
        (fewer distinct shapes; 1 = exact length).
        """
        self.talker = model.talker
        cfg = model.config.talker
        self.device = self.talker.codec_head.weight.device
        self.dtype = self.talker.codec_head.weight.dtype
        self.max_batch, self.capacity, self.kv_bucket = max_batch, capacity, kv_bucket
        self.eos_id = cfg.codec_eos_token_id
        self.cache = self.talker.new_cache(max_batch, capacity, reserve_all=False, page_size=page_size)
        self.cp_cache = self.talker.code_predictor.new_cache(max_batch)
        self.processor = TalkerLogitsProcessor(cfg.vocab_size, self.eos_id, self.device)
        dev, s = self.device, max_batch
        hidden = cfg.transformer.hidden_size
        self.length = torch.zeros(s, dtype=torch.long, device=dev)       # positions in the cache
        self.h = torch.zeros(s, hidden, dtype=self.dtype, device=dev)    # hidden that gave c0
        self.c0 = torch.zeros(s, dtype=torch.long, device=dev)           # pending first code
        self.seen = torch.zeros(s, cfg.vocab_size, dtype=torch.bool, device=dev)  # c0 history
        self.generated = torch.zeros(s, dtype=torch.long, device=dev)    # c0 tokens sampled so far
        self.limit = torch.zeros(s, dtype=torch.long, device=dev)        # max frames
        self.alive = torch.zeros(s, dtype=torch.bool, device=dev)        # not finished: may advance
        self.params = SamplingTensors.from_params([SamplingParams(seed=0)] * s, dev)
        self.lengths = np.zeros(s, dtype=np.int64)   # host mirror of `length`: kmax without a device sync
        # rows whose first c0 may end them (a frame limit of 0, or EOS allowed at once: min_new_tokens 0):
        # a prefill reads its status back only for them, or where it fills the cache
        self.may_end_at_once = np.zeros(s, dtype=bool)
        self.graphs = None                            # engine.graphs.StepGraphs once enabled
        self.prefill_graphs = None                    # engine.graphs.PrefillGraphs once enabled

    def use_cuda_graphs(self, batch_buckets=None, kv_buckets=None, pool=None) -> None:
        """Replay the decode step from CUDA graphs, captured per (batch, kv length) bucket on first use,
        and one-row prefills per prompt-length bucket; both from the memory pool `pool` (default: a
        new one), which other graphs run in turn with this runner's may share (`engine.graphs`)."""
        from .graphs import PrefillGraphs, StepGraphs
        pool = pool or torch.cuda.graph_pool_handle()
        self.graphs = StepGraphs(self, batch_buckets, kv_buckets, pool)
        self.prefill_graphs = PrefillGraphs(self, pool=pool)

    # -- admission and cache pages ---------------------------------------------------------------

    def reserve(self, slots: list[int], positions: list[int]) -> None:
        """Cache pages for positions 0..positions[i]-1 of slots[i] (ahead of need: admission reserves
        a turn's estimated length). Raises torch.OutOfMemoryError when the device has no room."""
        self.cache.reserve(slots, positions)

    def release(self, slots: list[int]) -> None:
        """The slots' cache pages go back to the free list (their sequences ended)."""
        self.cache.release(slots)

    def unreserved(self, n: int, active: np.ndarray) -> np.ndarray:
        """Active rows among slots 0..n-1 whose next position is in a page they have not reserved."""
        return np.flatnonzero(active & (self.lengths[:n] >= self.cache.reserved(slice(0, n))))

    def admit(self, slots: list[int], params: list[SamplingParams], max_frames: list[int]) -> None:
        """Give `slots` fresh state for new requests (their old contents are forgotten)."""
        idx = to_device(slots, self.device, torch.long)
        self.params.assign(idx, SamplingTensors.from_params(params, self.device))
        # index_fill_, not `t[idx] = 0`: a Python scalar there is a pageable upload that waits for the GPU
        self.length.index_fill_(0, idx, 0)
        self.generated.index_fill_(0, idx, 0)
        self.seen.index_fill_(0, idx, False)
        self.limit[idx] = to_device(max_frames, self.device, torch.long)
        self.alive.index_fill_(0, idx, True)
        self.lengths[slots] = 0
        self.may_end_at_once[slots] = [m < 1 or p.min_new_tokens < 1 for m, p in zip(max_frames, params)]

    # -- prefill ---------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, slots: list[int], chunks: list[torch.Tensor], last: list[bool] | None = None) -> list[int]:
        """Append prompt chunks [T_i, D] to `slots` in one right-padded talker forward.

        A long prompt can be fed in several calls (each continues where the slot's cache ends), so a
        prefill never holds up the decode batch for more than one chunk. For rows whose chunk ends
        their prompt (`last`, default all), the first c0 is sampled and the row is ready to `step`.
        Returns the status per row (LIMIT when max_frames is 0 or the prompt fills the cache).
        """
        last = [True] * len(slots) if last is None else last
        sizes = [c.shape[0] for c in chunks]
        starts = [int(self.lengths[s]) for s in slots]
        if any(st + n > self.capacity for st, n in zip(starts, sizes)):
            raise ValueError(f"prompt longer than the cache capacity {self.capacity}")
        self.cache.reserve(slots, [st + n for st, n in zip(starts, sizes)])
        idx = to_device(slots, self.device, torch.long)
        start = to_device(starts, self.device, torch.long)
        hidden = self._prefill_forward(slots, chunks, starts, idx, start)
        self.lengths[slots] += sizes
        self.length[idx] = start + to_device(sizes, self.device, torch.long)
        done = [i for i, f in enumerate(last) if f]
        if not done:
            return [RUNNING] * len(slots)
        rows = to_device(done, self.device, torch.long)
        di = idx[rows]
        h = hidden[rows]
        c0 = sample_talker(self.processor, self.talker.logits(h), self.seen[di], self.generated[di],
                           self.params.rows(di))
        self.h[di] = h
        self.c0[di] = c0
        self.seen[di] = self.seen[di].scatter(1, c0[:, None], True)
        self.generated[di] += 1
        status = self._status(c0, self.generated[di], self.length[di], self.limit[di])
        self.alive[di] = status == RUNNING
        out = [RUNNING] * len(slots)
        ends = [slots[i] for i in done]
        if not (self.may_end_at_once[ends] | (self.lengths[ends] >= self.capacity)).any():
            return out    # no row can have ended: no read-back, which would wait for the step in flight
        for i, st in zip(done, status.cpu().tolist()):
            out[i] = st
        return out

    def _prefill_forward(self, slots, chunks, starts, idx, start) -> torch.Tensor:
        """The talker forward of a prefill: the hidden state [B, D] at each chunk's last position.

        A few prompts that start their rows and fit a bucket replay the one-row CUDA graphs, one after
        the other (each replay is ~20x shorter than the eager forward's launches); others run as one
        right-padded eager forward.
        """
        graphs = self.prefill_graphs
        if (graphs is not None and len(slots) <= graphs.max_rows and not any(starts)
                and all(graphs.fits(c.shape[0]) for c in chunks)):
            return torch.stack([graphs.run(s, c.to(self.dtype))[0, -1].clone() for s, c in zip(slots, chunks)])
        sizes = [c.shape[0] for c in chunks]
        x = torch.zeros(len(slots), max(sizes), chunks[0].shape[1], dtype=self.dtype, device=self.device)
        for i, c in enumerate(chunks):
            x[i, :sizes[i]] = c
        kmax = min(self.capacity, max(st + n for st, n in zip(starts, sizes)))
        hidden = self.talker(x, self.cache, start, slots=idx, kmax=kmax)
        return hidden[torch.arange(len(slots), device=self.device),
                      to_device([n - 1 for n in sizes], self.device, torch.long)]

    def _status(self, c0, generated, length, limit) -> torch.Tensor:
        """EOS if c0 is EOS; LIMIT if c0 is frame number `limit` or the cache has no room for it."""
        full = length >= self.capacity
        over = (generated > limit) | full
        return torch.where(c0 == self.eos_id, EOS, torch.where(over, LIMIT, RUNNING))

    # -- decode ----------------------------------------------------------------------------------

    def decode(self, n: int, kmax: int, act: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
        """The device part of `step` for slots 0..n-1, attending over kmax keys: frames and status
        packed as [n, 18] int64 (16 codes, status, advanced). Only tensor ops with static shapes for
        (n, kmax), and rows with act False (or not alive) keep their state, so `engine.graphs`
        captures it in a CUDA graph as it is."""
        params = self.params.head(n)
        frame_index = self.generated[:n] - 1
        h, c0 = self.h[:n], self.c0[:n]
        groups = self.talker.code_predictor.num_steps
        noise = None if fused_sampling(self.device, params.sub_top_p_any) or all_greedy(params.sub_greedy) else \
            subtalker_noise(params.seed, frame_index, groups, self.talker.code_predictor.cfg.vocab_size)
        rest = self.talker.predict_codes(
            h, c0, lambda logits, group, embed: sample_subtalker(logits, group, frame_index, params, noise, embed),
            self.cp_cache)
        frames = torch.cat([c0[:, None], rest], dim=1)
        x = self.talker.embed_frame(frames, plus=text_embeds)
        hidden = self.talker(x[:, None], self.cache, self.length[:n], kmax=kmax)[:, 0]
        new_c0 = sample_talker(self.processor, self.talker.logits(hidden), self.seen[:n], self.generated[:n], params)
        state = kernels.RowState(self.alive[:n], h, c0, self.seen[:n], self.generated[:n], self.length[:n],
                                 self.limit[:n])
        if self.talker.model.fused_decode:
            return kernels.advance_rows(act, new_c0, hidden, frames, state, self.eos_id, self.capacity,
                                        (RUNNING, EOS, LIMIT))
        return self._advance(act, new_c0, hidden, frames, state)

    def _advance(self, act, new_c0, hidden, frames, state: "kernels.RowState") -> torch.Tensor:
        """`kernels.advance_rows` as tensor ops (off the fused decode path)."""
        act = act & state.alive
        state.h.copy_(torch.where(act[:, None], hidden, state.h))
        state.c0.copy_(torch.where(act, new_c0, state.c0))
        state.seen.bitwise_or_(torch.zeros_like(state.seen).scatter_(1, new_c0[:, None], True) & act[:, None])
        state.generated.add_(act)
        state.length.add_(act)
        status = torch.where(act, self._status(new_c0, state.generated, state.length, state.limit), RUNNING)
        state.alive.bitwise_and_(status == RUNNING)
        return torch.cat([frames, status[:, None], act[:, None]], dim=1)

    @torch.no_grad()
    def step(self, n: int, active: list[bool], text_embeds: torch.Tensor) -> LaunchedStep:
        """Launch one frame for every active row among slots 0..n-1.

        active: n host bools; text_embeds [n, D]: the text term each row adds to its frame embedding
        (its next trailing text embed, tts_eos, or tts_pad; ignored for inactive rows).
        For each active row: the code predictor completes frame k from (h, c0), the talker runs
        embed_frame(frame) + text at the next position, and c0 number k+1 is sampled. The frame is
        returned; status says whether the row continues (inactive rows: RUNNING, state untouched).
        One host->device copy (the mask) and one device->host copy (frames + status), neither of
        which waits for the device. On CUDA with graphs enabled (`use_cuda_graphs`), the device part
        replays a captured graph per bucket.
        """
        on_host = np.asarray(active, dtype=bool)
        short = self.unreserved(n, on_host)
        if short.size:
            self.cache.reserve(short.tolist(), (self.lengths[short] + 1).tolist())
        live = int(self.lengths[:n].max()) + 1
        if self.graphs is not None:
            out = self.graphs.run(n, live, on_host, text_embeds)
        else:
            kmax = min(self.capacity, -(-live // self.kv_bucket) * self.kv_bucket)
            act = to_device(on_host, self.device)
            out = self.decode(n, kmax, act, text_embeds.to(self.dtype))
        self.lengths[:n] += on_host   # a row finished on the device counts one too many: it is over anyway
        return LaunchedStep(out)
