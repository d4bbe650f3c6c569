"""What both routes share: the model, the scheduler, the voices, readiness and limits.

`Service.start` loads the model (or a random tiny one with --demo), starts the scheduler, computes
the built-in default voice, loads the registered voices and runs one short warm-up turn; only then is
the server ready. The WebSocket and REST code only call `voice`, `clone`, `submit` and `health`.
"""
from __future__ import annotations

import asyncio
import gc
import io
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import soundfile as sf
import torch

from engine.audio_io import BUILTIN_VOICE_WAV, TARGET_RATE, AudioError, load_reference
from engine.loader import load_model
from engine.requests import SamplingParams, SpeechRequest, VoicePrompt
from engine.scheduler import VOCODER_BATCH, Overloaded, RequestHandle, Scheduler
from engine.testing.random_model import build as build_random_model

from .errors import ApiError
from .metrics import Metrics
from .params import default_sampling
from .voices import VoiceStore, valid_voice_id

log = logging.getLogger("qwen3_tts.server")

DEFAULT_VOICE_ID = "default"
# OpenAI's built-in voice names: clients send one (the field is required there); they mean "the default".
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                           "shimmer", "verse", "marin", "cedar"})
DEMO_MODEL_NAME = "qwen3-tts-demo-random-tiny"   # random weights: the audio is noise
# --demo's cap on a turn unless --max-frames says otherwise (20 s): random weights seldom sample the end
# of speech, and a turn would run to the model's limit (8,192 frames, 11 minutes of noise)
DEMO_MAX_FRAMES = 250
RETRY_AFTER_S = 1.0
WARMUP_TEXT = "Hello."
WARMUP_KV_KEYS = 1024      # CUDA graphs captured at start for turns up to this many cache positions


@dataclass
class Settings:
    """Server settings (flags and environment, see app.main). Limits are per request / session."""
    model_dir: str = "models/0.6b-base"
    host: str = "127.0.0.1"
    port: int = 8090
    max_batch: Optional[int] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    voices_dir: str = "voices"
    demo: bool = False
    api_key: Optional[str] = None
    max_text_chars: int = 4096
    max_ref_seconds: float = 30.0
    max_ref_bytes: int = 16 * 1024 * 1024       # decoded reference file
    max_body_bytes: int = 24 * 1024 * 1024      # REST body / WebSocket message (base64 reference inside)
    max_frames: Optional[int] = None            # cap on a turn's frames (None: the model's limit)
    idle_timeout_s: float = 60.0
    send_buffer_bytes: int = 4 * 1024 * 1024    # audio queued for one WebSocket before it counts as too slow
    max_sessions: int = 1024
    max_queue: int = 1024
    drain_timeout: float = 30.0                 # on SIGTERM, seconds open turns may take to finish
    vocoder_batch: int = VOCODER_BATCH          # streams a vocoder graph replay decodes (memory grows with it)
    slow_iteration_ms: float = 250.0            # an engine iteration this long is logged with its phases
    warmup: bool = True


def pick_device(name: Optional[str]) -> str:
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(name: Optional[str], device: str) -> torch.dtype:
    if name is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


KV_CACHE_SHARE = 0.7     # of the GPU memory free before warm-up, at most for the talker cache's pages
SLOT_POSITIONS = 2048    # a long turn, to size the slots by


def kv_bytes_per_position(model) -> int:
    t = model.config.talker.transformer
    return t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * torch.finfo(model.dtype).bits // 8


