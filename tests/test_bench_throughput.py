"""bench/throughput.py's runs and sustained load, bench/sustained_variants.py and bench/steady_timeline.py, on
the CPU with the tiny model (benches, not speed checks)."""
import json
from types import SimpleNamespace

import numpy as np

from bench.steady_timeline import busy_ns, phase_gpu_ms, profile_steady, summarize
from bench.sustained_variants import VARIANTS, known, run_variant
from bench import throughput
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


def test_throughput_runs_each_batch_with_each_defer_audio_setting_in_one_process(tiny_model_dir, tmp_path):
    out = tmp_path / "rows.jsonl"
    throughput.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--batches", "1,2",
                     "--frames", "3", "--sustained", "4", "--defer-audio", "0,3", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [(r["mode"], r["batch"], r["defer_audio"]) for r in rows if r["kind"] == "run"]
    assert runs == [("scheduler", 1, 0), ("scheduler", 1, 3), ("scheduler", 2, 0), ("scheduler", 2, 3),
                    ("sustained", 2, 0), ("sustained", 2, 3)]
    assert all(r["frames_total"] == 3 * r["batch"] for r in rows if r["kind"] == "run" and r["mode"] == "scheduler")


def test_sustained_variants_change_the_scheduler_only_while_they_run(tiny_model_dir):
    model = load_model(tiny_model_dir)
    voice = model.make_voice(np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1, 24000)
    names = VARIANTS
    with Scheduler(model, max_batch=2, overlap=True) as scheduler:
        rows = [run_variant(scheduler, voice, name, turns=5, slots=2, frames=6) for name in names]
        assert not {"first_window_closes", "decode"} & set(vars(scheduler.vocoder))    # the class's methods again
        assert not scheduler.audio_after_windows and not scheduler.defer_audio
    assert known("deferred-audio-12") and not known("deferred-audio-") and not known("fast")
    for name, row in zip(names, rows):
        assert row["variant"] == name and row["turns"] == 5 and row["rtf_steady"] > 0 and row["ttfa_idle_ms"] > 0
        assert {"read-back", "step launch", "admission"} <= set(row["host_ms_per_step"])
        assert all(ms > 0 for ms in row["host_ms_per_step"].values())


def test_timeline_counts_overlapping_kernels_once_and_the_gaps_as_idle():
    assert busy_ns([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25 and busy_ns([]) == 0
    # two steps of 20 ms wall; stream 1 busy 0-10 and 12-16 ms, stream 2 (the vocoder) 8-14 ms: 16 ms busy
    ms = 1_000_000
    activity = [(0, 10 * ms, 1, "step"), (12 * ms, 16 * ms, 1, "step"), (8 * ms, 14 * ms, 2, "vocoder")]
    row = summarize(activity, steps=2, wall_ns=40 * ms)
    assert (row["wall_ms_per_step"], row["gpu_busy_ms_per_step"], row["gpu_idle_ms_per_step"]) == (20, 8, 12)
    assert row["streams"]["1"] == {"busy_ms": 7, "kernels": 1, "top": {"step": 7}}
    assert row["streams"]["2"] == {"busy_ms": 3, "kernels": 0.5, "top": {"vocoder": 3}}


def test_timeline_sums_the_gpu_time_each_phase_of_the_iteration_launched():
    """The scheduler's `engine.<phase>` profiler ranges, each with its kernels' GPU time (microseconds,
    as the profiler counts it), over 2 steps: ms a step by phase; other events left out."""
    events = [SimpleNamespace(name=n, device_time_total=us) for n, us in
              (("engine.step launch", 9000), ("engine.prefill", 1000), ("engine.step launch", 7000),
               ("aten::mm", 500), ("engine.vocoder launch", 0))]
    assert phase_gpu_ms(events, steps=2) == {"prefill": 0.5, "step launch": 8.0, "vocoder launch": 0.0}


def test_steady_timeline_profiles_steps_in_the_middle_of_a_steady_load(tiny_model_dir):
    model = load_model(tiny_model_dir)
    voice = model.make_voice(np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1, 24000)
    with Scheduler(model, max_batch=2) as scheduler:
        row = profile_steady(scheduler, voice, turns=24, slots=2, frames=8, steps=4)   # the load outlasts the profilers' start
        assert scheduler.stats().steps > row["steps"] >= 4          # more steps ran before and after the window
    assert row["slots"] == 2 and row["wall_ms_per_step"] > 0
    assert row["streams"] == {} and row["gpu_busy_ms_per_step"] == 0     # no GPU here: no device activity
    # the second profile saw the iteration's phases (no kernels on the CPU: 0 ms each)
    assert row["phase_steps"] >= 1 and {"step launch", "read-back", "vocoder launch"} <= set(row["gpu_ms_by_phase"])
    assert set(row["gpu_ms_by_phase"].values()) == {0}
