"""Streaming vocoder windows for the scheduler: which sessions' audio is due, decoded in batches.

Each slot's generated frames wait in a slot-indexed device ring until its window closes: a small
first window (time to first audio), then larger ones as far as the listener's buffered audio allows
(`WindowPolicy`). A finishing session, or one that must wait for text, flushes what it has. Sessions
due with the same window size are decoded in one batched `VocoderStreams.decode`, whose stateful
causal decoder makes the concatenated windows equal to one decode of all the frames. An ICL
session's stream is primed with its reference codes, so its audio equals decoding
`ref_codes ++ codes` and dropping the first `T_ref * 1920` samples.

On a GPU the scheduler runs one step ahead of what it has read back (`engine.scheduler`): a step's frames
are put in the ring when it is launched (`add`), and count toward a window once its result says the
row made them (`confirm`); a window's audio comes back to the host without waiting (`WindowAudio`). A
window waits for the step that made its last frames (an event after their `add`), not for the step
launched since.

On a GPU the windows are decoded on a CUDA stream of their own (`VocoderStream`), beside the decode
steps: a step leaves most of the GPU idle (at one session it waits on kernel latency), and the vocoder's
convolutions fill it, where on one stream each waited for the other. `QWEN3_TTS_VOCODER_STREAM=0` puts
them back on the step's stream.

On device out-of-memory a window decode is split, first across streams, then in time (the decoder
state carries over, so the audio is the same).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from .host import ToHost, to_device
from .model.vocoder import VocoderStreams
from .requests import PerVoice


@dataclass(frozen=True)
class WindowPolicy:
    """When a session's pending frames become a vocoder window.

    The first window has `first` frames (time to first audio). After it, a window closes at one of
    the sizes `first`, 2 x `first`, 4 x `first` ... `rest` (a few fixed sizes, each with its CUDA
    graphs): at `rest`, or earlier when waiting for the next size could let the listener run dry.
    The listener holds the audio sent so far less the time since its first chunk (`held_s`); waiting
    for the next size takes its missing frames at `step_s` each, plus two: the step that runs while
    the window is decoded (a scheduler overlapping the host with the GPU sends a window's audio once
    the next step has run; reading back at once, on the CPU, it is one frame of slack), and the way
    out; and `reserve_s` more, for steps slower than the estimate (a recent average: it lags while
    sessions join and the steps grow, and cannot see a slow one coming). So windows grow to `rest`
    (fewer, fatter vocoder calls) while generation is well ahead of real time and stay small near
    it: frames made at least as fast as they play never leave playback empty.
    """
    first: int = 2
    rest: int = 8
    reserve_s: float = 0.08

    def __post_init__(self):
        if self.first < 1 or self.rest < 1:
            raise ValueError(f"window sizes must be >= 1 frame, got {self.first}, {self.rest}")
        if self.reserve_s < 0:
            raise ValueError(f"the reserve must be >= 0 s, got {self.reserve_s}")

    def sizes(self) -> list[int]:
        """The window sizes a window closes at (for CUDA graph capture)."""
        top, out = max(self.first, self.rest), [self.first]
        while out[-1] < top:
            out.append(min(2 * out[-1], top))
        return out

    def due(self, pending: np.ndarray, decoded: np.ndarray, held_s: np.ndarray, step_s: float) -> np.ndarray:
        """Whether each session's `pending` frames make a window now, given the frames already
        `decoded` into audio, the seconds of audio its listener still holds and the seconds one
        frame takes to make."""
        sizes = np.asarray(self.sizes())
        nxt = sizes[np.minimum(np.searchsorted(sizes, pending, side="right"), len(sizes) - 1)]
        at_size = np.isin(pending, sizes)
        running_dry = held_s < (nxt - pending + 2) * step_s + self.reserve_s
        return np.where(decoded == 0, pending >= self.first, (pending >= sizes[-1]) | (at_size & running_dry))

    def running_short(self, held_s: float, step_s: float) -> bool:
        """Whether a listener holding `held_s` seconds of audio not yet played needs audio that is made
        now rather than at the host's next look, a step later (`Scheduler.defer_audio`): it holds less
        than the reserve and two steps (the one until that look, and the way out)."""
        return held_s < self.reserve_s + 2 * step_s


# The vocoder on a CUDA stream of its own beside the steps (see above); "0" turns it off.
VOCODER_STREAM = os.environ.get("QWEN3_TTS_VOCODER_STREAM", "1")


class VocoderStream:
    """Where the vocoder's work runs: a CUDA stream of its own, ordered after everything the caller's
    stream queued before (the frames it reads, a slot's previous session), or the caller's own stream
    (the CPU; `QWEN3_TTS_VOCODER_STREAM=0`).

    What the vocoder keeps to itself (its streams' state, its graphs' pool, its outputs up to their
    copy to the host) is only touched from this stream, in launch order. Tensors the caller's stream
    made and the vocoder reads are passed to `enter`, so the allocator keeps their memory until the
    vocoder's use has run."""

    def __init__(self, device: torch.device):
        self.stream = None
        if torch.device(device).type == "cuda" and VOCODER_STREAM != "0":
            self.stream = torch.cuda.Stream(device)

    def enter(self, *inputs: torch.Tensor, after: "torch.cuda.Event | None" = None):
        """A context running the vocoder's work after the caller's stream's (all it queued so far, or
        with `after`, what it queued before that event: `record`), reading `inputs`."""
        if self.stream is None:
            return contextlib.nullcontext()
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream())
        else:
            self.stream.wait_event(after)
        for t in inputs:
            t.record_stream(self.stream)
        return torch.cuda.stream(self.stream)

    def record(self) -> "torch.cuda.Event | None":
        """An event on the caller's stream for `enter`'s `after`: None on the caller's own stream."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event


class WindowAudio:
    """A window decode's audio on its way to the host; split on out-of-memory, its parts are joined
    along `axis` (0: streams, 1: time) when read. `samples`: each stream's samples to keep, where a
    finished turn's last window was decoded padded to a larger size (None: all of them)."""

    def __init__(self, parts: list, axis: int = 0, samples: np.ndarray | None = None):
        self.parts, self.axis, self.samples = parts, axis, samples

    def ready(self) -> bool:
        """Whether `wait` would return at once (the device has made all of it)."""
        return all(p.ready() for p in self.parts)

    def wait(self) -> np.ndarray | list[np.ndarray]:
        """Audio [streams, samples] float32 (with `samples`: each stream's row cut to its length), once
        the device has made it: a copy in pageable memory (the pinned buffers go back to PyTorch's pool
        at once, however long listeners keep chunks)."""
        audio = np.concatenate([p.wait() if isinstance(p, WindowAudio) else p.wait().numpy() for p in self.parts],
                               axis=self.axis)
        return audio if self.samples is None else [row[:n] for row, n in zip(audio, self.samples)]


