"""bench/soak.py, short: 20 s of sessions with churn (hang-ups, resets, barge-ins, REST) against a real
server on the tiny model: no turn lost or garbled, no slot, session or queue entry left, memory and
file handles flat."""
import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path

from app.service import Settings
from server_harness import ServerThread

spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[1] / "bench" / "soak.py")
soak = importlib.util.module_from_spec(spec)
sys.modules["soak"] = soak          # dataclasses look their module up
spec.loader.exec_module(soak)

DURATION_S = 20.0


def test_short_soak(tiny_model_dir, tmp_path):
    settings = Settings(model_dir=str(tiny_model_dir), device="cpu", max_batch=8, max_queue=32,
                        voices_dir=str(tmp_path))
    with ServerThread(settings) as srv:
        args = argparse.Namespace(url=srv.url, duration=DURATION_S, concurrency=8, max_turns=3, max_frames=5,
                                  churn=0.25, cancel_rate=0.2, rest_rate=0.1, sample_every=2.0, settle=20.0,
                                  timeout=60.0, api_key=None, seed=3, json=None)
        report = asyncio.run(soak.run(args))
    print(report)
    assert not report.failed and report.problems == [], report.problems
    assert report.lost == report.garbled == 0
    assert (report.leaked_slots, report.leaked_sessions, report.leaked_queue) == (0, 0, 0)
    assert report.sessions >= 20 and report.turns_ok >= 20 and report.rest_requests >= 2
    assert report.sessions_cut >= 2 and report.turns_cancelled >= 1       # the churn really happened
    assert len(report.samples) >= DURATION_S / 2
    assert report.memory_end_mb - report.memory_start_mb < 200          # (client and server in this process)
    assert report.fds_end <= report.fds_start + soak.FD_SLACK
