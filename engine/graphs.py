"""CUDA graphs of the decode step, one per (batch bucket, kv-length bucket); of a one-row prefill per
prompt-length bucket; of the streaming vocoder per (batch bucket, window size).

One decode step launches ~2,000 small kernels (1 talker forward + 15 code-predictor steps + 16
samplings); at small batch the GPU waits on launches, not on math (PERF_NOTES.md). `ModelRunner.decode`
has static shapes for a given (n, kmax) and only in-place state updates, so it is captured as it is:
the batch is padded up to a bucket with inactive rows (whose state `decode` leaves untouched) and
attention spans a bucketed number of keys (with the fused decode path, `DecoderStack._decode`,
attention reads each row's live keys itself, so one kv bucket, the capacity, serves). Graphs are
captured on first use of a bucket (or up front by `capture`); capturing runs with every row
inactive, so it is safe while sessions are live.

Memory: a graph keeps what its replay's intermediates use for as long as it lives (its pool). The
graphs replayed on one stream (a scheduler's step and prefill graphs, and its vocoder's where the
vocoder shares their stream) share one pool, so they hold what the largest needs, not the sum (on an
H200 at 256 slots: 18.7 GiB as separate pools grown smallest first). That is safe because those
replays run one at a time and each graph's output is copied out before another graph replays; the
vocoder's graphs on a stream of their own (`engine.streaming`) run beside the steps', so they have a
pool of their own. `capture` goes largest first: a later, smaller graph fits in the
blocks the larger one left, where the other order leaves each bucket's blocks too small for the next.
"""
from __future__ import annotations

import bisect
import contextlib

import numpy as np
import torch

