"""bench/first_audio.py's burst of sessions, on the CPU with the tiny model (a bench, not a speed check)."""
import numpy as np

from bench.first_audio import PHASES, burst
from engine.loader import load_model
from engine.scheduler import Scheduler


def test_a_burst_times_each_phase_until_every_session_has_audio(tiny_model_dir):
    model = load_model(tiny_model_dir)
    voice = model.make_voice(np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1, 24000)
    scheduler = Scheduler(model, max_batch=3)
    row = burst(scheduler, voice, frames=5, seed=1, sessions=3)
    head = row["first_audio_phases_ms"]
    assert row["sessions"] == 3 and 0 < row["first_audio_ms"] <= row["last_first_audio_ms"]
    assert set(PHASES) <= set(head) and head["iterations"] >= 2 and head["kv_chunks_allocated"] == 0   # CPU: one pool
    assert row["steady_iteration_ms"]["_launch_step"] > 0
    assert not set(PHASES) & set(vars(scheduler))          # the timing wrappers are gone
    assert scheduler.runner.cache.pages_in_use == 0        # every turn gave its pages back
