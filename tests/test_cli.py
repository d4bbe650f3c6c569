"""`qwen3-tts synth` / `python -m engine synth`: golden codes, files written, clear errors."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from engine import cli

REPO = Path(__file__).resolve().parents[1]


def run_module(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def main(args):
    return cli.main([str(a) for a in args])


def base_args(tiny_model_dir, golden_dir, tmp_path, text, *extra):
    return ["synth", "--model-dir", tiny_model_dir, "--text", text, "--language", "English",
            "--ref-audio", golden_dir / "cases" / "ref_en.wav", *extra, "--greedy", "--max-frames", "31",
            "--codes-out", tmp_path / "c.npy", "--out", tmp_path / "o.wav"]


def test_xvector_golden_via_python_m(tiny_model_dir, golden_dir, golden_cases, golden_npz, tmp_path):
    text = golden_cases["xvec_en"]["items"][0]["text"]
    proc = run_module(*base_args(tiny_model_dir, golden_dir, tmp_path, text, "--x-vector-only"))
    assert proc.returncode == 0, proc.stderr
    assert "31 frames" in proc.stderr and "x-vector" in proc.stderr
    codes = np.load(tmp_path / "c.npy")
    assert codes.dtype == np.int64
    np.testing.assert_array_equal(codes, golden_npz("xvec_en")["codes_0"])
    wav, sr = sf.read(tmp_path / "o.wav", dtype="float32")
    assert sr == 24000 and wav.shape == (31 * 1920,)
    np.testing.assert_allclose(wav, golden_npz("xvec_en")["wav_0"], atol=1e-4, rtol=0)   # PCM_16 file


def test_icl_golden_via_python_m(tiny_model_dir, golden_dir, golden_cases, golden_npz, tmp_path):
    """ICL from the reference wav reproduces the golden icl_en codes (reference codes and all)."""
    case = golden_cases["icl_en"]
    text, ref_text = case["items"][0]["text"], case["ref_text"]
    env_threads = os.environ.pop("OMP_NUM_THREADS", None)   # the codec encoder must not depend on it
    try:
        proc = subprocess.run([sys.executable, "-m", "engine", *map(str, base_args(
            tiny_model_dir, golden_dir, tmp_path, text, "--ref-text", ref_text))], capture_output=True, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    finally:
        if env_threads is not None:
            os.environ["OMP_NUM_THREADS"] = env_threads
    assert proc.returncode == 0, proc.stderr
    assert "ICL voice" in proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), golden_npz("icl_en")["codes_0"])
    wav, _ = sf.read(tmp_path / "o.wav", dtype="float32")
    np.testing.assert_allclose(wav, golden_npz("icl_en")["wav_0"], atol=1e-4, rtol=0)


def test_sampling_flags_and_seed(tiny_model_dir, golden_dir, tmp_path):
    args = ["synth", "--model-dir", tiny_model_dir, "--text", "Seeded.", "--ref-audio",
            golden_dir / "cases" / "ref_calib.wav", "--max-frames", "6", "--temperature", "0.7", "--top-k", "20",
            "--seed", "5", "--out", tmp_path / "a.wav", "--codes-out", tmp_path / "a.npy"]
    assert main(args) == 0
    assert main(args[:-4] + ["--out", tmp_path / "b.wav", "--codes-out", tmp_path / "b.npy"]) == 0
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.shape == (6, 16)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mutate, message", [
    (lambda a, d, t: a.__setitem__(a.index("--model-dir") + 1, t / "nope"), "does not exist"),
    (lambda a, d, t: a.__setitem__(a.index("--language") + 1, "Klingon"), "supported: auto, chinese"),
    (lambda a, d, t: a.__setitem__(a.index("--ref-audio") + 1, d / "cases" / "cases.json"), "cannot decode audio"),
    (lambda a, d, t: a.__setitem__(a.index("--ref-audio") + 1, t / "missing.wav"), "missing.wav"),
    (lambda a, d, t: a.__setitem__(a.index("--out") + 1, t / "no" / "dir" / "o.wav"), "does not exist"),
    (lambda a, d, t: a.extend(["--temperature", "0.5"]), "--greedy"),
    (lambda a, d, t: a.__setitem__(a.index("--max-frames") + 1, "-1"), "--max-frames"),
])
def test_bad_input(tiny_model_dir, golden_dir, tmp_path, capsys, mutate, message):
    args = base_args(tiny_model_dir, golden_dir, tmp_path, "Hello.")
    mutate(args, golden_dir, tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_without_a_reference_it_speaks_in_the_built_in_voice(tiny_model_dir, tmp_path, capsys):
    """No --ref-audio: the server's default voice (the x-vector of the built-in recording), the same
    codes as with that recording given."""
    from engine.audio_io import BUILTIN_VOICE_WAV
    args = ["synth", "--model-dir", tiny_model_dir, "--text", "Hello there.", "--greedy", "--max-frames", "6",
            "--out", tmp_path / "o.wav"]
    assert main([*args, "--codes-out", tmp_path / "builtin.npy"]) == 0
    assert "x-vector voice (built-in)" in capsys.readouterr().err
    assert main([*args, "--codes-out", tmp_path / "given.npy", "--ref-audio", BUILTIN_VOICE_WAV]) == 0
    codes = np.load(tmp_path / "builtin.npy")
    assert codes.shape == (6, 16)
    np.testing.assert_array_equal(codes, np.load(tmp_path / "given.npy"))


def test_ref_text_needs_ref_audio(tiny_model_dir, tmp_path, capsys):
    args = ["synth", "--model-dir", tiny_model_dir, "--text", "Hi.", "--ref-text", "words", "--out", tmp_path / "o.wav"]
    assert main(args) == 2
    assert "--ref-text needs --ref-audio" in capsys.readouterr().err


def test_missing_model_file(tiny_model_dir, golden_dir, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).symlink_to(f)
    assert main(base_args(folder, golden_dir, tmp_path, "Hello.")) == 2
    err = capsys.readouterr().err
    assert "missing file" in err and "model.safetensors" in err