from .host import to_device

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def _kv_buckets(capacity: int) -> list[int]:
    """128, 256, 512, ... up to the cache capacity (attention reads at most 2x the live keys)."""
    out, k = [], 128
    while k < capacity:
        out.append(k)
        k *= 2
    return out + [capacity]


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_graph(forward, pool, context=contextlib.nullcontext):
    """(graph, output) of `forward()` captured from the memory pool `pool`, after one eager run on a
    side stream (lazy inits, the allocator, cuBLAS and cuDNN choices), both under `context()`.

    The side stream is one per device: cuBLAS keeps a workspace for every stream it ran on (32 MiB
    each on an H200, ~1 GiB for a new stream per capture)."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = _warmup_streams.get(device) or _warmup_streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad(), context():
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad(), context():
        out = forward()
    return graph, out


class StepGraphs:
    def __init__(self, runner, batch_buckets=None, kv_buckets=None, pool=None):
        self.runner = runner
        max_batch = runner.max_batch
        buckets = sorted({b for b in (batch_buckets or DEFAULT_BATCH_BUCKETS) if b < max_batch} | {max_batch})
        self.batch_buckets = buckets
        if runner.talker.model.fused_decode:
            self.kv_buckets = [runner.capacity]
        else:
            self.kv_buckets = sorted(kv_buckets) if kv_buckets else _kv_buckets(runner.capacity)
        hidden = runner.h.shape[1]
        self.act = torch.zeros(max_batch, dtype=torch.bool, device=runner.device)
        self.text = torch.zeros(max_batch, hidden, dtype=runner.dtype, device=runner.device)
        self.pool = pool or torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, n: int, live: int) -> tuple[int, int, bool, bool]:
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, n)]
        k = self.kv_buckets[min(bisect.bisect_left(self.kv_buckets, live), len(self.kv_buckets) - 1)]
        p = self.runner.params
        return b, k, p.talker_top_p_any, p.sub_top_p_any   # top-p flags change which ops run

    def run(self, n: int, live: int, active: np.ndarray, text_embeds: torch.Tensor) -> torch.Tensor:
        """Replay the step for slots 0..n-1; returns the packed [n, 17] device output."""
        key = self.bucket(n, live)
        entry = self.graphs.get(key) or self._capture(key)
        b = key[0]
        host = np.zeros(b, dtype=bool)
        host[:n] = active
        self.act[:b].copy_(to_device(host, self.act.device))   # staged: a pageable copy would wait for the GPU
        self.text[:n].copy_(text_embeds)
        graph, out = entry
        graph.replay()
        return out[:n]

    def capture(self, max_live: int | None = None) -> int:
        """Capture every batch bucket for kv buckets up to `max_live` keys (server warm-up), largest first."""
        kvs = [k for k in self.kv_buckets if max_live is None or k <= max(max_live, self.kv_buckets[0])]
        p = self.runner.params
        for b in reversed(self.batch_buckets):
            for k in reversed(kvs):
                key = (b, k, p.talker_top_p_any, p.sub_top_p_any)
                if key not in self.graphs:
                    self._capture(key)
        return len(self.graphs)

    def _capture(self, key):
        b, k = key[0], key[1]
        runner = self.runner
        self.act[:b] = False                      # every row inactive: capturing changes no state
        self.graphs[key] = capture_graph(lambda: runner.decode(b, k, self.act[:b], self.text[:b]), self.pool)
        return self.graphs[key]


class PrefillGraphs:
    """CUDA graphs of a one-row talker prefill from position 0, one per prompt-length bucket.

    A session's time to first audio starts with its prompt's prefill, and sessions mostly arrive one
    at a time. Eagerly, the talker's 28 layers are ~600 small kernels launched from Python (~25 ms on
    an H200, most of a first chunk's time); replayed, they cost what the GPU takes. The prompt is
    right-padded to its bucket: the padding's K/V land after the prompt, in the row's pages (which
    the decode steps overwrite) or the cache's scratch page, where no real query looks (causal). Up
    to `max_rows` prompts admitted together replay it one after the other; more rows, and chunks
    that continue a long prompt, run eagerly. (An H200 server at 64 arrivals a second admitted 5-7
    sessions at once often; their eager prefill took 40-51 ms of an 80 ms frame, with 4 rows the most
    replayed. Each replay is ~20x shorter than one eager forward, so 16 replays still beat it.)
    """

    def __init__(self, runner, buckets=(16, 32, 64, 128, 256), max_rows: int = 16, pool=None):
        self.runner = runner
        self.max_rows = max_rows
        self.buckets = [b for b in sorted(buckets) if b <= runner.capacity]
        hidden = runner.h.shape[1]
        self.x = torch.zeros(1, max(self.buckets, default=0), hidden, dtype=runner.dtype, device=runner.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=runner.device)
        self.start = torch.zeros(1, dtype=torch.long, device=runner.device)
        self.pool = pool or torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, positions: int) -> bool:
        return bool(self.buckets) and positions <= self.buckets[-1]

    def run(self, slot: int, chunk: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, T, D] of the prompt chunk [T, D] (T `fits`) prefilled into `slot` from
        position 0; a view of the graph's output, valid until the next replay."""
        t = chunk.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, t)]
        self.x[0, :t].copy_(chunk)
        self.x[0, t:bucket].zero_()
        self.slot.fill_(slot)
        graph, out = self.graphs.get(bucket) or self._capture(bucket)
        graph.replay()
        return out[:, :t]

    def capture(self) -> int:
        for bucket in reversed(self.buckets):
            if bucket not in self.graphs:
                self._capture(bucket)
        return len(self.graphs)

    def _capture(self, bucket: int):
        """Capturing writes K/V into slot `self.slot` (the slot being prefilled, which the prefill
        then overwrites, or slot 0 before serving, which holds no pages: the scratch page)."""
        runner = self.runner
        self.graphs[bucket] = capture_graph(
            lambda: runner.talker(self.x[:, :bucket], runner.cache, self.start, slots=self.slot, kmax=bucket), self.pool)
        return self.graphs[bucket]


@contextlib.contextmanager
def cudnn_autotuned():
    """cuDNN times its convolution algorithms for each shape it has not met (the warm-up run before a
    capture) and reuses the fastest. Only around captures: an eager window of a new shape would
    stall its step for seconds while every algorithm is timed (seen on an H200: 2-3 s)."""
    b = torch.backends.cudnn
    with b.flags(enabled=b.enabled, benchmark=True, deterministic=b.deterministic, allow_tf32=b.allow_tf32):
        yield


