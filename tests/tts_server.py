"""Runs the TTS server (tiny model) and the bridge as real subprocesses, as a user starts them: for the
page and Twilio tests, and for the hardening tests that need a server with a process of its own."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def subprocess_service(args: list[str], ready_url: str, timeout_s: float = 120.0,
                       headers: Optional[dict] = None) -> Iterator[subprocess.Popen]:
    """Starts `args`, waits until `ready_url` answers 200, yields the process, stops it at the end; its
    log is shown on failure. One intra-op thread, as in this process (conftest.py): the tiny model runs
    several times slower with more on a loaded 2-core machine."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

        def output() -> str:
            log.seek(0)
            return log.read()[-4000:]
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}:\n{output()}")
                try:
                    if httpx.get(ready_url, headers=headers, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ready_url} not ready after {timeout_s:.0f} s:\n{output()}")
                time.sleep(0.2)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def tts_server(model_dir: Path, *extra: str, api_key: Optional[str] = None) -> Iterator[str]:
    """The base URL (http://127.0.0.1:PORT) of a TTS server serving `model_dir` on the CPU."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "app", "--model-dir", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", *extra]
    if api_key:
        args += ["--api-key", api_key]
    with subprocess_service(args, f"{url}/ready", headers={"Authorization": f"Bearer {api_key}"} if api_key else None):
        yield url
