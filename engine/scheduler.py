"""The frame-synchronous scheduler: every live session advances by one 80 ms frame per batched step.

One engine thread owns the device. Other threads (the asyncio server, the CLI, tests) hand it
commands through a thread-safe queue: `submit` a `SpeechRequest`, then on the returned
`RequestHandle` `push_text` / `finish_text` (incremental text) and `cancel`. Audio comes back on the
handle as `AudioChunk`s, as soon as each vocoder window is decoded, then one final `TurnResult`:
`async for item in handle` on an event loop (woken with `loop.call_soon_threadsafe`, once per burst
of audio for all its sessions, so the loop never blocks), or `handle.collect()` from plain threads.

Each iteration of the engine loop:
  1. apply commands (new sessions, text, cancels: a cancelled session's slot is free before the step);
  2. admit sessions that have enough text for their prompt into free slots (the lowest first, since
     the decode batch spans slots 0..n-1), in a batch;
  3. prefill: one talker forward over the prompts being admitted, at most `prefill_chunk` positions per
     row and `prefill_budget` in all, so a long prompt delays the other sessions' frame by a bounded
     amount (it finishes over several iterations);
  4. launch one decode step (`ModelRunner.step`) for every slot that has its next text: the model
     eats one text token per frame, so a session whose text has not arrived yet sits the step out
     with its state intact, and one past its text feeds tts_eos then tts_pad;
  5. while the GPU runs it, read back what the previous iteration launched: send the audio of its
     vocoder windows (and the results of the sessions whose last audio that was), and take its
     step's frames and ends (EOS, frame limit); with `defer_audio` (opt-in, not yet measured) the
     audio goes out once it has landed instead, waited for only where it must be;
  6. launch the streaming vocoder, batched, on the windows that are due (`engine.streaming`: they
     grow while the listener holds enough audio, judged from the recent time per step), and on
     the last frames of the sessions that ended, which hold their slots until that audio is sent;
     on a GPU they run on a stream of their own, beside the next step, each once the step that
     made its frames is done.

The host thus works one step behind the GPU, which always has the next step queued: the host's work
per frame (admissions, bookkeeping, sending audio) is hidden behind the device's, where it used to
leave the GPU idle. It is hidden only while nothing else in the iteration waits for the GPU (a
`.cpu()`, or `t[idx] = 0` on a device tensor, which uploads the scalar from pageable memory): with
such waits at each admission a steady load ran at half a burst's rate (bench/README, eighteenth
session; `bench.gpu_checks`' `scheduler_does_not_wait_for_the_gpu` looks for them). A row that ended
in the step being read back was already launched again in the next one; the device keeps it finished
(`ModelRunner`), and its frame there is dropped. A window's audio thus reaches its listener one step
after its last frame is made, except a session's first: when the step in flight closes a first
window, the iteration reads it back before launching the next step (5, 6, then 4), so time to first
audio does not wait for one more step. On the CPU (`overlap` off) a launch is the work itself: each
iteration reads its own step back at once and sends its windows' audio in the same iteration.

Sampling is batch-invariant (`engine.sampling`): a request with a seed gives the same codes alone or
in any batch, at any arrival frame. The talker KV cache is paged (`engine.kv_cache`): admission
reserves a session's estimated length (its prompt plus `frames_per_token` per text token) and waits
while the device has no room for it; a turn that runs longer takes more pages as it goes; a session's
pages go back when it ends, and free pages beyond a small spare are handed back to the device, so
GPU memory follows the load.

Device out-of-memory never fails a request: a prefill is split across rows, then into shorter
chunks; the vocoder splits across streams, then in time; a decode step is retried after the allocator
cache is released; admissions wait a few iterations after any out-of-memory error.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from .host import to_device
from .prompt import PromptBuilder, resolve_language
from .requests import AudioChunk, SpeechRequest, TurnResult
from .kv_cache import CacheFull
from .model import kernels
from .runner import EOS, RUNNING, LaunchedStep, ModelRunner
from .streaming import StreamingVocoder, WindowPolicy, release_cached_memory

log = logging.getLogger(__name__)

# what a slot is doing; DRAINING: its session's generation ended, its last window is being decoded
# (the slot goes to another session once that audio is out: see `_launch_windows`)
FREE, PREFILL, DECODE, DRAINING = 0, 1, 2, 3
STEP_TIME_SMOOTHING = 0.3           # weight of the newest step in the step-time average (vocoder windows)
SPARE_PAGES = 16                    # free KV pages kept for the next admissions beyond half the pages in use
VOCODER_BATCH = 32                  # streams a vocoder graph replay decodes (H100, 256 streams: as fast as 64, 0.6 GiB less held)


def _profiled(phase: str):
    """A profiler range `engine.<phase>` around a phase of the iteration while a torch profiler runs on
    this thread (`bench.steady_timeline` sums the GPU time of the kernels each phase launched by it);
    else nothing: a range costs microseconds even when no profiler records it."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function("engine." + phase)
    return contextlib.nullcontext()


class Overloaded(RuntimeError):
    """The admission queue is full: retry later (the server answers 503 + Retry-After)."""


