"""`qwen3-tts-server` as a process: flags and environment, --demo with no weights, a failing start."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.main import parse_settings
from server_harness import free_port

REPO = Path(__file__).resolve().parents[1]


def test_flags_win_over_environment():
    env = {"MODEL_DIR": "/models/x", "PORT": "9000", "MAX_BATCH": "7", "DEMO": "1", "API_KEY": "k",
           "VOICES_DIR": "/v", "IDLE_TIMEOUT_S": "5", "DEVICE": "cpu", "DTYPE": "float32"}
    s = parse_settings(["--port", "9100", "--model-dir", "/models/y"], env)
    assert (s.port, s.model_dir, s.max_batch, s.demo, s.api_key, s.voices_dir, s.idle_timeout_s, s.device, s.dtype) == \
        (9100, "/models/y", 7, True, "k", "/v", 5.0, "cpu", "float32")
    d = parse_settings([], {})
    assert (d.model_dir, d.host, d.port, d.max_batch, d.voices_dir, d.demo, d.api_key, d.max_text_chars) == \
        ("models/0.6b-base", "127.0.0.1", 8090, None, "voices", False, None, 4096)
    with pytest.raises(SystemExit):
        parse_settings([], {"PORT": "eighty"})
    # --demo caps a turn (random weights seldom end one) unless told otherwise; a real model is not capped
    assert (s.max_frames, d.max_frames) == (250, None)
    assert parse_settings(["--demo", "--max-frames", "40"], {}).max_frames == 40


def test_demo_serves_without_weights(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DEMO": "1", "PORT": str(port), "VOICES_DIR": str(tmp_path / "voices"), "DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "demo server not ready"
            time.sleep(0.3)
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["demo"] is True and "noise" in health["notice"]
        r = httpx.post(url + "/v1/audio/speech", json={"input": "Demo.", "max_frames": 4}, timeout=60)
        assert r.status_code == 200 and r.headers["x-audio-seconds"] == "0.320"
        assert httpx.get(url + "/").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), out    # uvicorn re-raises the signal after a clean shutdown
    assert "Application shutdown complete" in out


def test_missing_model_exits_non_zero(tmp_path):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(tmp_path / "nothing-here"), "--port",
                           str(port), "--device", "cpu", "--voices-dir", str(tmp_path / "v")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "does not exist" in proc.stdout + proc.stderr