class VocoderGraphs:
    """CUDA graphs of `VocoderStreams.decode`, one per (batch bucket, window size W).

    The streaming vocoder's call has static shapes per (B, W) and no host sync; at small batch its
    few hundred small kernels cost more to launch than to run. Batches are padded up to a bucket with
    the streams' spare `pad_slot` (no session owns its state), so only the real rows' state advances.
    A window of another size (a turn's last, partial window, a flush while waiting for text, an ICL
    reference) is decoded as a run of captured sizes, largest first (1 is always captured): the
    stateful decoder makes that the same audio, and no eager window of a new shape ever stalls the
    step (the first eager call of a shape took 0.16-0.8 s on an H200, as cuDNN prepared its kernels).
    Every captured window uses the convolution algorithms cuDNN found fastest by timing them at
    capture (`cudnn_autotuned`): up to 21% off the vocoder at 256 streams on an H200 (bench/README.md);
    under its heuristics a 2-frame window's dilated conv of 32 streams took a generic kernel of 1.1 ms
    channels-first and 43.6 ms channels-last, 0.1 ms timed (an H100, `bench.conv_layout --benchmark 0`).
    A replay decodes at most `max_batch` streams; more are decoded as replays of that many. A graph's
    intermediates stay reserved in the pool for as long as it lives, and the vocoder's grow with the
    batch (an H200, bf16, 8-frame windows: 12.5 GiB for 256 streams, 2.6 GiB for 64, which took 10%
    longer for 256 streams as four replays).
    """

    def __init__(self, streams, windows, batch_buckets=None, pool=None, max_batch: int | None = None):
        self.streams = streams
        n = streams.max_streams
        top = self.max_batch = min(n, max_batch or n)
        self.windows = sorted({1, *windows})
        self.batch_buckets = sorted({b for b in (batch_buckets or DEFAULT_BATCH_BUCKETS) if b < top} | {top})
        device = streams.frames.device
        self.slots = torch.full((top,), streams.pad_slot, dtype=torch.long, device=device)   # a replay's inputs
        self.codes = torch.zeros(top, max(self.windows), streams.vocoder.num_codebooks, dtype=torch.long, device=device)
        self.pool = pool or torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def decode(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        b, w = codes.shape[:2]
        if b > self.max_batch:
            step = self.max_batch
            return torch.cat([self.decode(slots[i:i + step], codes[i:i + step]).clone()   # `out` is reused
                              for i in range(0, b, step)])
        if w not in self.windows:
            pieces, t = [], 0
            while t < w:
                size = max(s for s in self.windows if s <= w - t)
                pieces.append(self.decode(slots, codes[:, t:t + size]).clone())   # the next replay reuses `out`
                t += size
            return torch.cat(pieces, dim=1)
        bucket = self.batch_buckets[bisect.bisect_left(self.batch_buckets, b)]
        graph, out = self.graphs.get((bucket, w)) or self._capture(bucket, w)
        self.slots[:bucket].fill_(self.streams.pad_slot)
        self.slots[:b].copy_(slots)
        self.codes[:b, :w].copy_(codes)
        graph.replay()
        return out[:b]

    def capture(self) -> int:
        for b in reversed(self.batch_buckets):
            for w in reversed(self.windows):
                if (b, w) not in self.graphs:
                    self._capture(b, w)
        return len(self.graphs)

    def _capture(self, bucket: int, w: int):
        self.slots[:bucket].fill_(self.streams.pad_slot)    # capture touches only the spare slot's state
        slots, codes = self.slots[:bucket], self.codes[:bucket, :w]
        # the eager run before the capture times cuDNN's algorithms, the capture takes the fastest
        self.graphs[(bucket, w)] = capture_graph(lambda: self.streams.decode(slots, codes), self.pool, cudnn_autotuned)
        return self.graphs[(bucket, w)]
