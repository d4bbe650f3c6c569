"""Speaker encoder against the official golden data: log-mel front end and x-vector."""
import numpy as np
import pytest
import torch

from engine.audio_io import load_reference
from engine.config import load_config
from engine.model.speaker import SpeakerEncoder, mel_filterbank, speaker_mel
from engine.weights import load_into, read_safetensors

REFS = ["ref_en", "ref_synth", "ref_calib"]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    enc = SpeakerEncoder(load_config(tiny_model_dir).speaker).eval()
    tensors = read_safetensors(tiny_model_dir / "model.safetensors")
    used = load_into(enc, tensors, "speaker_encoder.")
    assert used == {k for k in tensors if k.startswith("speaker_encoder.")}  # the whole subtree, nothing else
    return enc


def assert_xvector_close(x: torch.Tensor, golden: np.ndarray):
    g = torch.from_numpy(golden)
    assert x.shape == g.shape and x.dtype == torch.float32
    assert (x - g).abs().max().item() <= 1e-4
    assert torch.nn.functional.cosine_similarity(x, g, dim=0).item() > 0.99999


@pytest.mark.parametrize("name", REFS)
def test_speaker_mel_matches_official(golden_npz, name):
    case = golden_npz(name)
    mel = speaker_mel(case["audio"])
    golden = case["speaker_mel"]
    assert mel.dtype == torch.float32 and tuple(mel.shape) == golden.shape == (len(case["audio"]) // 256, 128)
    err = np.abs(mel.numpy() - golden)
    # Bins with real energy match to 1e-4. In near-empty bins (ref_en has nothing above ~11 kHz: it
    # was resampled from 22.05 kHz) the fp32 STFT's own rounding dominates: two fp32 FFTs differ
    # there by up to ~3e-4 in log, and each is ~5e-4 from a float64 STFT.
    assert err[golden > -7].max() <= 1e-4
    assert err.max() <= 1e-3


@pytest.mark.parametrize("name", REFS)
def test_xvector_matches_official(encoder, golden_npz, name):
    case = golden_npz(name)
    assert_xvector_close(encoder.embed(case["audio"]), case["xvector"])


@pytest.mark.parametrize("name", REFS)
def test_xvector_from_wav_file(encoder, golden_dir, golden_npz, name):
    wav = load_reference(golden_dir / "cases" / f"{name}.wav")
    np.testing.assert_array_equal(wav, golden_npz(name)["audio"])  # librosa.load(sr=None) values
    assert_xvector_close(encoder.embed(wav), golden_npz(name)["xvector"])


def test_batched_forward_matches_rows(encoder, golden_npz):
    a, b = golden_npz("ref_synth")["audio"], golden_npz("ref_calib")["audio"]
    n = min(len(a), len(b))
    wavs = torch.from_numpy(np.stack([a[:n], b[:n]]))
    mels = speaker_mel(wavs)
    assert mels.shape == (2, n // 256, 128)
    torch.testing.assert_close(mels[1], speaker_mel(wavs[1]), rtol=0, atol=1e-6)
    with torch.inference_mode():
        batched = encoder(mels)
        rows = torch.cat([encoder(mels[i:i + 1]) for i in range(2)])
    torch.testing.assert_close(batched, rows, rtol=0, atol=1e-5)
    assert (batched[0] - batched[1]).abs().max() > 1e-2  # different voices, different vectors


def test_bf16_embedding_is_close(encoder, tiny_model_dir, golden_npz):
    case = golden_npz("ref_en")
    bf16 = SpeakerEncoder(load_config(tiny_model_dir).speaker).eval()
    bf16.load_state_dict(encoder.state_dict())
    x = bf16.to(torch.bfloat16).embed(case["audio"])
    assert x.dtype == torch.bfloat16
    assert torch.nn.functional.cosine_similarity(x.float(), torch.from_numpy(case["xvector"]), dim=0).item() > 0.999


def test_short_audio_is_rejected(encoder):
    with pytest.raises(ValueError, match="too short"):
        speaker_mel(np.zeros(300, np.float32))
    with pytest.raises(ValueError, match="too short"):
        encoder.embed(np.zeros(1000, np.float32))  # 3 mel frames; the k3 dilation-4 conv needs 5


def test_mel_filterbank_is_slaney_normalised():
    fb = mel_filterbank()
    assert fb.shape == (128, 513) and fb.dtype == np.float32 and (fb >= 0).all()
    assert fb[:, -1].sum() == 0 and (fb[:, 1:-1].sum(axis=0) > 0).all()  # the triangles tile 0 < f < fmax
    # Slaney norm: each triangle has unit area in Hz (2 / bandwidth peak); wide filters integrate to ~1.
    area = fb.sum(axis=1) * (24000 / 1024)
    np.testing.assert_allclose(area[80:], 1.0, rtol=0.02)
