"""Talker, code predictor and KV cache against the official implementation's golden data (tiny model, fp32)."""
import math

import pytest
import torch

from engine.config import TransformerConfig, load_config
from engine.kv_cache import KVCache
from engine.model.layers import DecoderStack, apply_rope, causal_mask, rope_cos_sin
from engine.model.talker import Talker
from engine.requests import SamplingParams
from engine.sampling import SamplingTensors, TalkerLogitsProcessor, mark_seen, sample_subtalker, sample_talker
from engine.weights import load_into, read_safetensors

CASES = ["xvec_en", "icl_en", "batch3_xvec", "batch3_icl"]
TOL = 1e-4


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return load_config(tiny_model_dir)


@pytest.fixture(scope="module")
def talker(cfg, tiny_model_dir):
    model = Talker(cfg.talker, cfg.predictor).eval()
    tensors = read_safetensors(tiny_model_dir / "model.safetensors")
    used = load_into(model, tensors, "talker.")
    assert used == {k for k in tensors if k.startswith("talker.")}
    torch.set_grad_enabled(False)
    yield model
    torch.set_grad_enabled(True)


def unpadded_prompts(z):
    """Golden left-padded prompts -> right-padded [B,P,D] and real lengths [B]."""
    embeds = torch.from_numpy(z["talker_inputs_embeds"])
    mask = torch.from_numpy(z["talker_attention_mask"]).bool()
    lengths = mask.sum(1)
    x = torch.zeros(embeds.shape[0], int(lengths.max()), embeds.shape[2])
    for b in range(embeds.shape[0]):
        x[b, :lengths[b]] = embeds[b][mask[b]]
    return x, lengths


def prefill(talker, z, slots=None, capacity=96):
    x, lengths = unpadded_prompts(z)
    cache = talker.new_cache(len(lengths), capacity)
    hidden = talker(x, cache, torch.zeros(len(lengths), dtype=torch.long), slots=slots)
    return cache, lengths, hidden[torch.arange(len(lengths)), lengths - 1]


