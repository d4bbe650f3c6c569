"""Every Triton kernel compiles for Hopper (sm_90), here on the CPU: see tests/compile_kernels.py."""
import os
import subprocess
import sys
from pathlib import Path

from tests.triton_cpu import require_triton


def test_kernels_compile_for_sm90():
    require_triton()
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, str(root / "tests" / "compile_kernels.py")], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("compiled") == 246