class StreamingVocoder:
    """Per-slot pending frames and stream state for up to `max_streams` slots."""

    def __init__(self, vocoder, max_streams: int, policy: WindowPolicy, frame_audio_s: float,
                 num_codebooks: int = 16, on_out_of_memory=None):
        """frame_audio_s: seconds of audio in one frame. on_out_of_memory(): called on each device
        out-of-memory error before the work is split (default: release the allocator's cached blocks)."""
        self.frame_audio_s = frame_audio_s
        self.on_out_of_memory = on_out_of_memory or release_cached_memory
        self.streams = VocoderStreams(vocoder, max_streams)
        self.policy = policy
        device = self.streams.frames.device
        self.device = device
        # frame k of a stream sits at k % ring: a window, the step launched after it and the next fit,
        # and room for windows to wait a few more (`Scheduler.defer_audio`: 1.1 MB at 256 slots)
        self.ring = 4 * max(policy.first, policy.rest) + 2
        # a window's codes stay in the ring this many iterations after its launch: it holds frames made
        # by the steps read back before it, and the first frame over them is `ring` - its size frames on
        self.ring_iterations = self.ring - max(policy.first, policy.rest)
        self.pending = torch.zeros(max_streams, self.ring, num_codebooks, dtype=torch.long, device=device)
        self.written = np.zeros(max_streams, dtype=np.int64)   # frames put in the ring (confirmed or not)
        self.count = np.zeros(max_streams, dtype=np.int64)     # confirmed frames waiting for a window
        self.decoded = np.zeros(max_streams, dtype=np.int64)   # frames already turned into audio
        self.started = np.zeros(max_streams)                   # time.monotonic() of the first audio
        self.graphs = None                                       # engine.graphs.VocoderGraphs once enabled
        self.stream = VocoderStream(device)
        self._primed = PerVoice()             # reference codes -> the stream state they prime

    def use_cuda_graphs(self, pool=None, max_batch: int | None = None) -> None:
        """Replay the window decodes of the policy's window sizes from CUDA graphs, at most `max_batch`
        streams a replay (default: all). Their memory pool is `pool` where the vocoder shares the
        caller's stream (graphs replayed one after the other may share one), a pool of their own
        where it runs beside it."""
        from .graphs import VocoderGraphs
        if self.stream.stream is not None:
            pool = None
        self.graphs = VocoderGraphs(self.streams, self.policy.sizes(), pool=pool, max_batch=max_batch)

    def capture(self) -> int:
        """Capture the vocoder's CUDA graphs up front; returns how many there are."""
        with self.stream.enter():
            return self.graphs.capture()

    def start(self, slots: list[int], ref_codes: list[torch.Tensor | None]) -> None:
        """Fresh streams for new sessions; ICL ones are primed by decoding their reference codes.

        A voice's primed state is kept while its reference codes tensor lives (a server's registered
        voice: every session after the first copies it, 0.85 MB with the 12 Hz decoder, instead of decoding T_ref
        frames of audio it drops)."""
        idx = np.asarray(slots, dtype=np.int64)
        self.written[idx] = self.count[idx] = self.decoded[idx] = 0
        with self.stream.enter():
            self._start(slots, ref_codes)

    def _start(self, slots: list[int], ref_codes: list[torch.Tensor | None]) -> None:
        self.streams.reset(self._index(slots))
        unprimed: dict[int, tuple[int, torch.Tensor]] = {}   # the first slot of each reference not primed yet
        copies = []
        for s, r in zip(slots, ref_codes):
            if r is None:
                continue
            if self._primed.get(r) is not None or id(r) in unprimed:
                copies.append((s, r))
            else:
                unprimed[id(r)] = (s, r)
        by_length: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for s, r in unprimed.values():
            by_length.setdefault(r.shape[0], []).append((s, r))
        for group in by_length.values():   # one decode per reference length; the audio is dropped
            self._decode(self._index([s for s, _ in group]), to_device(torch.stack([r for _, r in group]), self.device))
        for s, r in unprimed.values():
            self._primed.put(r, self.streams.snapshot(s))
        for s, r in copies:
            self.streams.restore(self._index([s]), self._primed.get(r))

    def add(self, rows: np.ndarray, frames: torch.Tensor) -> "torch.cuda.Event | None":
        """Put frames[rows] (one frame each, [n, 16] on the device, from a step just launched) in the
        rings of slots `rows`; they join a window once `confirm`ed. Returns an event after the write
        (on a vocoder stream of its own) for `decode`'s `after`."""
        if rows.size == 0:
            return None
        idx = self._index(rows)
        self.pending[idx, self._index(self.written[rows] % self.ring)] = frames[idx]
        self.written[rows] += 1
        return self.stream.record()

    def confirm(self, rows: np.ndarray) -> None:
        """The step's result says slots `rows` made the frame `add` put in their rings."""
        self.count[rows] += 1

    def first_window_closes(self, slots: np.ndarray) -> bool:
        """Whether one more frame closes the first window of a stream among `slots`."""
        return bool(((self.decoded[slots] == 0) & (self.count[slots] + 1 >= self.policy.first)).any())

    def held_s(self, slots: np.ndarray) -> np.ndarray:
        """Seconds of audio each slot's listener still holds, playing from its first chunk on."""
        return self.decoded[slots] * self.frame_audio_s - (time.monotonic() - self.started[slots])

    def due(self, slots: np.ndarray, flush: np.ndarray, step_s: float,
            last: np.ndarray | None = None) -> list[tuple[np.ndarray, int]]:
        """Groups (slots, frames) to decode now: windows the policy closes (a frame taking `step_s`
        to make), and whatever the `flush` slots have (a session that ended, or one that has to wait).

        The `last` slots' windows are their turns' last (the stream is not decoded further): each is
        decoded as the smallest window size that holds it (its extra frames code 0, their audio
        dropped: the decoder is causal, so the real frames' audio is the same), in the group of that
        size. Under a steady load turns end every frame with any number of frames left; as windows
        of their own sizes they were another small, launch-bound vocoder replay or several each."""
        count = self.count[slots]
        full = self.policy.due(count, self.decoded[slots], self.held_s(slots), step_s)
        take = full | (flush & (count > 0))
        ready, frames = slots[take], count[take]
        if last is not None:
            sizes = np.asarray(self.policy.sizes())
            padded = sizes[np.minimum(np.searchsorted(sizes, frames), len(sizes) - 1)]
            frames = np.where(last[take] & (padded > frames), padded, frames)
        return [(ready[frames == w], int(w)) for w in np.unique(frames)]

    def decode(self, slots: np.ndarray, frames: int, after: "torch.cuda.Event | None" = None) -> WindowAudio:
        """Launch the decode of each slot's `frames` confirmed pending frames: audio
        [len(slots), frames*1920] float32 once waited for.

        `frames` must equal the pending count of every slot in `slots` (as `due` groups them), or
        exceed it for a turn's last window (`due`'s `last`): that stream's audio is cut to its frames.
        The codes are taken from the rings on the caller's stream, behind all it queued (the ring's
        next writes come after), or with `after` (the event `add` gave for the latest of these
        frames) on the vocoder's stream once that event has passed: the caller must then keep the
        rings' positions read here unwritten until the audio is out (see `Scheduler._launch_windows`).
        """
        count = self.count[slots]
        if after is None:
            idx, codes = self._gather(slots, frames, count)
            with self.stream.enter(idx, codes):
                audio = self._decode(idx, codes)
        else:
            with self.stream.enter(after=after):
                idx, codes = self._gather(slots, frames, count)
                audio = self._decode(idx, codes)
        if (count < frames).any():
            audio = WindowAudio([audio], samples=count * self.streams.vocoder.samples_per_frame)
        self.started[slots] = np.where(self.decoded[slots] == 0, time.monotonic(), self.started[slots])
        self.count[slots] = 0
        self.decoded[slots] += frames
        return audio

    def _gather(self, slots: np.ndarray, frames: int, count: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' indices and their next `frames` codes [n, frames, 16] from the rings, on the
        current stream; a last window's frames beyond its `count` are code 0 (the ring may hold anything
        there)."""
        idx = self._index(slots)
        ring = self._index((self.decoded[slots, None] + np.arange(frames)) % self.ring)
        codes = self.pending[idx[:, None], ring]
        if (count < frames).any():
            codes = codes * (self._index(np.arange(frames)[None, :] < count[:, None])[..., None])
        return idx, codes

    def _decode(self, idx: torch.Tensor, codes: torch.Tensor) -> WindowAudio:
        try:
            decode = self.graphs.decode if self.graphs is not None else self.streams.decode
            return WindowAudio([ToHost(decode(idx, codes))])
        except torch.OutOfMemoryError:
            self.on_out_of_memory()
            b, w = codes.shape[:2]
            if b > 1:
                h = b // 2
                return WindowAudio([self._decode(idx[:h], codes[:h]), self._decode(idx[h:], codes[h:])])
            if w > 1:
                h = w // 2
                return WindowAudio([self._decode(idx, codes[:, :h]), self._decode(idx, codes[:, h:])], axis=1)
            raise

    def _index(self, values) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), self.device)


def release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back before retrying a smaller piece of work."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
