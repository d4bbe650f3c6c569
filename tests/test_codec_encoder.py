"""Mimi codec encoder against the official golden ref_codes.

The late residual levels of the tiny model quantize residuals of ~1e-4 whose nearest and second
nearest table entries can be ~1e-7 apart, below the fp32 noise of the latent itself (~7e-7 per
element: the same graph run with 1 vs 2 threads, or against float64). The official code flips such
ties too: its batched encode of ref_synth (`encode_only_batch2`) differs from its single encode at
7 entries. So codes are compared exactly, and every disagreement must be such a tie: along the
golden path, the golden entry is within TIE of the nearest one. A real bug moves codes by far more.
"""
import numpy as np
import pytest
import torch

from engine.config import load_config
from engine.model.codec_encoder import CodecEncoder
from engine.weights import load_into, read_safetensors

TIE = 4e-6  # 2 * |latent noise|_2 = 2 * 7e-7 * sqrt(codebook_dim 8), in distance units


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    enc = CodecEncoder(load_config(tiny_model_dir).encoder).eval()
    tensors = read_safetensors(tiny_model_dir / "speech_tokenizer" / "model.safetensors")
    used = load_into(enc, tensors, "encoder.")
    skipped = {k for k in tensors if k.startswith("encoder.") and k[8:].startswith(enc.unused_checkpoint_prefixes)}
    assert not used & skipped
    assert used | skipped == {k for k in tensors if k.startswith("encoder.")}
    return enc


def batch(waves: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right zero-padding to the longest, as the official feature extractor does."""
    lengths = torch.tensor([len(w) for w in waves])
    out = torch.zeros(len(waves), int(lengths.max()))
    for i, w in enumerate(waves):
        out[i, :len(w)] = torch.from_numpy(w)
    return out, lengths


@torch.inference_mode()
def tie_gaps(enc: CodecEncoder, wav: torch.Tensor, golden: list[np.ndarray]) -> list[float]:
    """Follow the golden codes through the RVQ; for each entry where our nearest neighbour differs,
    how much farther the golden entry is than ours."""
    latent = enc.latent(wav)
    gaps, column = [], 0
    q = enc.quantizer
    for rvq in (q.semantic_residual_vector_quantizer, q.acoustic_residual_vector_quantizer):
        residual = rvq.input_proj(latent).transpose(1, 2)
        for layer in rvq.layers:
            table = layer.codebook.table()
            dist = torch.cdist(residual.reshape(1, -1, residual.shape[-1]), table[None])[0].view(*residual.shape[:2], -1)
            chosen = dist.argmin(-1)
            for row, g in enumerate(golden):
                g = torch.from_numpy(g[:, column])
                d = dist[row, :len(g)]
                ours = chosen[row, :len(g)]
                for t in torch.nonzero(ours != g).flatten().tolist():
                    gaps.append((d[t, g[t]] - d[t, ours[t]]).item())
                chosen[row, :len(g)] = g
            residual = residual - torch.nn.functional.embedding(chosen, table)
            column += 1
    return gaps


def check(enc: CodecEncoder, waves: list[np.ndarray], golden: list[np.ndarray]):
    wav, lengths = batch(waves)
    codes = enc.encode(wav, lengths)
    assert len(codes) == len(golden)
    for c, g in zip(codes, golden):
        assert c.dtype == torch.int64 and tuple(c.shape) == g.shape  # [ceil(len/1920), 16]
        assert (c.numpy() == g).mean() > 0.97
        assert (c[:, 0].numpy() == g[:, 0]).all()  # the semantic code has real margins
    gaps = tie_gaps(enc, wav, golden)
    mismatches = sum(int((c.numpy() != g).sum()) for c, g in zip(codes, golden))
    assert (mismatches == 0) == (len(gaps) == 0)
    assert all(0 <= gap <= TIE for gap in gaps), gaps


@pytest.mark.parametrize("name", ["ref_en", "ref_synth", "ref_calib"])
def test_ref_codes_match_official(encoder, golden_npz, name):
    case = golden_npz(name)
    check(encoder, [case["audio"]], [case["ref_codes"]])


def test_batched_encode_matches_official(encoder, golden_npz):
    case = golden_npz("encode_only_batch2")
    check(encoder, [case["audio_0"], case["audio_1"]], [case["codes_0"], case["codes_1"]])


def test_padding_content_is_ignored(encoder, golden_npz):
    a = golden_npz("ref_calib")["audio"]
    wav, lengths = batch([a, a[:20000]])
    noisy = wav.clone()
    noisy[1, 20000:] = 0.5  # garbage beyond the valid length must not leak in
    clean, dirty = encoder.encode(wav, lengths), encoder.encode(noisy, lengths)
    assert [tuple(c.shape) for c in clean] == [(25, 16), (11, 16)]  # ceil(48000/1920), ceil(20000/1920)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


def test_encode_validates_arguments(encoder):
    wav = torch.zeros(2, 4000)
    with pytest.raises(ValueError, match="lengths"):
        encoder.encode(wav, [4000])
    with pytest.raises(ValueError, match="lengths"):
        encoder.encode(wav, [4000, 0])
    with pytest.raises(ValueError, match="lengths"):
        encoder.encode(wav, [4000, 4001])


def test_tie_check_catches_a_wrong_latent(encoder, golden_npz):
    """The tolerance is far below what a real error does: a 1e-3 perturbation of the input breaks it."""
    case = golden_npz("ref_calib")
    wav = case["audio"] + np.float32(1e-3) * np.random.default_rng(0).standard_normal(len(case["audio"]), np.float32)
    with pytest.raises(AssertionError):
        check(encoder, [wav], [case["ref_codes"]])
