"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

PREFIX = "qwen3_tts_"


class Metrics:
    """What PROTOCOL.md lists for /metrics. Counters move from the event loop and the engine thread
    (prometheus-client is thread-safe); gauges that mirror the scheduler are read at scrape time."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)    # process_resident_memory_bytes, process_open_fds, ...: leaks show (bench/soak.py)
        self.requests = Counter(PREFIX + "requests", "Requests by route and outcome", ["route", "outcome"], registry=r)
        self.active_sessions = Gauge(PREFIX + "active_sessions", "Open WebSocket sessions and REST syntheses",
                                     ["route"], registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting for a batch slot", registry=r)
        self.steps = Counter(PREFIX + "decode_steps", "Batched decode steps run", registry=r)
        self.frames = Counter(PREFIX + "frames_generated", "Codec frames generated (80 ms each)", registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Rows in one decode step (steps sampled every 20 ms)", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.step_seconds = Histogram(PREFIX + "step_seconds", "Wall time of one engine iteration with a decode step (sampled every 20 ms)",
                                      registry=r,
                                      buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28))
        self.ttfa_seconds = Histogram(PREFIX + "ttfa_seconds", "Time to first audio of a turn (submit to first chunk)",
                                      registry=r, buckets=(0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10))
        self.rtf = Histogram(PREFIX + "rtf", "Real-time factor of a turn (audio seconds / wall seconds)", registry=r,
                             buckets=(0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 20, 50, 100))
        self.audio_seconds = Counter(PREFIX + "audio_seconds", "Seconds of audio produced", registry=r)
        self.underruns = Counter(PREFIX + "underruns", "Chunks ready after the audio before them had finished playing",
                                 registry=r)
        self.host_seconds = Counter(PREFIX + "engine_host_seconds", "The engine thread's time by phase of its iterations "
                                    "(read-back, audio out: mostly waiting for the GPU)", ["phase"], registry=r)
        self.loop_lag = Histogram(PREFIX + "event_loop_lag_seconds", "How late the server's event loop wakes up (sampled every 20 ms)",
                                  registry=r, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.gpu_memory = Gauge(PREFIX + "gpu_memory_bytes", "GPU memory held by PyTorch (all tensors, the allocator's total, the talker KV cache's pages)", ["kind"], registry=r)

    def watch(self, queue_depth: Callable[[], float], gpu_memory: Callable[[str], float]) -> None:
        """Gauges computed when scraped."""
        self.queue_depth.set_function(queue_depth)
        for kind in ("allocated", "reserved", "kv_cache"):
            self.gpu_memory.labels(kind).set_function(lambda kind=kind: gpu_memory(kind))

    def observe_step(self, batch: int, seconds: float) -> None:
        self.batch_size.observe(batch)
        self.step_seconds.observe(seconds)

    def observe_turn(self, audio_s: float, wall_s: float, ttfa_ms: float, underruns: int) -> None:
        self.audio_seconds.inc(audio_s)
        if audio_s > 0:
            self.ttfa_seconds.observe(ttfa_ms / 1000.0)
            if wall_s > 0:
                self.rtf.observe(audio_s / wall_s)
        if underruns:
            self.underruns.inc(underruns)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PlaybackClock:
    """Counts underruns as a listener would hear them: playback starts with the first chunk and runs
    at real time; a chunk that arrives after everything before it has played is an underrun. `dry`
    says where each fell: (seconds of audio before it, milliseconds playback stood still)."""

    def __init__(self, rate: int):
        self.rate = rate
        self.start = None
        self.samples = 0
        self.underruns = 0
        self.dry: list[tuple[float, float]] = []

    def add(self, now: float, samples: int) -> None:
        if self.start is None:
            self.start = now
        elif now - self.start > self.samples / self.rate:
            self.underruns += 1
            played = self.samples / self.rate
            self.dry.append((round(played, 3), round((now - self.start - played) * 1000, 1)))
            self.start = now - played   # playback resumes with this chunk
        self.samples += samples
