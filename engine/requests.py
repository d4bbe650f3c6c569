"""What a caller hands the scheduler and what it gets back.

These plain dataclasses are the whole contract between the server (`app/`) and the engine: the
server builds a `SpeechRequest`, submits it, and reads `AudioChunk`s until a `TurnResult`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """Talker and code-predictor sampling; defaults are generation_config.json of the 0.6B model.

    `min_new_tokens` above the frame limit suppresses EOS (fixed-length turns for benchmarks).

    `greedy` makes both the talker and the code predictor take the argmax (the repetition penalty
    still applies to the talker, as in the official code). `seed` None means a random seed.
    """
    greedy: bool = False
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_greedy: Optional[bool] = None  # None: same as `greedy`
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    seed: Optional[int] = None
    min_new_tokens: int = 2   # EOS is impossible before this many talker tokens (official: 2)

    @property
    def sub_greedy(self) -> bool:
        return self.greedy if self.subtalker_greedy is None else self.subtalker_greedy

    def validate(self) -> None:
        """Raises ValueError for values the samplers cannot take."""
        for greedy, temp, top_p in ((self.greedy, self.temperature, self.top_p),
                                    (self.sub_greedy, self.subtalker_temperature, self.subtalker_top_p)):
            if not greedy and not temp > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {temp}")
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@dataclass(frozen=True)
class VoicePrompt:
    """A cloned voice: the x-vector, plus the reference codes and text ids in ICL mode."""
    xvector: torch.Tensor                          # [talker hidden] float32, CPU
    ref_codes: Optional[torch.Tensor] = None       # [T_ref, 16] int64, CPU (ICL only)
    ref_text_ids: Optional[list[int]] = None       # reference text token ids R (ICL only)

    @property
    def icl(self) -> bool:
        return self.ref_codes is not None


class PerVoice:
    """Values the engine derives from one of a voice's tensors (its x-vector, its reference codes),
    kept while that tensor lives: a server speaks many turns with a few registered voices, whose
    prompt head and primed vocoder state need computing once. Keyed by the tensor's identity."""

    def __init__(self):
        self._values: dict[int, Any] = {}

    def get(self, tensor: torch.Tensor) -> Any:
        return self._values.get(id(tensor))

    def put(self, tensor: torch.Tensor, value: Any) -> None:
        self._values[id(tensor)] = value
        weakref.finalize(tensor, PerVoice._forget, weakref.ref(self), id(tensor))

    def __len__(self) -> int:
        return len(self._values)

    @staticmethod
    def _forget(cache_ref: weakref.ref, key: int) -> None:
        """The tensor is gone: so is its value (and the cache is not kept alive by the tensor)."""
        cache = cache_ref()
        if cache is not None:
            cache._values.pop(key, None)


@dataclass
class SpeechRequest:
    """One turn to speak.

    `text` is the whole turn when `text_complete` is True; otherwise more text arrives through the
    handle (`RequestHandle.push_text` / `finish_text`) and the model starts before it is complete.
    """
    text: str
    voice: VoicePrompt
    language: str = "auto"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    text_complete: bool = True
    max_frames: Optional[int] = None   # None: the model's max_new_tokens - 1
    non_streaming_text: bool = False   # the "full text in the prefill" layout of the official code
    request_id: str = ""


@dataclass(frozen=True)
class AudioChunk:
    """A piece of a turn's 24 kHz float32 audio, in order, with where it sits in the turn."""
    pcm: np.ndarray          # float32 [n] in [-1, 1]
    frame_offset: int        # first codec frame of this chunk, counted from the turn's start
    sample_offset: int       # first sample of this chunk, counted from the turn's start (24 kHz)


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended; the last item an audio iterator yields."""
    reason: str              # "eos" | "max_frames" | "cancelled" | "error"
    frames: int              # codec frames generated (and streamed, unless cancelled)
    samples: int             # samples streamed = frames * 1920 when not cancelled
    queue_ms: float = 0.0    # submit -> prefill start
    ttfa_ms: float = 0.0     # submit -> first audio chunk ready
    error: Optional[str] = None
    codes: Optional[np.ndarray] = None  # [frames, 16] int64 when the request asked to keep them