@dataclass(frozen=True)
class SchedulerStats:
    active: int              # sessions holding a slot (prefilling, decoding, or their last audio on its way)
    queued: int              # submitted sessions waiting for a slot or for the text their prompt needs
    max_batch: int
    steps: int               # decode steps run
    last_step_ms: float      # wall time of the last engine iteration that ran a decode step
    last_batch_size: int     # rows that advanced in the last decode step
    frames_generated: int    # codec frames generated since start
    waiting_for_text: int    # decoding sessions that sat out the last step for lack of text
    text_waits: int          # row-steps sat out for lack of text since start
    capacity: int            # talker cache positions per slot (at most)
    kv_cache_bytes: int      # device memory the talker cache holds now (pages in use and spare)
    oom_recoveries: int      # device out-of-memory errors recovered from
    host_seconds: dict       # the engine thread's seconds in each phase of its iterations since start
                             # (on a GPU "read-back" and "audio out" mostly wait for it; the others are host work)


Item = Union[AudioChunk, TurnResult]


class _LoopWaker:
    """Wakes the readers of one asyncio loop: the first chunk of a burst schedules one callback on
    the loop, which sets the events of every outbox filled meanwhile (a step's audio for 256
    sessions costs one wake-up of the loop, not 256: each is a write to its self-pipe)."""

    _wakers: dict = {}
    _wakers_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._events: list[asyncio.Event] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_LoopWaker":
        with cls._wakers_lock:
            for dead in [l for l in cls._wakers if l.is_closed()]:
                del cls._wakers[dead]
            return cls._wakers.setdefault(loop, cls(loop))

    def wake(self, event: asyncio.Event) -> None:
        with self._lock:
            self._events.append(event)
            if len(self._events) > 1:
                return           # a callback is already on its way
        try:
            self.loop.call_soon_threadsafe(self._set_all)
        except RuntimeError:     # the loop is closed: nobody is listening any more
            with self._lock:
                self._events.clear()

    def _set_all(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            event.set()


class _Outbox:
    """Items from the engine thread to one consumer, read blocking or from an asyncio loop."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waker: Optional[_LoopWaker] = None
        self._event: Optional[asyncio.Event] = None

    def put(self, item: Item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waker, event = self._waker, self._event
        if waker is not None:
            waker.wake(event)

    def get(self, timeout: Optional[float] = None) -> Item:
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError("no audio from the scheduler in time")
            return self._items.popleft()

    async def aget(self) -> Item:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._waker is None or self._waker.loop is not loop:
                self._waker, self._event = _LoopWaker.of(loop), asyncio.Event()
            event = self._event
        while True:
            event.clear()
            with self._cond:
                if self._items:
                    return self._items.popleft()
            await event.wait()


@dataclass(eq=False)
class _Session:
    """The engine thread's record of one request (only the engine thread touches it after submit)."""
    request: SpeechRequest
    max_frames: int
    outbox: _Outbox
    submitted: float
    ids: list = field(default_factory=list)   # target text ids received and not yet in a slot
    text_done: bool = False
    slot: Optional[int] = None
    prompt: Optional[torch.Tensor] = None     # [P, D] while prefilling
    trail_ids: list = field(default_factory=list)  # the prompt's trailing text ids, at admission
    prefilled: int = 0
    frames: int = 0                           # set when the session leaves its slot
    samples: int = 0
    reason: Optional[str] = None              # set when generation ended
    queue_ms: float = 0.0
    ttfa_ms: float = 0.0
    codes: list = field(default_factory=list)  # [16] host rows, when the scheduler keeps codes
    closed: bool = False


@dataclass(eq=False)
class _Launched:
    """Device work one iteration launched, which the next one reads back."""
    step: Optional[LaunchedStep] = None
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))   # slots active in it
    frames_added: Optional["torch.cuda.Event"] = None   # its frames are in the vocoder's rings (`add`)
    sessions: list = field(default_factory=list)    # the session of each of `rows` at launch
    windows: list = field(default_factory=list)     # (sessions, WindowAudio) per window decode
    ending: list = field(default_factory=list)      # sessions whose last audio is in `windows`
    iteration: int = 0                              # the engine iteration that launched it

    def audio_ready(self) -> bool:
        """Whether every window's audio has reached the host (`WindowAudio.ready`)."""
        return all(audio.ready() for _, audio in self.windows)


