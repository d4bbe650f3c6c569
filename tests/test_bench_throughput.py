"""bench/throughput.py's sustained load and bench/sustained_variants.py, on the CPU with the tiny model
(benches, not speed checks)."""
import numpy as np

from bench.sustained_variants import run_variant
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


def test_sustained_variants_change_the_scheduler_only_while_they_run(tiny_model_dir):
    model = load_model(tiny_model_dir)
    voice = model.make_voice(np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1, 24000)
    with Scheduler(model, max_batch=2) as scheduler:
        rows = [run_variant(scheduler, voice, name, turns=5, slots=2, frames=6)
                for name in ("as-is", "no-first-window-path")]
        assert "first_window_closes" not in vars(scheduler.vocoder)      # the class's method again
    for name, row in zip(("as-is", "no-first-window-path"), rows):
        assert row["variant"] == name and row["turns"] == 5 and row["rtf_steady"] > 0 and row["ttfa_idle_ms"] > 0
        assert {"read-back", "step launch", "admission"} <= set(row["host_ms_per_step"])
        assert all(ms > 0 for ms in row["host_ms_per_step"].values())
