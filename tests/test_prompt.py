"""Prompt embeddings against the official ones, every golden case and layout; incremental prompts."""
import numpy as np
import pytest
import torch

from engine.config import load_config
from engine.model.talker import Talker
from engine.prompt import PromptBuilder, resolve_language
from engine.requests import VoicePrompt
from engine.text import TextTokenizer
from engine.weights import load_into, read_safetensors


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = load_config(tiny_model_dir)
    talker = Talker(cfg.talker, cfg.predictor).eval()
    load_into(talker, read_safetensors(tiny_model_dir / "model.safetensors"), "talker.")
    tok = TextTokenizer(tiny_model_dir)
    return cfg, tok, PromptBuilder(talker, cfg, tok)


def _voice(tok, case, z):
    if case["mode"] != "icl":
        return VoicePrompt(torch.from_numpy(z["xvector"]))
    return VoicePrompt(torch.from_numpy(z["xvector"]), torch.from_numpy(z["ref_codes"]), tok.ref_text_ids(case["ref_text"]))


GENERATION_CASES = ["xvec_en", "xvec_zh", "xvec_es", "xvec_auto", "xvec_en_nonstreaming", "icl_en", "icl_zh",
                    "icl_en_nonstreaming", "batch3_xvec", "batch3_icl", "xvec_eos", "batch2_eos"]


@pytest.mark.parametrize("name", GENERATION_CASES)
def test_prompt_matches_official(setup, golden_cases, golden_npz, name):
    cfg, tok, builder = setup
    case, z = golden_cases[name], golden_npz(name)
    np.testing.assert_allclose(builder.tts_pad.numpy(), z["tts_pad_embed"][0, 0], atol=1e-5, rtol=0)
    for i, item in enumerate(case["items"]):
        p = builder.build(tok.text_ids(item["text"]), _voice(tok, case, z), item["language"], case["non_streaming_mode"])
        mask = z["talker_attention_mask"][i].astype(bool)
        np.testing.assert_allclose(p.embeds.numpy(), z["talker_inputs_embeds"][i][mask], atol=1e-4, rtol=0)
        golden_trailing = z["trailing_text_hidden"][i]            # right-padded with tts_pad
        n = p.trailing.shape[0]
        assert n <= golden_trailing.shape[0]
        np.testing.assert_allclose(p.trailing.numpy(), golden_trailing[:n], atol=1e-4, rtol=0)
        np.testing.assert_allclose(golden_trailing[n:], np.broadcast_to(z["tts_pad_embed"][0], golden_trailing[n:].shape),
                                   atol=1e-6, rtol=0)
        # The prefill lengths of MODEL.md 5.3 / 5.4.
        lang = 0 if item["language"] == "Auto" else 1
        if case["mode"] == "icl" and not case["non_streaming_mode"]:
            assert p.embeds.shape[0] == 8 + lang + z["ref_codes"].shape[0] + 1
        elif not case["non_streaming_mode"]:
            assert p.embeds.shape[0] == 9 + lang and n == len(tok.text_ids(item["text"]))


def test_languages(setup):
    cfg, _, _ = setup
    assert resolve_language("English", cfg) == "english"
    assert resolve_language("AUTO", cfg) == resolve_language(None, cfg) == "auto"
    for code, name in {"en": "english", "zh": "chinese", "es": "spanish", "fr": "french", "de": "german",
                       "it": "italian", "pt": "portuguese", "ja": "japanese", "ko": "korean", "ru": "russian"}.items():
        assert resolve_language(code.upper(), cfg) == name
        assert name in cfg.talker.codec_language_id
    with pytest.raises(ValueError, match="supported: auto, chinese, english") as e:
        resolve_language("Klingon", cfg)
    assert "Klingon" in str(e.value) and "russian" in str(e.value)


