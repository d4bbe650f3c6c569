"""Shared fixtures: the golden folder recorded from the official implementation."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN = Path(os.environ.get("QWEN3_TTS_GOLDEN", Path(__file__).resolve().parents[1].parent / "shared" / "golden"))

# Tiny-model ops are far slower with several intra-op threads on a loaded 2-core machine.
torch.set_num_threads(1)

# Without a GPU, the Triton kernels of engine/model/kernels/ run in Triton's interpreter (numpy on
# the CPU); this must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests that time launch configs (as on a GPU, with fake timings) must not keep their picks on disk
# for later processes (`kernels.launch.TuningCache`); the cache's own test gives it a folder.
os.environ.setdefault("QWEN3_TTS_TUNING_CACHE", "0")


def _need_golden():
    if not (GOLDEN / "tiny-model" / "config.json").is_file():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"golden data not found at {GOLDEN} (set QWEN3_TTS_GOLDEN); CI must run these tests")
        pytest.skip(f"golden data not found at {GOLDEN} (set QWEN3_TTS_GOLDEN)")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    _need_golden()
    return GOLDEN


@pytest.fixture(scope="session")
def tiny_model_dir(golden_dir) -> Path:
    return golden_dir / "tiny-model"


@pytest.fixture(scope="session")
def golden_cases(golden_dir) -> dict:
    """cases.json indexed by case name."""
    index = json.loads((golden_dir / "cases" / "cases.json").read_text())
    return {c["name"]: c for c in index["cases"]}


@pytest.fixture(scope="session")
def golden_npz(golden_dir):
    """load(name) -> dict of arrays of cases/<name>.npz."""
    def load(name: str) -> dict:
        with np.load(golden_dir / "cases" / f"{name}.npz") as z:
            return {k: z[k] for k in z.files}
    return load
