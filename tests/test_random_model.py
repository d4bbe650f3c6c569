"""engine.testing.random_model: official layout, deterministic per seed, loads and makes usable audio."""
import numpy as np
import pytest
import soundfile as sf
import torch

from engine.config import ModelFolderError, load_config
from engine.loader import load_model
from engine.requests import SamplingParams, SpeechRequest
from engine.synth import synthesize
from engine.testing import random_model
from engine.weights import read_safetensors

FILES = ["model.safetensors", "speech_tokenizer/model.safetensors"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("random") / "tiny"
    assert random_model.main(["--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0
    return out


def test_layout_matches_the_official_checkpoint(tiny, tiny_model_dir):
    for name in ["config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                 "preprocessor_config.json", "speech_tokenizer/config.json", "speech_tokenizer/preprocessor_config.json"]:
        assert (tiny / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    for f in FILES:
        ours, official = read_safetensors(tiny / f), read_safetensors(tiny_model_dir / f)
        assert sorted(ours) == sorted(official)
        for k, v in official.items():
            assert ours[k].shape == v.shape and ours[k].dtype == torch.float32, k


def test_deterministic_per_seed_and_bf16(tiny, tmp_path):
    random_model.build("tiny", 0, tmp_path / "bf16", bf16=True)
    random_model.build("tiny", 1, tmp_path / "other")
    a, b = read_safetensors(tiny / FILES[0]), read_safetensors(tmp_path / "bf16" / FILES[0])
    for k in a:
        assert b[k].dtype == torch.bfloat16
        torch.testing.assert_close(b[k], a[k].to(torch.bfloat16), atol=0, rtol=0)
    codec_a, codec_b = (read_safetensors(d / FILES[1]) for d in (tiny, tmp_path / "bf16"))
    assert all(torch.equal(codec_a[k], codec_b[k]) for k in codec_a)     # codec stays fp32
    other = read_safetensors(tmp_path / "other" / FILES[0])
    assert not torch.equal(other["talker.codec_head.weight"], a["talker.codec_head.weight"])


def test_loads_and_synthesizes(tiny, golden_dir):
    model = load_model(tiny)
    wav, sr = sf.read(golden_dir / "cases" / "ref_en.wav", dtype="float32")
    voice = model.make_voice(wav, sr, "The birch canoe slid on the smooth planks.")
    logits = model.talker.logits(model.talker.embed_codec(torch.arange(8)))
    assert (logits.std(dim=-1) > 0.1).all()                               # not all tied
    results = synthesize(model, [SpeechRequest(text="Random weights make noise.", voice=v, language="English",
                                               sampling=SamplingParams(greedy=True), max_frames=12)
                                 for v in (voice, model.make_voice(wav, sr))])
    for res in results:
        assert res.codes.shape == (12, 16) and res.wav.shape == (12 * 1920,)
        assert 0.05 < np.abs(res.wav).max() < 0.99 and res.wav.std() > 0.01   # audible, not clipped
        assert len(np.unique(res.codes[:, 0])) > 3
    # The audio follows the codes (default-init biases would make every code sequence sound alike).
    a, b = (r.wav for r in results)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.9


def test_06b_preset_has_the_real_sizes(tmp_path):
    random_model.copy_configs("0.6b", tmp_path)
    cfg = load_config(tmp_path)
    t = cfg.talker.transformer
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (1024, 28, 16, 8, 128)
    assert cfg.predictor.transformer.num_hidden_layers == 5 and cfg.speaker.enc_dim == 1024
    assert cfg.decoder.hidden_size == 512 and cfg.encoder.num_quantizers == 32
    with pytest.raises(ValueError, match="unknown preset"):
        random_model.build("7b", 0, tmp_path / "x")


# Other sizes than the golden model's: a wider talker (3 layers, 4 heads of 16, 2 KV heads), text
# embeddings of 48, a predictor of 2 layers with heads of 24, a wider vocoder (2 transformer layers).
OTHER_SIZES = {
    "config.json": {"speaker_encoder_config": {"enc_dim": 64}, "talker_config": {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
        "intermediate_size": 128, "text_hidden_size": 48,
        "code_predictor_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 24, "num_hidden_layers": 2, "intermediate_size": 80}}},
    "speech_tokenizer/config.json": {"decoder_config": {
        "latent_dim": 48, "decoder_dim": 96, "hidden_size": 48, "head_dim": 24, "num_hidden_layers": 2,
        "intermediate_size": 96, "codebook_dim": 32, "vector_quantization_hidden_dimension": 32}},
}


# ... and with a code predictor narrower than the talker (as 1.7B's: its inputs go through
# `small_to_mtp_projection`, which has weights only then)
NARROW_PREDICTOR = {**OTHER_SIZES, "config.json": {**OTHER_SIZES["config.json"], "talker_config": {
    **OTHER_SIZES["config.json"]["talker_config"],
    "code_predictor_config": {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                              "head_dim": 32, "num_hidden_layers": 2, "intermediate_size": 80}}}}


# ... and with 8 codebooks a frame instead of 16 (the talker, its code predictor, both speech-tokenizer halves)
EIGHT_CODEBOOKS = {"config.json": {"talker_config": {"num_code_groups": 8, "code_predictor_config": {"num_code_groups": 8}}},
                   "speech_tokenizer/config.json": {"decoder_config": {"num_quantizers": 8},
                                                    "encoder_valid_num_quantizers": 8}}


def test_a_narrower_code_predictor_takes_its_inputs_through_the_projection(tmp_path):
    """Where the code predictor is narrower than the talker, the folder has
    `talker.code_predictor.small_to_mtp_projection` (weight and bias), the engine loads it, and each of
    a frame's 15 predictor steps projects its talker-width input (2 positions, then 1); where the
    widths are equal there is no such tensor."""
    from safetensors.torch import load_file
    folder = random_model.build("tiny", 2, tmp_path / "m", overrides=NARROW_PREDICTOR)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "talker.code_predictor.small_to_mtp_projection"
    assert tensors[name + ".weight"].shape == (32, 64) and tensors[name + ".bias"].shape == (32,)
    predictor = load_model(folder).talker.code_predictor
    torch.testing.assert_close(predictor.small_to_mtp_projection.weight, tensors[name + ".weight"])
    torch.testing.assert_close(predictor.small_to_mtp_projection.bias, tensors[name + ".bias"])
    inputs = []
    predictor.small_to_mtp_projection.register_forward_hook(lambda m, args, out: inputs.append(tuple(args[0].shape)))
    g = torch.Generator().manual_seed(0)
    h, c0_embed = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    with torch.no_grad():
        codes = predictor.predict(h, c0_embed, lambda logits, group, embed: _greedy(logits, embed))
    assert codes.shape == (3, 15) and inputs == [(3, 2, 64)] + [(3, 1, 64)] * 14
    equal = load_file(str(random_model.build("tiny", 2, tmp_path / "e", overrides=OTHER_SIZES) / "model.safetensors"))
    assert not any("small_to_mtp_projection" in k for k in equal)


def _greedy(logits: torch.Tensor, embed) -> torch.Tensor:
    ids = logits.argmax(dim=-1)
    if embed is not None:
        table, out = embed
        out.copy_(table[ids])
    return ids


@pytest.mark.parametrize("sizes", [OTHER_SIZES, NARROW_PREDICTOR, EIGHT_CODEBOOKS],
                         ids=["other-sizes", "narrow-predictor", "eight-codebooks"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_a_model_of_other_sizes_streams_what_it_synthesizes(tmp_path, overlap, sizes):
    """The engine takes every size from the folder's configs: a model unlike the golden one streams,
    x-vector and ICL, the codes and audio of the one-shot synthesis."""
    from engine.scheduler import Scheduler
    model = load_model(random_model.build("tiny", 1, tmp_path / "m", overrides=sizes))
    talker, decoder = sizes["config.json"]["talker_config"], sizes["speech_tokenizer/config.json"]["decoder_config"]
    got = {**vars(model.config.talker.transformer), **vars(model.config.talker)}
    assert all(got[k] == v for k, v in talker.items() if not isinstance(v, dict))
    assert all(getattr(model.config.decoder, k) == v for k, v in decoder.items() if hasattr(model.config.decoder, k))
    ref = np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1
    for voice in (model.make_voice(ref, 24000), model.make_voice(ref, 24000, "A reference transcript.")):
        request = SpeechRequest("Hello there, a model of other sizes.", voice, "english",
                                SamplingParams(greedy=True), max_frames=10)
        expected = synthesize(model, [request])[0]
        with Scheduler(model, 3, keep_codes=True, overlap=overlap) as sch:
            chunks, result = sch.submit(request).collect(60)
        np.testing.assert_array_equal(result.codes, expected.codes)
        wav = np.concatenate([c.pcm for c in chunks])
        assert wav.shape[0] == result.frames * 1920 > 0
        np.testing.assert_allclose(wav, expected.wav[-wav.shape[0]:], rtol=0, atol=1e-4)


def test_a_speaker_encoder_unlike_the_talker_is_refused(tmp_path):
    random_model.copy_configs("tiny", tmp_path, {"config.json": {"speaker_encoder_config": {"enc_dim": 48}}})
    with pytest.raises(ModelFolderError, match="speaker encoder dimension 48"):
        load_config(tmp_path)


def test_a_codec_unlike_the_talker_is_refused(tmp_path):
    random_model.copy_configs("tiny", tmp_path, {"speech_tokenizer/config.json": {"decoder_config": {"num_quantizers": 8}}})
    with pytest.raises(ModelFolderError, match="makes 16 codes a frame but the speech tokenizer's decoder reads 8"):
        load_config(tmp_path)