def text_term(z, k):
    trailing = torch.from_numpy(z["trailing_text_hidden"])
    return trailing[:, k] if k < trailing.shape[1] else torch.from_numpy(z["tts_pad_embed"])[:, 0]


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits(talker, golden_npz, case):
    z = golden_npz(case)
    b = z["talker_inputs_embeds"].shape[0]
    slots = torch.arange(b).flip(0)                        # rows land in arbitrary slots
    cache, lengths, h = prefill(talker, z, slots=slots)
    logits = talker.logits(h)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, torch.from_numpy(z["talker_logits"][:, 0]), atol=TOL, rtol=0)
    torch.testing.assert_close(h, torch.from_numpy(z["cp_first_inputs_embeds"][:, 0]), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_decode_steps_follow_golden_codes(talker, golden_npz, case):
    """Feed the golden frames back: every decode step's logits match the official run's."""
    z = golden_npz(case)
    cache, lengths, _ = prefill(talker, z)
    codes = torch.stack([torch.from_numpy(z[f"codes_{i}"]) for i in range(len(lengths))])   # [B, F, 16]
    want = torch.from_numpy(z["talker_logits"])
    for k in range(codes.shape[1]):
        x = talker.embed_frame(codes[:, k]) + text_term(z, k)
        kmax = -(-(int(lengths.max()) + k + 1) // 16) * 16          # a bucketed key span
        hidden = talker(x[:, None], cache, lengths + k, kmax=kmax)
        torch.testing.assert_close(talker.logits(hidden[:, 0]), want[:, k + 1], atol=TOL, rtol=0,
                                   msg=lambda m: f"step {k + 1}: {m}")


def greedy_sub_fn(params, frame, record):
    def fn(logits, group, embed):
        record.append(logits)
        return sample_subtalker(logits, group, frame, params, embed=embed)
    return fn


@pytest.mark.parametrize("case", CASES)
def test_code_predictor_first_frame(talker, golden_npz, case):
    z = golden_npz(case)
    cp_in = torch.from_numpy(z["cp_first_inputs_embeds"])
    c0 = torch.from_numpy(z["talker_sequences"][:, 0])
    torch.testing.assert_close(talker.embed_codec(c0), cp_in[:, 1], atol=0, rtol=0)
    b = len(c0)
    params = SamplingTensors.from_params([SamplingParams(greedy=True)] * b)
    record = []
    cache = talker.code_predictor.new_cache(b + 2)          # a bigger, reused cache works too
    for _ in range(2):                                      # second frame reuses the cache unreset
        record.clear()
        codes = talker.predict_codes(cp_in[:, 0], c0, greedy_sub_fn(params, torch.zeros(b, dtype=torch.long), record), cache)
        torch.testing.assert_close(torch.stack(record, 1), torch.from_numpy(z["cp_first_logits"]), atol=TOL, rtol=0)
        assert torch.equal(codes, torch.from_numpy(z["cp_first_sequences"]))
    for i in range(b):
        assert torch.equal(codes[i], torch.from_numpy(z[f"codes_{i}"][0, 1:]))


def embed_frame_reference(talker, codes):
    """Sum of the 16 embeddings as separate lookups (the definition, MODEL.md 5.6)."""
    out = talker.model.codec_embedding(codes[..., 0])
    for g in range(1, 16):
        out = out + talker.code_predictor.model.codec_embedding[g - 1](codes[..., g])
    return out


def test_embed_frame(talker, golden_npz):
    codes = torch.from_numpy(golden_npz("batch3_xvec")["codes_1"][:5])
    emb = talker.embed_frame(codes)
    assert emb.shape == (5, 32)
    torch.testing.assert_close(emb, embed_frame_reference(talker, codes), atol=1e-6, rtol=0)
    assert talker.embed_text(torch.tensor([[151671]])).shape == (1, 1, 32)
    torch.testing.assert_close(talker.embed_text(torch.tensor([151671])),
                               torch.from_numpy(golden_npz("xvec_en")["tts_pad_embed"][0]), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ["xvec_en", "batch3_icl", "batch2_eos"])
def test_greedy_generation_reproduces_golden_codes(talker, cfg, golden_npz, case):
    """Prefill + decode loop with the public pieces (as a runner drives them): exact golden codes."""
    z = golden_npz(case)
    cache, lengths, h = prefill(talker, z)
    b, vocab, eos = len(lengths), cfg.talker.vocab_size, cfg.talker.codec_eos_token_id
    params = SamplingTensors.from_params([SamplingParams(greedy=True)] * b)   # penalty 1.05 still applies
    proc = TalkerLogitsProcessor(vocab, eos)
    seen = torch.zeros(b, vocab, dtype=torch.bool)
    cp_cache = talker.code_predictor.new_cache(b)
    generated = torch.zeros(b, dtype=torch.long)
    tokens, frames, done = [], [], torch.zeros(b, dtype=torch.bool)
    logits = talker.logits(h)
    for k in range(32):
        c0 = sample_talker(proc, logits, seen, generated, params)
        c0 = torch.where(done, eos, c0)
        tokens.append(c0)
        done |= c0 == eos
        if done.all() or k == 31:
            break
        mark_seen(seen, c0)
        generated += 1
        rest = talker.predict_codes(h, c0, greedy_sub_fn(params, generated - 1, []), cp_cache)
        frame = torch.cat([c0[:, None], rest], 1)
        frames.append(frame)
        hidden = talker(talker.embed_frame(frame)[:, None] + text_term(z, k)[:, None], cache, lengths + k)
        h = hidden[:, 0]
        logits = talker.logits(h)
    tokens, frames = torch.stack(tokens, 1), torch.stack(frames, 1)
    assert torch.equal(tokens, torch.from_numpy(z["talker_sequences"]))
    for i in range(b):
        want = torch.from_numpy(z[f"codes_{i}"])
        assert torch.equal(frames[i, :len(want)], want)


def test_ragged_batch_equals_rows_alone(talker):
    """Rows of different lengths and start positions in one forward == each row alone (fp32, 1e-5)."""
    torch.manual_seed(0)
    d = 32
    history = [torch.randn(n, d) for n in (3, 0, 7)]
    new = [torch.randn(n, d) for n in (5, 9, 2)]
    b, t = 3, 9
    cache = talker.new_cache(4, 32)
    starts = torch.tensor([len(x) for x in history])
    slots = torch.tensor([3, 0, 2])
    for i in range(b):                                          # each row's history, written separately
        if len(history[i]):
            talker(history[i][None], cache, torch.zeros(1, dtype=torch.long), slots=slots[i:i + 1])
    x = torch.zeros(b, t, d)
    for i in range(b):
        x[i, :len(new[i])] = new[i]
    out = talker(x, cache, starts, slots=slots, kmax=20)
    for i in range(b):
        alone = talker.new_cache(1, 32)
        full = torch.cat([history[i], new[i]])[None]
        ref = talker(full, alone, torch.zeros(1, dtype=torch.long))[0, len(history[i]):]
        torch.testing.assert_close(out[i, :len(new[i])], ref, atol=1e-5, rtol=0)
    # one decode step over slots 0..3 with different positions == each row alone
    lengths = torch.zeros(4, dtype=torch.long)
    lengths[slots] = starts + torch.tensor([len(n) for n in new])
    step = torch.randn(4, 1, d)
    out = talker(step, cache, lengths, kmax=16)
    for i in range(b):
        s = slots[i]
        alone = talker.new_cache(1, 32)
        full = torch.cat([history[i], new[i], step[s]])[None]
        ref = talker(full, alone, torch.zeros(1, dtype=torch.long))[0, -1]
        torch.testing.assert_close(out[s, 0], ref, atol=1e-5, rtol=0)


def slot_kv(cache, slot, n):
    """K and V [layers, n, kv_heads, head_dim] of positions 0..n-1 of `slot`."""
    kv = [cache.read(layer, 1, n, torch.tensor([slot])) for layer in range(cache.num_layers)]
    return torch.stack([k[0] for k, _ in kv]), torch.stack([v[0] for _, v in kv])


def test_padded_writes_never_corrupt(talker):
    torch.manual_seed(1)
    d, cap = 32, 8
    cache = talker.new_cache(3, cap)
    # slot 2 holds a full-length sequence that must survive the batch below untouched
    talker(torch.randn(1, cap, d), cache, torch.zeros(1, dtype=torch.long), slots=torch.tensor([2]))
    k2, v2 = slot_kv(cache, 2, cap)
    # slot 0: 8 real tokens (the whole capacity) in a batch padded to 11; slot 1: 4 real tokens + junk
    real0, real1 = torch.randn(8, d), torch.randn(4, d)
    x = torch.randn(2, 11, d) * 100                              # junk everywhere ...
    x[0, :8], x[1, :4] = real0, real1                           # ... but the real tokens
    talker(x, cache, torch.zeros(2, dtype=torch.long), slots=torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(slot_kv(cache, 2, cap), (k2, v2)))
    ref = talker.new_cache(2, cap)
    talker(real0[None], ref, torch.zeros(1, dtype=torch.long), slots=torch.tensor([0]))
    talker(real1[None], ref, torch.zeros(1, dtype=torch.long), slots=torch.tensor([1]))
    torch.testing.assert_close(slot_kv(cache, 0, cap), slot_kv(ref, 0, cap), atol=1e-6, rtol=0)
    torch.testing.assert_close(slot_kv(cache, 1, 4), slot_kv(ref, 1, 4), atol=1e-6, rtol=0)
    # slot 1's junk at positions 4..10 is invisible to its next decode step at position 4
    step = torch.randn(2, 1, d)
    out = talker(step, cache, torch.tensor([7, 4]), kmax=cap)[1, 0]
    alone = talker.new_cache(1, cap)
    want = talker(torch.cat([real1, step[1]])[None], alone, torch.zeros(1, dtype=torch.long))[0, -1]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        cache.read(0, 1, cap + 1)


def test_gqa_repeat_interleave_layout():
    """KV head j serves Q heads j*g .. j*g+g-1 (the tiny golden model has a single KV head)."""
    torch.manual_seed(3)
    tc = TransformerConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8)
    stack = DecoderStack(tc)
    for p in stack.parameters():
        p.data.normal_(0, 0.5)
    attn = stack.layers[0].self_attn
    b, t = 2, 5
    x = torch.randn(b, t, 16)
    start = torch.tensor([0, 3])
    cache = KVCache(1, 2, 16, 2, 8, torch.float32, "cpu", page_size=4, reserve_all=True)
    pos = start[:, None] + torch.arange(t)
    cos, sin = rope_cos_sin(pos, stack.inv_freq, x.dtype)
    mask = causal_mask(start, t, 16)
    out = attn(x, cos, sin, cache, 0, start, None, mask)
    # reference: explicit repeat_interleave of K/V over this step's keys plus the cached (zero) ones
    q = apply_rope(attn.q_norm(attn.q_proj(x).view(b, t, 4, 8)).transpose(1, 2), cos, sin)
    keys, values = (x.transpose(1, 2) for x in cache.read(0, 2, 16))
    k, v = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(~mask, float("-inf"))
    ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 32)
    torch.testing.assert_close(out, attn.o_proj(ref), atol=1e-5, rtol=0)
    # the tiled layout (KV head j serving heads j, j+2) gives something else
    k_tiled, v_tiled = keys.repeat(1, 2, 1, 1), values.repeat(1, 2, 1, 1)
    tiled = ((q @ k_tiled.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, float("-inf")).softmax(-1) @ v_tiled)
    assert (attn.o_proj(tiled.transpose(1, 2).reshape(b, t, 32)) - out).abs().max() > 1e-2


def test_fused_projections_equal_separate_ones(tiny_model_dir, golden_npz):
    """The GPU layout (fused QKV / gate-up GEMMs, QK-norm + RoPE in one op) computes the same logits."""
    from engine.loader import load_model
    model = load_model(tiny_model_dir)
    g = golden_npz("xvec_en")
    x = torch.from_numpy(g["talker_inputs_embeds"])
    start = torch.zeros(1, dtype=torch.long)

    def logits():
        cache = model.talker.new_cache(1, x.shape[1] + 1)
        return model.talker.logits(model.talker(x, cache, start))

    separate = logits()
    model.talker.model.fuse()
    fused = logits()
    assert model.talker.model.layers[0].self_attn.q_proj.weight.data_ptr() == \
        model.talker.model.layers[0].self_attn.qkv_weight.data_ptr()          # views, no copy of the weights
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=0)
    model.talker.model.fuse(enabled=False)
    torch.testing.assert_close(logits(), separate, atol=0, rtol=0)