def test_language_tag_positions(setup, golden_npz):
    """Auto has the nothink prefix (8 positions before the text), a language the 4-id think prefix (9)."""
    cfg, tok, builder = setup
    z = golden_npz("xvec_en")
    voice = VoicePrompt(torch.from_numpy(z["xvector"]))
    ids = tok.text_ids("Hola.")
    es, auto, en = (builder.build(ids, voice, lang).embeds for lang in ("es", "auto", "English"))
    assert es.shape[0] == en.shape[0] == auto.shape[0] + 1 == 10
    talker = builder.talker
    diff = es[5] - en[5]        # position 5 = tts_pad + E_c(lang)
    expected = talker.embed_codec(torch.tensor(cfg.talker.codec_language_id["spanish"])) - \
        talker.embed_codec(torch.tensor(cfg.talker.codec_language_id["english"]))
    torch.testing.assert_close(diff, expected.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(es[:5], en[:5])
    torch.testing.assert_close(es[6:], en[6:])


def test_incremental_xvector(setup, golden_npz):
    cfg, tok, builder = setup
    z = golden_npz("xvec_en")
    voice = VoicePrompt(torch.from_numpy(z["xvector"]))
    ids = tok.text_ids("Hello world, this is a streaming speech test.")
    assert builder.tokens_needed(voice) == 1 and builder.tokens_needed(voice, non_streaming=True) is None
    full = builder.build(ids, voice, "English")
    part = builder.build(ids[:3], voice, "English", text_complete=False)
    torch.testing.assert_close(part.embeds, full.embeds, atol=1e-6, rtol=0)
    assert part.trailing.shape[0] == 2                               # T[1:3], no tts_eos yet
    later = torch.cat([part.trailing, builder.embed_text(ids[3:]), builder.tts_eos[None]])
    torch.testing.assert_close(later, full.trailing, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="complete text"):
        builder.build(ids[:3], voice, "English", non_streaming=True, text_complete=False)
    with pytest.raises(ValueError, match="empty text"):
        builder.build([], voice, "English")


def test_icl_long_text_and_incremental(setup, golden_npz):
    """ICL with more text tokens than reference frames: the overflow (then tts_eos) is trailing (T6)."""
    cfg, tok, builder = setup
    z = golden_npz("ref_calib")
    ref_ids = tok.ref_text_ids("Calibration reference.")
    codes = torch.from_numpy(z["ref_codes"][:6])                    # Lc = 7 codec positions
    voice = VoicePrompt(torch.from_numpy(z["xvector"]), codes, ref_ids)
    ids = tok.text_ids("This target text is clearly longer than six reference frames.")
    lc, lt = codes.shape[0] + 1, len(ref_ids) + len(ids) + 1
    assert lt > lc
    full = builder.build(ids, voice, "English")
    talker = builder.talker
    text = torch.cat([talker.embed_text(torch.tensor(ref_ids + ids)), builder.tts_eos[None]])
    codec = torch.cat([talker.embed_codec(torch.tensor([cfg.talker.codec_bos_id])), talker.embed_frame(codes)])
    assert full.embeds.shape[0] == 9 + lc and full.trailing.shape[0] == lt - lc
    torch.testing.assert_close(full.embeds[9:], text[:lc] + codec, atol=1e-6, rtol=0)
    torch.testing.assert_close(full.trailing, text[lc:], atol=1e-6, rtol=0)
    # Incremental: the prefill needs enough target tokens for R ++ T to cover the Lc positions.
    need = builder.tokens_needed(voice)
    assert need == lc - len(ref_ids)
    with pytest.raises(ValueError, match=f"{need} text tokens"):
        builder.build(ids[:need - 1], voice, "English", text_complete=False)
    part = builder.build(ids[:need], voice, "English", text_complete=False)
    torch.testing.assert_close(part.embeds, full.embeds, atol=1e-6, rtol=0)
    assert part.trailing.shape[0] == 0
    rest = torch.cat([builder.embed_text(ids[need:]), builder.tts_eos[None]])
    torch.testing.assert_close(rest, full.trailing, atol=1e-6, rtol=0)
    # Short text (Lt <= Lc): padded with tts_pad, nothing trailing; non-streaming: text then frames.
    short = builder.build(tok.text_ids("Hi."), voice, "English")
    assert short.embeds.shape[0] == 9 + lc and short.trailing.shape[0] == 0
    ns = builder.build(ids, voice, "English", non_streaming=True)
    assert ns.embeds.shape[0] == 9 + lt + lc and ns.trailing.shape[0] == 0


def test_build_many_is_build_of_each_turn_with_one_text_call(setup, golden_npz, monkeypatch):
    """An admission's prompts from one E_t call over all their texts: the same embeddings as one
    `build` each (E_t is per token: GEMM blocking apart), every layout, and the turns `build`
    refuses get their error in their place."""
    cfg, tok, builder = setup
    z = golden_npz("ref_calib")
    xvec = VoicePrompt(torch.from_numpy(z["xvector"]))
    icl = VoicePrompt(xvec.xvector, torch.from_numpy(z["ref_codes"][:6]), tok.ref_text_ids("Calibration reference."))
    ids = tok.text_ids("A batch of prompts made at once.")
    turns = [(ids, xvec, "english"), (ids[:2], xvec, "auto", False, False), (ids, xvec, "chinese", True),
             (ids, icl, "english"), (ids, icl, "english", True), (ids[:1], icl, "english", False, False),
             ([], xvec, "english"), (ids[:2], xvec, "english", True, False), (tok.text_ids("Hi."), icl, "auto")]
    expected = []
    for turn in turns:
        try:
            expected.append(builder.build(*turn))
        except ValueError as e:
            expected.append(e)
    calls = []
    embed_text = builder.embed_text
    monkeypatch.setattr(builder, "embed_text", lambda ids: calls.append(len(ids)) or embed_text(ids))
    got = builder.build_many(turns)
    assert calls == [sum(len(builder.embedded_ids(t[0], t[1])) for t in turns)]
    for want, have in zip(expected, got):
        if isinstance(want, ValueError):
            assert isinstance(have, ValueError) and str(have) == str(want)
            continue
        torch.testing.assert_close(have.embeds, want.embeds, atol=1e-6, rtol=0)
        torch.testing.assert_close(have.trailing, want.trailing, atol=1e-6, rtol=0)
    assert sum(isinstance(p, ValueError) for p in got) == 3


def test_a_voices_head_is_made_once_per_language_and_forgotten_with_it(setup, monkeypatch):
    """Prompts of one voice reuse its head per language (the same positions as a fresh one); the
    cached heads go when the voice's x-vector does."""
    import gc
    cfg, tok, builder = setup
    fresh = PromptBuilder(builder.talker, cfg, tok)
    voice = VoicePrompt(torch.randn(cfg.talker.transformer.hidden_size))
    made = []
    new_head = fresh._new_head
    monkeypatch.setattr(fresh, "_new_head", lambda *a: (made.append(a[0]), new_head(*a))[1])
    ids = tok.text_ids("Hello world, twice over.")
    prompts = [fresh.build(ids, voice, language) for language in ("english", "english", "chinese", "en")]
    assert made == ["english", "chinese"]
    torch.testing.assert_close(prompts[1].embeds, builder.build(ids, voice, "english").embeds, rtol=0, atol=0)
    assert len(fresh._heads) == 1
    del voice, prompts
    gc.collect()
    assert len(fresh._heads) == 0