class RequestHandle:
    """A submitted request: feed it text, cancel it, read its audio. Every method is thread-safe."""

    def __init__(self, scheduler: "Scheduler", session: _Session, request_id: str, tokenizer):
        self.id = request_id
        self._scheduler = scheduler
        self._session = session
        self._tokenizer = tokenizer       # this request's incremental tokenizer
        self._lock = threading.Lock()
        self._text_done = False
        self._read_final = False

    def push_text(self, text: str) -> None:
        """Append text to the turn; the model starts speaking before the text is complete."""
        with self._lock:
            if self._text_done:
                raise RuntimeError(f"request {self.id}: text is already complete")
            ids = self._tokenizer.push(text)
            self._scheduler._send(("text", self._session, ids, False))

    def finish_text(self) -> None:
        """No more text for this turn (idempotent)."""
        with self._lock:
            if self._text_done:
                return
            self._text_done = True
            self._scheduler._send(("text", self._session, self._tokenizer.finish(), True))

    def cancel(self) -> None:
        """Stop generating within one step and free the slot; the final result says "cancelled"."""
        self._scheduler._send(("cancel", self._session))

    def get(self, timeout: Optional[float] = None) -> Item:
        """The next AudioChunk, or the TurnResult (last), blocking up to `timeout` seconds."""
        if self._read_final:
            raise RuntimeError(f"request {self.id}: its result was already read")
        item = self._session.outbox.get(timeout)
        self._read_final = isinstance(item, TurnResult)
        return item

    def collect(self, timeout: Optional[float] = None) -> tuple[list[AudioChunk], TurnResult]:
        """Every chunk and the result, blocking until the turn ends (TimeoutError after `timeout` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = []
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self.get(left)
            if isinstance(item, TurnResult):
                return chunks, item
            chunks.append(item)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> Item:
        if self._read_final:
            raise StopAsyncIteration
        item = await self._session.outbox.aget()
        self._read_final = isinstance(item, TurnResult)
        return item


class Scheduler:
    # With overlap: send the last iteration's audio after launching this one's windows, not before
    # reading the step back. The vocoder's stream then has its next windows queued while the host waits
    # for the last ones' audio, and the read-back and the windows' launch no longer follow that wait on
    # the way to the next step's launch; a window's audio goes out that much later (1-2 ms on an H100).
    # Off until a steady load measures it (`bench.sustained_variants`' `audio-after-windows`).
    audio_after_windows = False
    # With overlap, defer_audio > 0: send each window's audio once the device has made it, looked for
    # each iteration, instead of waiting each iteration for all the last one's; the host then waits
    # for the steps it reads back, and the vocoder's work fills the GPU around them. Still waited for:
    # a session's first audio, audio a listener is about to run short of (`_urgent`), audio
    # `defer_audio` iterations late (more would let the vocoder's stream build a backlog that a new
    # session's first window waits behind), windows whose codes the rings need back (`StreamingVocoder.
    # ring_iterations`), and all of it when no step runs. 0 (as shipped) until measured
    # (QWEN3_TTS_DEFER_AUDIO=N; `bench.sustained_variants`' `deferred-audio-N`).
    defer_audio = int(os.environ.get("QWEN3_TTS_DEFER_AUDIO", "0"))

    def __init__(self, model, max_batch: int, *, window_frames: tuple[int, int] = (2, 8),
                 max_capacity: Optional[int] = None, max_cache_bytes: Optional[int] = None,
                 kv_page_size: int = 64, max_queue: int = 1024,
                 prefill_chunk: int = 256, prefill_budget: int = 4096, frames_per_token: float = 6.0,
                 frame_margin: int = 32, keep_codes: bool = False, oom_retries: int = 2,
                 oom_defer_iterations: int = 4, cuda_graphs: bool = True, vocoder_batch: int = VOCODER_BATCH,
                 slow_iteration_s: float = 0.25, overlap: Optional[bool] = None):
        """model: `engine.loader.TTSModel`. max_batch: slots (sessions decoding at once).

        window_frames: vocoder frames for a session's first audio chunk, then for each later one.
        max_capacity: talker cache positions per slot (default: the longest turn the model allows,
        max_new_tokens + prefill_chunk); it costs no memory until a session's turn reaches it.
        max_cache_bytes: most device memory for the talker cache's pages (default: what the device
        gives); admissions wait while a turn's estimate does not fit. kv_page_size: positions a page.
        max_queue: sessions waiting for a slot (submitted, not yet admitted, beyond the free slots)
        before `submit` raises `Overloaded`.
        prefill_chunk / prefill_budget: prompt positions per row / in all, per iteration (4096: a burst
        of 256 x-vector prompts in one eager forward, ~40 ms on an H200, where 1024 took four).
        frames_per_token, frame_margin: the frame estimate of a turn, to size the cache at admission.
        keep_codes: put each turn's codes [frames, 16] in its TurnResult (tests, CLI).
        cuda_graphs: on a CUDA device, replay the decode step from CUDA graphs (`engine.graphs`).
        vocoder_batch: most streams one vocoder graph replay decodes (its memory grows with it).
        slow_iteration_s: an engine iteration this long is logged with where its time went.
        overlap: read each step back while the next one runs (default: on a CUDA device, where
        launches do not wait for the work; on the CPU they do, and reading back at once sends the
        audio a step sooner).
        """
        if vocoder_batch < 1:
            raise ValueError(f"vocoder_batch must be >= 1, got {vocoder_batch}")
        cfg = model.config
        self.model = model
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.default_max_frames = cfg.generation.max_new_tokens - 1
        self.max_capacity = max_capacity or cfg.generation.max_new_tokens + prefill_chunk
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        self.frames_per_token, self.frame_margin = frames_per_token, frame_margin
        self.keep_codes = keep_codes
        self.slow_iteration_s = slow_iteration_s
        self.oom_retries, self.oom_defer_iterations = oom_retries, oom_defer_iterations
        self.device = model.device
        self.overlap = torch.device(self.device).type == "cuda" if overlap is None else overlap
        self.prompts: PromptBuilder = model.prompts
        self.runner = ModelRunner(model, max_batch, self.max_capacity, page_size=kv_page_size)
        if max_cache_bytes is not None:
            self.runner.cache.max_pages = max(1, max_cache_bytes // self.runner.cache.page_bytes)
        pool = None
        if cuda_graphs and torch.device(self.device).type == "cuda":
            pool = torch.cuda.graph_pool_handle()     # step and prefill graphs (and the vocoder's on this stream): one pool
            self.runner.use_cuda_graphs(pool=pool)
        self.vocoder = StreamingVocoder(model.vocoder, max_batch, WindowPolicy(*window_frames),
                                        cfg.samples_per_frame / cfg.sample_rate, cfg.talker.num_code_groups,
                                        self._out_of_memory)
        if pool is not None:
            self.vocoder.use_cuda_graphs(pool, vocoder_batch)
        self.samples_per_frame = cfg.samples_per_frame
        self._pad_id, self._eos_id = cfg.tts_pad_token_id, cfg.tts_eos_token_id

        # Per-slot host state, indexed by slot (vectorized per step).
        self._phase = np.zeros(max_batch, dtype=np.int8)
        self._trail = np.zeros((max_batch, 64), dtype=np.int64)   # text ids each decode step consumes
        self._trail_len = np.zeros(max_batch, dtype=np.int64)
        self._trail_pos = np.zeros(max_batch, dtype=np.int64)
        self._text_done = np.zeros(max_batch, dtype=bool)
        self._frames = np.zeros(max_batch, dtype=np.int64)         # frames the slot's session made
        self._by_slot: list[Optional[_Session]] = [None] * max_batch
        self._free = list(range(max_batch))     # kept sorted: the lowest slot is taken first

        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[_Session] = []
        self._queued = 0                        # sessions submitted and not yet admitted or ended
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._defer_admissions = 0
        self._launched = _Launched()            # what the last iteration left running on the device
        self._unsent: collections.deque[_Launched] = collections.deque()   # launched work whose audio is not out
        self._iterations = 0
        self._windows_at = np.full(max_batch, -1, dtype=np.int64)   # iteration of each slot's last window
        self._out_of_pages_ending: list[_Session] = []   # sessions the cache had no page for
        self._trimmed = False                   # cache pages went back to the allocator since it was emptied
        self._cache_full = False                # an admission found the cache's page budget spent
        self._steps = self._frames_total = self._ooms = self._text_waits = 0
        self._last_step_ms, self._last_batch, self._last_sat_out = 0.0, 0, 0
        self._host_s: collections.Counter = collections.Counter()
        self._step_s = cfg.samples_per_frame / cfg.sample_rate   # recent seconds per step (starts at real time)

    # -- public API (any thread) -------------------------------------------------------------------

    def start(self) -> "Scheduler":
        if self._thread is not None:
            raise RuntimeError("scheduler already started")
        self._thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the engine thread; sessions still running end with reason "error" ("scheduler stopped")."""
        with self._lock:       # a submit that saw the scheduler running is queued before "stop"
            self._stopped = True
            self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    def warmup(self, max_live: Optional[int] = None) -> int:
        """Capture the decode step's CUDA graphs for every batch bucket and the kv buckets up to
        `max_live` keys (default: all), the one-row prefills and the vocoder windows, before serving,
        so no session waits on a capture. Call before `start`. Returns the number of graphs (0 without
        CUDA graphs). The vocoder's go first: where they share the steps' pool they need the most of
        it, and the others then fit in it."""
        if self.runner.graphs is None:
            return 0
        with torch.no_grad():
            n = self.vocoder.capture()
            return n + self.runner.graphs.capture(max_live) + self.runner.prefill_graphs.capture()

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, request: SpeechRequest) -> RequestHandle:
        """Queue a request (non-blocking). Raises ValueError for a bad request, `Overloaded` when the
        queue is full, RuntimeError once stopped."""
        resolve_language(request.language, self.model.config)
        request.sampling.validate()
        if request.max_frames is not None and request.max_frames < 0:
            raise ValueError(f"max_frames must be >= 0, got {request.max_frames}")
        voice = request.voice
        if voice.icl and not voice.ref_text_ids:
            raise ValueError("an ICL voice needs the reference text ids")
        tokenizer = self.model.tokenizer.incremental()
        ids = tokenizer.push(request.text)
        if request.text_complete:
            ids += tokenizer.finish()
            if not ids:
                raise ValueError("empty text: nothing to speak")
        session = _Session(request, self.default_max_frames if request.max_frames is None else request.max_frames,
                           _Outbox(), time.monotonic(), ids=ids, text_done=request.text_complete)
        handle = RequestHandle(self, session, request.request_id or uuid.uuid4().hex, tokenizer)
        if request.text_complete:
            handle._text_done = True
        with self._lock:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            # submitted and not yet admitted, beyond the free slots they are about to take
            if self._queued - len(self._free) >= self.max_queue:
                raise Overloaded(f"{self._queued} requests are already waiting")
            self._queued += 1
            self._send(("submit", session))
        return handle

    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(
                active=int((self._phase != FREE).sum()), queued=self._queued, max_batch=self.max_batch,
                steps=self._steps, last_step_ms=self._last_step_ms, last_batch_size=self._last_batch,
                frames_generated=self._frames_total, waiting_for_text=self._last_sat_out,
                text_waits=self._text_waits,
                capacity=self.runner.capacity, kv_cache_bytes=self.runner.cache.bytes_held(),
                oom_recoveries=self._ooms, host_seconds=dict(self._host_s))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)

    # -- engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while self._apply_commands(block=not self._has_work()):
                try:
                    self._iterate()
                except Exception as e:   # a bug: fail the sessions in flight, keep serving the others
                    log.exception("engine iteration failed")
                    for s in self._sessions_in_flight():
                        self._close(s, "error", f"engine error: {type(e).__name__}: {e}")
                    self._launched, self._out_of_pages_ending = _Launched(), []
                    self._unsent.clear()
        finally:
            while True:        # requests submitted before stop() but not yet seen
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "submit":
                    self._waiting.append(command[1])
            for s in [*self._waiting, *self._sessions_in_flight()]:
                self._close(s, "error", "scheduler stopped")

    def _sessions_in_flight(self) -> list[_Session]:
        """Sessions holding a slot, and those whose last audio is still on its way (each once: a
        draining session is both)."""
        return list(dict.fromkeys([*(s for s in self._by_slot if s is not None),
                                   *(s for launched in self._unsent for s in launched.ending)]))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, *args = command
            if kind == "stop":
                return False
            getattr(self, "_on_" + kind)(*args)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _on_submit(self, s: _Session) -> None:
        self._waiting.append(s)

    def _on_text(self, s: _Session, ids: list[int], done: bool) -> None:
        if s.closed:
            return
        if s.slot is None:
            s.ids += ids
            s.text_done = done
            return
        if done:
            ids = [*ids, self._eos_id]
        self._append_trail(s.slot, ids)
        self._text_done[s.slot] = done

    def _on_cancel(self, s: _Session) -> None:
        if not s.closed:
            self._close(s, "cancelled")

    def _has_work(self) -> bool:
        if self._launched.step is not None or self._unsent or (self._phase == PREFILL).any():
            return True
        decode = self._phase == DECODE
        if (decode & ((self._trail_pos < self._trail_len) | self._text_done)).any():
            return True
        return bool(self._free) and not self._cache_full and any(self._ready(s) for s in self._waiting)

    def _iterate(self) -> None:
        t0 = time.perf_counter()
        waiting, compiles, steps = len(self._waiting), kernels.launch.compiles, self._steps
        ms: dict[str, float] = {}

        def phase(name, fn, *args):
            t = time.perf_counter()
            with _profiled(name):
                out = fn(*args)
            ms[name] = ms.get(name, 0.0) + (time.perf_counter() - t) * 1000
            return out

        if self._defer_admissions > 0:
            self._defer_admissions -= 1
            if not (self._phase != FREE).any():
                time.sleep(0.01)    # nothing else to do while admissions wait out an out-of-memory error
        else:
            phase("admission", self._admit)
        prefilling = int((self._phase == PREFILL).sum())
        phase("prefill", self._prefill)
        self._iterations += 1
        previous, launched = self._launched, _Launched(iteration=self._iterations)
        if not self.overlap:             # launches run as they are made: each result is there at once
            phase("step launch", self._launch_step, launched)
            ended = phase("read-back", self._take_step, launched)
            phase("vocoder launch", self._launch_windows, ended, launched, launched.frames_added)
            phase("audio out", self._send_audio, launched)
            launched = _Launched()
        else:
            def take_previous(stepping):   # earlier windows' audio out, the step in flight read back, its windows launched
                if not self.audio_after_windows:
                    phase("audio out", self._send_unsent, stepping)
                ended = phase("read-back", self._take_step, previous)
                phase("vocoder launch", self._launch_windows, ended, launched, previous.frames_added)
                phase("audio out", self._send_unsent, stepping)      # (with defer_audio: what landed since)
            if self.vocoder.first_window_closes(previous.rows):
                # a session's first audio is due with the step in flight: read it back first, so that
                # window goes to the GPU ahead of the next step (time to first audio, not one step more)
                take_previous(stepping=True)
                phase("step launch", self._launch_step, launched)
            else:
                phase("step launch", self._launch_step, launched)
                take_previous(stepping=launched.step is not None)
            if launched.windows or launched.ending:
                self._unsent.append(launched)
        self._launched = launched
        self._trim_cache()
        dt = time.perf_counter() - t0
        if dt > self.slow_iteration_s:     # every session waits this long for its next frame: say where it went
            log.warning("slow engine iteration: %.0f ms (%s; %d admitted, %d prefilling, %d decoding;"
                        " %d Triton kernels compiled)", dt * 1000,
                        ", ".join(f"{name} {t:.0f}" for name, t in ms.items()) + " ms",
                        waiting - len(self._waiting), prefilling, int((self._phase == DECODE).sum()),
                        kernels.launch.compiles - compiles)
        if self._steps != steps:
            self._step_s += STEP_TIME_SMOOTHING * (dt - self._step_s)
        with self._lock:
            self._host_s.update({name: t / 1000 for name, t in ms.items()})
            if self._steps != steps:
                self._last_step_ms = dt * 1000

    # -- admission and prefill ---------------------------------------------------------------------

    def _ready(self, s: _Session) -> bool:
        """Whether the session has the text its prompt needs."""
        if s.text_done:
            return True
        needed = self.prompts.tokens_needed(s.request.voice, s.request.non_streaming_text)
        return needed is not None and len(s.ids) >= needed

    def _admit(self) -> None:
        if self._cache_full:            # the cache's page budget is spent: wait for a session to end
            return
        candidates = []
        for s in list(self._waiting):
            if len(candidates) == len(self._free):
                break
            if not self._ready(s):
                continue
            if s.text_done and not s.ids:
                self._close(s, "error", "empty text: nothing to speak")
                continue
            candidates.append(s)
        if not candidates:
            return
        prompts = self.prompts.build_many([(s.ids, s.request.voice, s.request.language, s.request.non_streaming_text,
                                            s.text_done) for s in candidates])
        planned = []             # (session, prompt embeds, trailing rows, cache positions to reserve)
        for s, prompt in zip(candidates, prompts):
            if isinstance(prompt, ValueError):
                self._close(s, "error", str(prompt))
                continue
            p = prompt.embeds.shape[0]
            if p >= self.max_capacity:
                self._close(s, "error", f"prompt of {p} positions exceeds the cache ({self.max_capacity})")
                continue
            estimate = p + min(s.max_frames, self.frames_per_token * max(len(s.ids), 1) + self.frame_margin)
            planned.append((s, prompt.embeds, prompt.trailing.shape[0], int(estimate) + 1))
        del prompts              # the trailing rows' embeddings: decode steps embed their ids as they go
        fit = self._reserve(self._free[:len(planned)], [n for *_, n in planned])   # the lowest free slots
        if fit == 0 and planned and self._cache_full and not (self._phase != FREE).any():
            s, *_, n = planned[0]                # no room and none will come back: it never fits
            self._close(s, "error", f"the turn does not fit in the KV cache ({n - 1} positions)")
            self._cache_full = False
        admitted = []
        for s, embeds, n_trailing, _ in planned[:fit]:
            s.prompt, s.trail_ids = embeds, self._trailing_ids(s, n_trailing)
            admitted.append(s)
        if not admitted:
            return
        slots = [self._free.pop(0) for _ in admitted]
        for s, slot in zip(admitted, slots):
            self._waiting.remove(s)
            s.slot, s.ids = slot, []
            self._by_slot[slot] = s
            self._phase[slot] = PREFILL
            self._trail_len[slot] = self._trail_pos[slot] = self._frames[slot] = 0
            self._append_trail(slot, s.trail_ids)
            self._text_done[slot] = s.text_done
        with self._lock:
            self._queued -= len(admitted)
        self.runner.admit(slots, [s.request.sampling for s in admitted], [s.max_frames for s in admitted])
        # a cancelled session's last windows may still read a slot's ring: their audio (dropped) goes first
        last_window = self._windows_at[slots].max()
        self._send_oldest(sum(launched.iteration <= last_window for launched in self._unsent))
        self.vocoder.start(slots, [s.request.voice.ref_codes if s.request.voice.icl else None for s in admitted])

    def _reserve(self, slots: list[int], positions: list[int]) -> int:
        """Cache pages for positions[i] of slots[i], in order, in one reservation; returns how many
        slots, from the first, got all theirs. When the cache's page budget is spent (`_cache_full`,
        until a session ends) or the device is out of memory, the slot that came short and those after
        it give back what they got, and their sessions wait."""
        try:
            self.runner.reserve(slots, positions)
            return len(slots)
        except (CacheFull, torch.OutOfMemoryError) as e:
            short = np.flatnonzero(self.runner.cache.reserved(slots) < np.minimum(positions, self.runner.capacity))
            fit = int(short[0]) if short.size else len(slots)
            self.runner.release(slots[fit:])
            if isinstance(e, CacheFull):
                self._cache_full = True
            else:
                self._out_of_memory()
            return fit

    def _trailing_ids(self, s: _Session, n_trailing: int) -> list[int]:
        """Ids of the prompt's trailing text: the last n of (R if ICL) ++ T ++ (tts_eos if complete).

        Decode steps embed them one per frame, as they do with text that arrives later, so a turn
        whose text comes in pieces runs the same computation as one sent whole.
        """
        voice = s.request.voice
        ids = [*(voice.ref_text_ids if voice.icl else []), *s.ids, *([self._eos_id] if s.text_done else [])]
        return ids[len(ids) - n_trailing:] if n_trailing else []

    def _append_trail(self, slot: int, ids: list[int]) -> None:
        end = self._trail_len[slot] + len(ids)
        if end > self._trail.shape[1]:
            grown = np.zeros((self.max_batch, max(end, 2 * self._trail.shape[1])), dtype=np.int64)
            grown[:, :self._trail.shape[1]] = self._trail
            self._trail = grown
        self._trail[slot, self._trail_len[slot]:end] = ids
        self._trail_len[slot] = end

    def _prefill(self) -> None:
        budget, work = self.prefill_budget, []
        for slot in np.flatnonzero(self._phase == PREFILL):
            s = self._by_slot[slot]
            take = min(self.prefill_chunk, s.prompt.shape[0] - s.prefilled, budget)
            if take <= 0:
                break
            if s.prefilled == 0:
                s.queue_ms = (time.monotonic() - s.submitted) * 1000
            work.append((s, take))
            budget -= take
        if work:
            self._prefill_rows(work)

    def _prefill_rows(self, work: list[tuple[_Session, int]]) -> None:
        """One runner.prefill over `work`; on out-of-memory, halves of the rows, then shorter chunks."""
        last = [s.prefilled + take == s.prompt.shape[0] for s, take in work]
        try:
            status = self.runner.prefill([s.slot for s, _ in work],
                                         [s.prompt[s.prefilled:s.prefilled + take] for s, take in work], last)
        except torch.OutOfMemoryError:
            self._out_of_memory()
            if len(work) > 1:
                h = len(work) // 2
                self._prefill_rows(work[:h])
                self._prefill_rows(work[h:])
            elif work[0][1] > 1:
                self._prefill_rows([(work[0][0], work[0][1] // 2)])
            return    # a single position that does not fit: try again next iteration
        for (s, take), done, st in zip(work, last, status):
            s.prefilled += take
            if not done:
                continue
            s.prompt = None
            if st == RUNNING:
                self._phase[s.slot] = DECODE
            else:                       # max_frames 0
                self._close(s, "max_frames")

    # -- decode ------------------------------------------------------------------------------------

    def _launch_step(self, launched: _Launched) -> None:
        """Launch one frame for every decoding slot that has its next text, into `launched` (the
        step's frames go into the vocoder's rings on the device at once; `_take_step` takes its
        result next iteration)."""
        decode = self._phase == DECODE
        if not decode.any():
            return
        n = int(np.flatnonzero(decode)[-1]) + 1
        pos, has_text = self._trail_pos[:n], self._trail_pos[:n] < self._trail_len[:n]
        active = decode[:n] & (has_text | self._text_done[:n])
        if not active.any():
            with self._lock:
                self._last_sat_out = int(decode.sum())
            return   # everyone waits for text: the loop sleeps until a command arrives
        ids = np.where(has_text, self._trail[np.arange(n), np.minimum(pos, self._trail.shape[1] - 1)], self._pad_id)
        text = self.model.talker.embed_text(to_device(ids, self.device))
        step = None
        for _ in range(self.oom_retries + 1):
            try:
                step = self.runner.step(n, active.tolist(), text)
                break
            except CacheFull:           # retrying would not bring pages back
                break
            except torch.OutOfMemoryError:
                self._out_of_memory()
        if step is None:     # nothing advanced; the next iteration tries again, without the rows
            self._out_of_pages(n, active)   # that found no room for their next position
            return
        self._trail_pos[:n] += active & has_text
        rows = np.flatnonzero(active)
        launched.frames_added = self.vocoder.add(rows, step.frames)
        launched.step, launched.rows, launched.sessions = step, rows, [self._by_slot[r] for r in rows]
        with self._lock:
            self._steps += 1
            self._last_batch = int(rows.size)
            self._last_sat_out = int(decode.sum()) - int(rows.size)
            self._text_waits += self._last_sat_out

    def _out_of_pages(self, n: int, active: np.ndarray) -> None:
        """Rows whose next position has no cache page (the page budget is spent, or the device had no
        room after the retries) end as if their frame limit came (their audio so far is delivered):
        the other sessions are not held up waiting for memory that may not come back."""
        rows = self.runner.unreserved(n, active)
        if rows.size:
            log.warning("no device memory for the KV cache of %d sessions: ending their turns", rows.size)
            self._out_of_pages_ending += [self._by_slot[slot] for slot in rows]

    def _send_audio(self, launched: _Launched) -> None:
        """Send the audio of the windows in `launched`, then the results of the sessions whose last
        audio that was."""
        for sessions, audio in launched.windows:
            for s, pcm in zip(sessions, audio.wait()):
                self._emit(s, pcm)
        for s in launched.ending:
            self._close(s, s.reason)

    def _send_unsent(self, stepping: bool) -> None:
        """Send the audio of the windows earlier iterations launched, oldest first (and the results of
        the sessions whose last audio it was): all of it, waited for; or with `defer_audio`, up to the
        last that must not wait longer (`_must_send`), waited for, then what has reached the host.
        Without a step `stepping` on the device the host has nothing else to do: it waits for all of it.
        An iteration calls it before the read-back (time to first audio as without `defer_audio`) and
        after the next windows' launch (what has landed meanwhile)."""
        self._send_oldest(1 + max((i for i, launched in enumerate(self._unsent)
                                   if not stepping or self._must_send(launched)), default=-1))
        while self._unsent and self._unsent[0].audio_ready():
            self._send_audio(self._unsent.popleft())

    def _send_oldest(self, n: int) -> None:
        """Send the audio of the `n` oldest launches in `_unsent`, waited for."""
        for _ in range(n):
            self._send_audio(self._unsent.popleft())

    def _must_send(self, launched: _Launched) -> bool:
        """Whether a window's audio must be waited for now: always without `defer_audio`; with it, once
        it is `defer_audio` iterations later than it would be without, where the rings need its codes
        back before the next step's frames (`StreamingVocoder.ring_iterations`), or for a listener about
        to run short."""
        late = self._iterations - launched.iteration - 1
        if late >= min(self.defer_audio, self.vocoder.ring_iterations - 2):
            return True
        return any(self._urgent(s) for sessions, _ in launched.windows for s in sessions)

    def _urgent(self, s: _Session) -> bool:
        """Whether the session's audio must go out now: its first, or its listener is running short
        (`WindowPolicy.running_short`: the next iteration's look comes a step later)."""
        if s.closed:            # cancelled: its audio is dropped
            return False
        if s.samples == 0:
            return True
        played = time.monotonic() - (s.submitted + s.ttfa_ms / 1000)
        return self.vocoder.policy.running_short(s.samples / self.model.config.sample_rate - played, self._step_s)

    def _take_step(self, launched: _Launched) -> list[_Session]:
        """Take the frames of the step in `launched`; returns the sessions that ended in it, or for
        lack of cache pages (their slots still held)."""
        ended = [s for s in self._out_of_pages_ending if not s.closed]   # (a cancel may have come between)
        self._out_of_pages_ending = []
        for s in ended:
            s.reason = "max_frames"
        if launched.step is None:
            return ended
        out = launched.step.result()
        mine = np.array([s.slot == r and not s.closed and self._phase[r] == DECODE
                         for s, r in zip(launched.sessions, launched.rows)], dtype=bool)
        rows = launched.rows[mine & out.advanced[launched.rows]]      # others: cancelled, or ended a step earlier
        self._frames[rows] += 1
        self.vocoder.confirm(rows)
        if self.keep_codes:
            for slot in rows:
                self._by_slot[slot].codes.append(out.frames[slot])
        for slot in rows[out.status[rows] != RUNNING]:
            s = self._by_slot[slot]
            if s.reason is None:
                s.reason = "eos" if out.status[slot] == EOS else "max_frames"
                ended.append(s)
        with self._lock:
            self._frames_total += rows.size
        return ended

    def _launch_windows(self, ended: list[_Session], launched: _Launched, after=None) -> None:
        """Launch the decode of the windows that are due, batched, into `launched`; the sessions that
        `ended` hold their slots (DRAINING) until their last audio is sent, then get their result.

        Sessions that ended, and sessions waiting for text, flush what they have: audio already
        generated is never held back behind text that has not arrived. A session's last window joins
        the group of the next window size (`StreamingVocoder.due`'s `last`).

        after: the event `StreamingVocoder.add` gave for the step just read back: the windows take
        their codes on the vocoder's stream once those frames are in, not behind the step launched
        since. That gather may run after the step stream's later writes into the rings, which is safe
        because (1) a session's own later frames land elsewhere in its ring (it holds a window, the
        step in flight and the next: `_send_audio` waits for each iteration's windows before the
        iteration after launches another step), and (2) no other session writes into a slot's ring
        before the slot's last audio is out (DRAINING; a cancelled session's audio is dropped).
        """
        decode = self._phase == DECODE
        flush = decode & (self._trail_pos >= self._trail_len) & ~self._text_done
        last = np.zeros_like(flush)
        last[[s.slot for s in ended]] = True
        flush |= last
        slots = np.flatnonzero(decode)
        for group, frames in self.vocoder.due(slots, flush[slots], self._step_s, last[slots]):
            launched.windows.append(([self._by_slot[slot] for slot in group],
                                     self.vocoder.decode(group, frames, after=after)))
            self._windows_at[group] = launched.iteration
        for s in ended:
            self._phase[s.slot] = DRAINING
        launched.ending += ended

    def _emit(self, s: _Session, pcm: np.ndarray) -> None:
        if s.closed:          # cancelled while its audio was being made
            return
        if s.samples == 0:
            s.ttfa_ms = (time.monotonic() - s.submitted) * 1000
        s.outbox.put(AudioChunk(pcm, s.samples // self.samples_per_frame, s.samples))
        s.samples += pcm.shape[0]

    # -- endings -----------------------------------------------------------------------------------

    def _close(self, s: _Session, reason: str, error: Optional[str] = None) -> None:
        """Send the session's result and free whatever it still holds (slot or place in the queue)."""
        if s.closed:
            return
        s.closed = True
        if s.slot is not None:
            self._release(s)
        elif s in self._waiting:
            self._waiting.remove(s)
            with self._lock:
                self._queued -= 1
        codes = None
        if self.keep_codes:
            codes = (torch.stack(s.codes).numpy() if s.codes
                     else np.zeros((0, self.model.config.talker.num_code_groups), dtype=np.int64))
        s.outbox.put(TurnResult(reason, s.frames, s.samples, s.queue_ms, s.ttfa_ms, error, codes))

    def _release(self, s: _Session) -> None:
        """The session's slot and cache pages are free (work already launched for it still runs first)."""
        s.frames = int(self._frames[s.slot])
        self._phase[s.slot] = FREE
        self._by_slot[s.slot] = None
        self._trail_len[s.slot] = self._trail_pos[s.slot] = 0
        self._text_done[s.slot] = False
        self._free.append(s.slot)
        self._free.sort()
        self.runner.release([s.slot])
        self._cache_full = False
        s.slot = None

    def _trim_cache(self) -> None:
        """Free KV pages beyond a spare of max(SPARE_PAGES, half the pages in use) go back to PyTorch's
        allocator (after a peak of load; under steady churn pages are reused), and to the device once
        no session is left (emptying the allocator's cache under load would make the next
        allocations wait on the device)."""
        cache = self.runner.cache
        keep = max(SPARE_PAGES, cache.pages_in_use // 2)
        if cache.pages_free > 2 * keep and cache.trim(keep):
            self._trimmed = True
        if self._trimmed and not (self._phase != FREE).any():
            release_cached_memory()
            self._trimmed = False

    def _out_of_memory(self) -> None:
        log.warning("device out of memory: splitting work and deferring admissions")
        release_cached_memory()
        self._defer_admissions = self.oom_defer_iterations
        with self._lock:
            self._ooms += 1
