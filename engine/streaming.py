"""Streaming vocoder windows for the scheduler: which sessions' audio is due, decoded in batches.

Each slot's generated frames wait in a slot-indexed device buffer until its window is full: a small
first window (time to first audio), larger ones after (fewer, fatter vocoder calls). A finishing
session, or one that must wait for text, flushes what it has. Sessions due with the same window size are decoded in one batched
`VocoderStreams.decode`, whose stateful causal decoder makes the concatenated windows equal to one
decode of all the frames. An ICL session's stream is primed with its reference codes, so its audio
equals decoding `ref_codes ++ codes` and dropping the first `T_ref * 1920` samples.

On device out-of-memory a window decode is split, first across streams, then in time (the decoder
state carries over, so the audio is the same).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .model.vocoder import VocoderStreams


@dataclass(frozen=True)
class WindowPolicy:
    """Frames per vocoder window: `first` for a session's first audio, then as many frames as have
    been sent so far (the windows double: 2, 2, 4, 8 ...), capped at `rest`.

    Doubling keeps playback fed from the start: when a window is due, the client holds as much
    audio as the window is long, so a turn generated at real time or faster never runs dry, while
    time to first audio stays that of a `first`-frame window.
    """
    first: int = 2
    rest: int = 8

    def __post_init__(self):
        if self.first < 1 or self.rest < 1:
            raise ValueError(f"window sizes must be >= 1 frame, got {self.first}, {self.rest}")

    def size(self, decoded):
        """Window due after `decoded` frames (an int or an array of them)."""
        return np.minimum(np.maximum(decoded, self.first), max(self.first, self.rest))

    def sizes(self) -> list[int]:
        """Every window size `size` gives (for CUDA graph capture)."""
        out, decoded = [], 0
        while not out or out[-1] < max(self.first, self.rest):
            out.append(int(self.size(decoded)))
            decoded += out[-1]
        return sorted(set(out))


class StreamingVocoder:
    """Per-slot pending frames and stream state for up to `max_streams` slots."""

    def __init__(self, vocoder, max_streams: int, policy: WindowPolicy, num_codebooks: int = 16,
                 on_out_of_memory=None):
        """on_out_of_memory(): called on each device out-of-memory error before the work is split
        (default: release the allocator's cached blocks)."""
        self.on_out_of_memory = on_out_of_memory or release_cached_memory
        self.streams = VocoderStreams(vocoder, max_streams)
        self.policy = policy
        device = self.streams.frames.device
        self.device = device
        self.pending = torch.zeros(max_streams, max(policy.first, policy.rest), num_codebooks,
                                   dtype=torch.long, device=device)
        self.count = np.zeros(max_streams, dtype=np.int64)     # frames waiting in `pending`
        self.decoded = np.zeros(max_streams, dtype=np.int64)   # frames already turned into audio
        self.graphs = None                                       # engine.graphs.VocoderGraphs once enabled

    def use_cuda_graphs(self) -> None:
        """Replay the window decodes of the policy's window sizes from CUDA graphs."""
        from .graphs import VocoderGraphs
        self.graphs = VocoderGraphs(self.streams, self.policy.sizes())

    def start(self, slots: list[int], ref_codes: list[torch.Tensor | None]) -> None:
        """Fresh streams for new sessions; ICL ones are primed by decoding their reference codes."""
        idx = np.asarray(slots, dtype=np.int64)
        self.count[idx] = 0
        self.decoded[idx] = 0
        self.streams.reset(self._index(slots))
        by_length: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for s, r in zip(slots, ref_codes):
            if r is not None:
                by_length.setdefault(r.shape[0], []).append((s, r))
        for group in by_length.values():   # one decode per reference length; the audio is dropped
            self._decode(self._index([s for s, _ in group]), torch.stack([r for _, r in group]).to(self.device))

    def add(self, rows: np.ndarray, frames: torch.Tensor) -> None:
        """Append frames[rows] (one frame each, [n, 16] on the device) to the pending windows of slots `rows`."""
        if rows.size == 0:
            return
        idx = self._index(rows)
        self.pending[idx, self._index(self.count[rows])] = frames[idx]
        self.count[rows] += 1

    def window(self, slots: np.ndarray) -> np.ndarray:
        """Window size now due for each slot."""
        return self.policy.size(self.decoded[slots])

    def due(self, slots: np.ndarray, flush: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Groups (slots, frames) to decode now: full windows, and whatever the `flush` slots have
        (a session that ended, or one that has to wait)."""
        full = self.count[slots] >= self.window(slots)
        ready = slots[full | (flush & (self.count[slots] > 0))]
        counts = self.count[ready]
        return [(ready[counts == w], int(w)) for w in np.unique(counts)]

    def decode(self, slots: np.ndarray, frames: int) -> np.ndarray:
        """Audio [len(slots), frames*1920] float32 of the first `frames` pending frames of each slot.

        `frames` must equal the pending count of every slot in `slots` (as `due` groups them).
        """
        wav = self._decode(self._index(slots), self.pending[self._index(slots), :frames])
        self.count[slots] = 0
        self.decoded[slots] += frames
        return wav

    def _decode(self, idx: torch.Tensor, codes: torch.Tensor) -> np.ndarray:
        try:
            decode = self.graphs.decode if self.graphs is not None else self.streams.decode
            return decode(idx, codes).cpu().numpy()
        except torch.OutOfMemoryError:
            self.on_out_of_memory()
            b, w = codes.shape[:2]
            if b > 1:
                h = b // 2
                return np.concatenate([self._decode(idx[:h], codes[:h]), self._decode(idx[h:], codes[h:])])
            if w > 1:
                h = w // 2
                return np.concatenate([self._decode(idx, codes[:, :h]), self._decode(idx, codes[:, h:])], axis=1)
            raise

    def _index(self, values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=self.device)


def release_cached_memory() -> None:
    """Give the CUDA caching allocator's free blocks back before retrying a smaller piece of work."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