def size_engine(model, max_batch: Optional[int]) -> tuple[int, Optional[int]]:
    """(max_batch, max_cache_bytes) for the scheduler. 16 slots on the CPU. On a GPU, as many slots (at
    most 256) as turns of SLOT_POSITIONS fit in KV_CACHE_SHARE of the free memory, with half as much
    again for their vocoder state and activations (the CUDA graphs of the larger batches hold those);
    the cache's pages may take up to that share, but are taken only as turns need them."""
    if model.device.type != "cuda":
        return max_batch or 16, None
    free, _ = torch.cuda.mem_get_info(model.device)
    budget = free * KV_CACHE_SHARE
    per_slot = SLOT_POSITIONS * kv_bytes_per_position(model) * 1.5
    return max_batch or max(1, min(256, int(budget // per_slot))), int(budget)


class Service:
    def __init__(self, settings: Settings, metrics: Metrics, scheduler: Optional[Scheduler] = None,
                 on_fatal: Optional[Callable[[], None]] = None):
        self.settings = settings
        self.metrics = metrics
        self.scheduler = scheduler
        self.model = scheduler.model if scheduler is not None else None
        self.owns_scheduler = scheduler is None
        self.on_fatal = on_fatal
        self.started_at = time.time()
        self.status = "loading"            # loading -> ok -> draining, or error
        self.error: Optional[str] = None
        self.model_name = DEMO_MODEL_NAME if settings.demo else str(settings.model_dir).rstrip("/").split("/")[-1]
        self.voices: Optional[VoiceStore] = None
        self.builtin_voice: Optional[VoicePrompt] = None
        self.sampling_defaults = SamplingParams()
        self.active = {"ws": 0, "rest": 0}
        self.draining = asyncio.Event()    # SIGTERM: no new sessions or turns; open turns finish
        self.closing = asyncio.Event()     # set when the server stops: sessions end themselves
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._voice_lock: Optional[asyncio.Lock] = None
        self._demo_dir: Optional[tempfile.TemporaryDirectory] = None
        metrics.watch(lambda: self.scheduler.stats().queued if self.scheduler else 0, self._gpu_memory)

    # -- life cycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            if self.scheduler is None:
                self.scheduler = await asyncio.to_thread(self._build)
            self.model = self.scheduler.model
            self.sampling_defaults = default_sampling(self.model.config.generation)
            self.voices = VoiceStore(self.settings.voices_dir, int(self.model.config.talker.transformer.hidden_size))
            await asyncio.to_thread(self.voices.load)
            wav, sr = sf.read(str(BUILTIN_VOICE_WAV), dtype="float32")
            self.builtin_voice = await asyncio.to_thread(self.model.make_voice, wav, sr)
            if self.settings.warmup:
                await self._warm_up()
            # What loading made (~200k objects: modules, imports) lives as long as the server: out of
            # the collector's sight, a full collection stops holding the GIL for ~90 ms (engine and
            # event loop both), and then only walks what sessions make.
            gc.collect()
            gc.freeze()
            self.status = "draining" if self.draining.is_set() else "ok"    # SIGTERM while loading
            log.info("ready: %s on %s (%s), max_batch %d", self.model_name, self.model.device, self.model.dtype,
                     self.scheduler.max_batch)
        except Exception as e:
            log.exception("could not start the model")
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            if self.on_fatal is not None:
                self.on_fatal()

    def _build(self) -> Scheduler:
        s = self.settings
        device = pick_device(s.device)
        dtype = pick_dtype(s.dtype, device)
        model_dir = self._demo_model() if s.demo else s.model_dir
        log.info("loading %s on %s (%s)", model_dir, device, dtype)
        model = load_model(model_dir, device, dtype)
        max_batch, max_cache_bytes = size_engine(model, s.max_batch)
        scheduler = Scheduler(model, max_batch, max_cache_bytes=max_cache_bytes, max_queue=s.max_queue,
                              vocoder_batch=s.vocoder_batch, slow_iteration_s=s.slow_iteration_ms / 1000)
        if s.warmup:     # CUDA graphs are captured before the engine thread exists: nothing runs beside a capture
            t0 = time.monotonic()
            n = scheduler.warmup(WARMUP_KV_KEYS)
            if n:
                log.info("captured %d CUDA graphs in %.1f s", n, time.monotonic() - t0)
        return scheduler.start()

    def _demo_model(self) -> Path:
        """--demo: the tiny preset with random weights (seed 0), written to a temporary folder."""
        self._demo_dir = tempfile.TemporaryDirectory(prefix="qwen3-tts-demo-")
        return build_random_model("tiny", 0, Path(self._demo_dir.name) / "tiny")

    async def _warm_up(self) -> None:
        """One short greedy turn through the whole path (prefill, decode, vocoder; on a GPU through the
        CUDA graphs `_build` captured before starting the engine thread), so no session pays a first run."""
        request = SpeechRequest(WARMUP_TEXT, self.builtin_voice, sampling=SamplingParams(greedy=True), max_frames=4,
                                request_id="warmup")
        result = None
        async for item in self.scheduler.submit(request):
            result = item
        if result.reason == "error":
            raise RuntimeError(f"warm-up turn failed: {result.error}")

    def begin_drain(self) -> None:
        """SIGTERM (called from the signal handler): /ready 503, new sessions and turns refused, turns
        in progress go on; a session closes (1001) once its turns are done."""
        if self.loop is None:
            self._drain()
        else:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.status = "draining" if self.status == "ok" else self.status
        self.draining.set()

    def end_sessions(self) -> None:
        """The drain deadline: every open session is closed now (fatal.shutting_down, 1001)."""
        self._drain()
        self.closing.set()

    def open_sessions(self) -> int:
        return self.active["ws"] + self.active["rest"]

    async def stop(self) -> None:
        self.end_sessions()
        if self.scheduler is not None and self.owns_scheduler:
            await asyncio.to_thread(self.scheduler.stop, 10.0)
        if self._demo_dir is not None:
            self._demo_dir.cleanup()

    # -- used by the routes ------------------------------------------------------------------------

    def require_ready(self) -> None:
        if self.status == "ok":
            return
        if self.status == "loading":
            raise ApiError(503, "loading", "the model is still loading", retry_after=5)
        if self.status == "draining":
            raise ApiError(503, "shutting_down", "the server is shutting down", retry_after=RETRY_AFTER_S)
        raise ApiError(503, "not_ready", f"the model failed to load: {self.error}")

    def default_voice(self) -> VoicePrompt:
        return self.voices.get(DEFAULT_VOICE_ID) or self.builtin_voice

    def voice(self, voice) -> VoicePrompt:
        """A voice by id (or OpenAI's {"id": ...}); None, "default" and OpenAI's names: the default."""
        if isinstance(voice, dict):
            voice = voice.get("id")
        if voice is None or voice == "" or voice == DEFAULT_VOICE_ID:
            return self.default_voice()
        if not isinstance(voice, str):
            raise ApiError(400, "invalid_request", "voice must be a voice id string")
        found = self.voices.get(voice) if valid_voice_id(voice) else None
        if found is not None:
            return found
        if voice.lower() in OPENAI_VOICES:
            return self.default_voice()
        raise ApiError(404, "voice_not_found", f"no voice {voice!r}; register one with POST /v1/voices")

    async def clone(self, audio: bytes, ref_text: Optional[str], x_vector_only: bool) -> tuple[VoicePrompt, float]:
        """A voice from a reference file: (prompt, duration in seconds). 413 too big/long, 422 bad audio."""
        s = self.settings
        if len(audio) > s.max_ref_bytes:
            raise ApiError(413, "audio_too_large", f"reference audio is {len(audio)} bytes; the limit is {s.max_ref_bytes}")
        try:
            info = sf.info(io.BytesIO(audio))
        except Exception:
            info = None    # load_reference below says what is wrong with it
        if info is not None and 0 < info.frames < 2**62 and info.duration > s.max_ref_seconds:
            raise ApiError(413, "audio_too_long", f"reference audio is {info.duration:.1f} s; the limit is "
                                                  f"{s.max_ref_seconds:g} s")
        if ref_text is not None and not ref_text.strip():
            raise ApiError(400, "invalid_request", "ref_text is empty: give the transcript of the reference audio, "
                                                   "or leave it out for an x-vector voice")
        try:
            wav = load_reference(audio, max_seconds=s.max_ref_seconds)
        except AudioError as e:
            raise ApiError(422, "invalid_audio", str(e)) from None
        if self._voice_lock is None:
            self._voice_lock = asyncio.Lock()
        async with self._voice_lock:   # one at a time: a burst of uploads cannot pile up on the device
            try:
                prompt = await asyncio.to_thread(self.model.make_voice, wav, TARGET_RATE, ref_text, x_vector_only)
            except ValueError as e:
                raise ApiError(400, "invalid_request", str(e)) from None
        if not torch.isfinite(prompt.xvector).all():    # e.g. float samples of 1e30: no usable voice
            raise ApiError(422, "invalid_audio", "the reference audio gives no usable voice (are its samples "
                                                 "within [-1, 1]?)")
        return prompt, wav.shape[0] / TARGET_RATE

    def max_frames(self, requested: Optional[int]) -> Optional[int]:
        cap = self.settings.max_frames
        if requested is None:
            return cap
        return requested if cap is None else min(requested, cap)

    def submit(self, request: SpeechRequest) -> RequestHandle:
        try:
            return self.scheduler.submit(request)
        except Overloaded:
            raise ApiError(503, "overloaded", "the server is at capacity; retry shortly", retry_after=RETRY_AFTER_S) from None
        except ValueError as e:
            raise ApiError(400, "invalid_request", str(e)) from None
        except RuntimeError:
            raise ApiError(503, "shutting_down", "the server is shutting down", retry_after=RETRY_AFTER_S) from None

    def health(self) -> dict:
        stats = self.scheduler.stats() if self.scheduler is not None else None
        out = {"status": self.status, "active_sessions": self.active["ws"] + self.active["rest"],
               "queue_depth": stats.queued if stats else 0,
               "max_batch": stats.max_batch if stats else self.settings.max_batch,
               "model": self.model_name, "demo": self.settings.demo}
        if self.settings.demo:
            out["notice"] = "demo mode: random-weight tiny model, the audio is noise"
        if stats is not None:
            out.update(batch_active=stats.active, device=str(self.model.device), dtype=str(self.model.dtype).split(".")[-1])
        if self.error:
            out["error"] = self.error
        return out

    def _gpu_memory(self, kind: str) -> float:
        if kind == "kv_cache":
            return float(self.scheduler.stats().kv_cache_bytes) if self.scheduler is not None else 0.0
        if not torch.cuda.is_available():
            return 0.0
        return float(torch.cuda.memory_allocated() if kind == "allocated" else torch.cuda.memory_reserved())
