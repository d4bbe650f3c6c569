"""bench/throughput.py's sustained load, on the CPU with the tiny model (a bench, not a speed check)."""
import numpy as np

from bench.throughput import run_sustained
from engine.loader import load_model
from engine.scheduler import Scheduler


def test_sustained_load_runs_more_turns_than_slots_and_times_the_span_with_every_slot_busy(tiny_model_dir):
    model = load_model(tiny_model_dir)
    voice = model.make_voice(np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1, 24000)
    scheduler = Scheduler(model, max_batch=3)
    scheduler.start()
    try:
        row = run_sustained(scheduler, voice, turns=8, slots=3, frames=8, seed0=5)
    finally:
        scheduler.stop()
    lengths = np.random.default_rng(5).integers(6, 11, 8)           # the lengths it drew: 8 frames +-25%
    assert row["turns"] == 8 and row["frames_total"] == lengths.sum() and len(set(lengths)) > 1
    assert 0 < row["steady_s"] < row["wall_s"]
    assert row["rtf_steady"] > 0 and row["rtf_aggregate"] == row["frames_total"] * 0.08 / row["wall_s"]
    assert scheduler.runner.cache.pages_in_use == 0
