"""load_model: modules, dtypes, clear errors for broken folders, hub ids; make_voice from a wav."""
import logging

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from engine import loader
from engine.audio_io import resample
from engine.config import ModelFolderError
from engine.loader import load_model, resolve_model_dir
from engine.weights import WeightError, read_safetensors

MAIN = "model.safetensors"
CODEC = "speech_tokenizer/model.safetensors"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def folder_with(tmp_path, tiny_model_dir, replace: dict | None = None, drop: tuple = ()):
    """A copy of the tiny folder made of symlinks, with some files dropped or replaced by tensors."""
    out = tmp_path / "model"
    for src in tiny_model_dir.rglob("*"):
        rel = src.relative_to(tiny_model_dir).as_posix()
        dst = out / rel
        if src.is_dir() or rel in drop:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if replace and rel in replace:
            save_file({k: v.contiguous() for k, v in replace[rel].items()}, str(dst))
        else:
            dst.symlink_to(src)
    return out


def test_loads_every_part(model, tiny_model_dir):
    assert model.model_dir == tiny_model_dir and model.device == torch.device("cpu")
    assert model.dtype == torch.float32 and not model.talker.training
    assert all(not p.requires_grad for p in model.talker.parameters())
    main = read_safetensors(tiny_model_dir / MAIN)
    torch.testing.assert_close(model.talker.codec_head.weight, main["talker.codec_head.weight"], atol=0, rtol=0)
    torch.testing.assert_close(model.speaker_encoder.fc.weight, main["speaker_encoder.fc.weight"], atol=0, rtol=0)
    codec = read_safetensors(tiny_model_dir / CODEC)
    torch.testing.assert_close(model.vocoder.pre_conv.conv.weight, codec["decoder.pre_conv.conv.weight"], atol=0, rtol=0)
    assert model.tokenizer.encode("Hello world") == [9707, 1879]


def test_bf16_keeps_rope_in_fp32(tiny_model_dir):
    m = load_model(tiny_model_dir, dtype=torch.bfloat16, codec_dtype=torch.float32)
    assert m.talker.codec_head.weight.dtype == torch.bfloat16
    assert m.speaker_encoder.fc.weight.dtype == torch.bfloat16
    assert m.vocoder.pre_conv.conv.weight.dtype == torch.float32
    assert m.talker.model.inv_freq.dtype == torch.float32            # computed in fp32 (MODEL.md 2.2)
    assert m.talker.code_predictor.model.inv_freq.dtype == torch.float32


def test_make_voice_from_wav(model, golden_dir, golden_npz, golden_cases):
    for name in ("ref_en", "ref_synth", "ref_calib"):
        wav, sr = sf.read(golden_dir / "cases" / f"{name}.wav", dtype="float32")
        z, ref_text = golden_npz(name), golden_cases[f"refaudio_{name}"]["ref_text"]
        voice = model.make_voice(wav, sr, ref_text)
        assert voice.icl and voice.xvector.dtype == torch.float32
        np.testing.assert_allclose(voice.xvector.numpy(), z["xvector"], atol=1e-4, rtol=0)
        assert voice.ref_text_ids == z["ref_text_ids"].tolist()[3:-2]
        codes = voice.ref_codes.numpy()
        assert codes.dtype == np.int64 and codes.shape == z["ref_codes"].shape
        # Exact up to the fp32 near-ties of the tiny model's late RVQ levels (see test_codec_encoder.py).
        np.testing.assert_array_equal(codes[:, 0], z["ref_codes"][:, 0])
        assert (codes == z["ref_codes"]).mean() > 0.97
    xvec = model.make_voice(wav, sr, ref_text, x_vector_only=True)
    assert not xvec.icl and xvec.ref_text_ids is None
    assert not model.make_voice(wav, sr).icl
    with pytest.raises(ValueError, match="ref_text is empty"):
        model.make_voice(wav, sr, "  ")


