"""bench/ttfa.py against a loopback server (scheduler test double: known chunk timing)."""
import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from app.service import Settings
from engine.loader import load_model
from server_harness import FakeScheduler, ServerThread

spec = importlib.util.spec_from_file_location("ttfa", Path(__file__).resolve().parents[1] / "bench" / "ttfa.py")
ttfa = importlib.util.module_from_spec(spec)
sys.modules["ttfa"] = ttfa          # dataclasses look their module up
spec.loader.exec_module(ttfa)


def test_playback_clock_counts_gaps():
    play = ttfa.Playback(rate=1000)
    play.add(0.0, 100)      # plays until 0.1
    play.add(0.05, 100)     # in time: until 0.2
    play.add(0.25, 100)     # late: underrun, playback resumes at 0.25 until 0.35
    play.add(0.30, 100)     # in time
    assert play.underruns == 1 and play.samples == 400
    assert play.dry == [(0.2, 50.0)]      # after 0.2 s of audio, 50 ms of silence


def test_bench_against_a_server(tiny_model_dir, tmp_path):
    # chunks of 2 frames (160 ms) every 10 ms: far faster than real time, so no underruns
    fake = FakeScheduler(load_model(tiny_model_dir), capacity=8, frames=10, frames_per_chunk=2, step_s=0.01)
    with ServerThread(Settings(voices_dir=str(tmp_path)), scheduler=fake) as srv:
        ns = argparse.Namespace(url=srv.url, sessions=6, rate=20.0, turns=2, text_chars=40, max_frames=None,
                                fixed_length=False, temperature=0.0, voice=None, encoding="mulaw", sample_rate=8000,
                                api_key=None, timeout=30.0, seed=1, json=None)
        report = asyncio.run(ttfa.run(ns))
    s = report["summary"]
    assert s["turns"] == s["turns_ok"] == 12 and not s["errors"]
    assert s["underruns"] == 0 and s["server_underruns"] == 0 and s["dry"] == []
    assert s["audio_s"] == pytest.approx(12 * 10 * 0.08)
    assert 0 < s["ttfa_ms"]["p50"] <= s["ttfa_ms"]["p95"] <= s["ttfa_ms"]["p99"] < 2000
    assert all(t["rtf"] > 1 for t in report["turns"])
    turns = [r for r in fake.submitted if r.request_id != "warmup"]
    assert len(turns) == 12 and all(r.sampling.greedy for r in turns)


def test_bench_reports_the_servers_underruns_beside_its_own(tiny_model_dir, tmp_path, caplog):
    # 1-frame chunks (80 ms of audio) every 200 ms: every chunk after the first comes late
    fake = FakeScheduler(load_model(tiny_model_dir), capacity=8, frames=4, frames_per_chunk=1, step_s=0.2)
    with ServerThread(Settings(voices_dir=str(tmp_path)), scheduler=fake) as srv:
        ns = argparse.Namespace(url=srv.url, sessions=1, rate=0.0, turns=1, text_chars=20, max_frames=None,
                                fixed_length=False, temperature=0.0, voice=None, encoding="pcm_s16le",
                                sample_rate=24000, api_key=None, timeout=30.0, seed=1, json=None)
        s = asyncio.run(ttfa.run(ns))["summary"]
    assert s["underruns"] == 3 and s["server_underruns"] == 3
    # after 1, 2 and 3 chunks of 80 ms, each ~120 ms late (chunks 200 ms apart)
    assert [(session, at_s) for session, _, at_s, _ in s["dry"]] == [(0, 0.08), (0, 0.16), (0, 0.24)]
    assert all(60 < ms < 400 for *_, ms in s["dry"])
    # the server logs where its own clock heard them
    assert "playback ran dry 3 times (after s of audio, for ms: 0.08: " in caplog.text