def test_make_voice_resamples(model, golden_dir):
    wav, _ = sf.read(golden_dir / "cases" / "ref_calib.wav", dtype="float32")
    wav48 = resample(wav, 24000, 48000)
    a = model.make_voice(wav48, 48000, "Calibration reference.")
    b = model.make_voice(resample(wav48, 48000, 24000), 24000, "Calibration reference.")
    torch.testing.assert_close(a.xvector, b.xvector, atol=0, rtol=0)
    torch.testing.assert_close(a.ref_codes, b.ref_codes, atol=0, rtol=0)
    assert a.ref_codes.shape[0] == 25                                 # ceil(48000 / 1920) at 24 kHz


@pytest.mark.parametrize("missing", [MAIN, CODEC, "vocab.json", "merges.txt", "tokenizer_config.json",
                                     "config.json", "speech_tokenizer/config.json"])
def test_missing_file_is_named(tmp_path, tiny_model_dir, missing):
    folder = folder_with(tmp_path, tiny_model_dir, drop=(missing,))
    with pytest.raises(ModelFolderError, match="missing file") as e:
        load_model(folder)
    assert missing in str(e.value)


def test_misshaped_and_missing_tensors_are_named(tmp_path, tiny_model_dir):
    main = read_safetensors(tiny_model_dir / MAIN)
    bad = dict(main, **{"talker.codec_head.weight": main["talker.codec_head.weight"][:-1]})
    with pytest.raises(WeightError, match=r"talker\.codec_head\.weight has shape \[3071, 32\]"):
        load_model(folder_with(tmp_path / "a", tiny_model_dir, {MAIN: bad}))
    gone = {k: v for k, v in main.items() if k != "speaker_encoder.fc.bias"}
    with pytest.raises(WeightError, match=r"missing tensor speaker_encoder\.fc\.bias"):
        load_model(folder_with(tmp_path / "b", tiny_model_dir, {MAIN: gone}))


def test_half_precision_checkpoints_and_unknown_keys(tmp_path, tiny_model_dir, caplog):
    main = {k: v.to(torch.bfloat16) for k, v in read_safetensors(tiny_model_dir / MAIN).items()}
    main["talker.something_new.weight"] = torch.zeros(3)
    codec = {k: v.half() if v.is_floating_point() else v for k, v in read_safetensors(tiny_model_dir / CODEC).items()}
    with caplog.at_level(logging.WARNING, logger="engine.weights"):
        m = load_model(folder_with(tmp_path, tiny_model_dir, {MAIN: main, CODEC: codec}))
    warnings = [r.getMessage() for r in caplog.records if "unknown tensors" in r.getMessage()]
    assert len(warnings) == 1 and "talker.something_new.weight" in warnings[0]
    assert m.talker.codec_head.weight.dtype == torch.float32
    torch.testing.assert_close(m.talker.codec_head.weight, main["talker.codec_head.weight"].float(), atol=0, rtol=0)
    torch.testing.assert_close(m.vocoder.pre_conv.conv.weight, codec["decoder.pre_conv.conv.weight"].float(),
                               atol=0, rtol=0)


def test_not_a_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist.*huggingface-cli download"):
        resolve_model_dir(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelFolderError, match="not a folder"):
        resolve_model_dir(tmp_path / "file")


def test_hub_id_unreachable_says_how_to_get_the_files(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelFolderError) as e:
        resolve_model_dir("Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    msg = str(e.value)
    assert "huggingface-cli download Qwen/Qwen3-TTS-12Hz-0.6B-Base --local-dir models/0.6b-base" in msg
    assert "copy the model folder" in msg


def test_hub_id_is_downloaded(monkeypatch, tiny_model_dir):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id: calls.append(repo_id) or str(tiny_model_dir))
    assert resolve_model_dir("someone/tiny-tts") == tiny_model_dir and calls == ["someone/tiny-tts"]
    assert loader.resolve_model_dir(tiny_model_dir) == tiny_model_dir and len(calls) == 1
