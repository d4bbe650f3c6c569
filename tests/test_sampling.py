"""Logits processing (MODEL.md 6.2 / 6.3) and seeded, batch-invariant sampling."""

import pytest
import torch

from engine.requests import SamplingParams
from engine.sampling import (subtalker_noise, SamplingTensors, TalkerLogitsProcessor, gumbel_noise, mark_seen, random_bits,
                             repetition_penalty, sample, sample_subtalker, sample_talker, warp)

V, EOS = 3072, 2150
INF = float("inf")


def tensors(n=1, **kw):
    return SamplingTensors.from_params([SamplingParams(**kw)] * n)


def test_repetition_penalty_sign_rule_and_duplicates_once():
    logits = torch.tensor([[2.0, -2.0, 3.0, -0.5, 0.0]])
    seen = torch.zeros(1, 5, dtype=torch.bool)
    for i in (0, 1, 1, 1, 4):                       # id 1 "generated" three times
        mark_seen(seen, torch.tensor([i]))
    out = repetition_penalty(logits, seen, torch.tensor([1.05]))
    f32 = torch.tensor
    expected = torch.stack([f32(2.0) / 1.05, f32(-2.0) * 1.05, f32(3.0), f32(-0.5), f32(0.0) / 1.05])[None]
    assert torch.equal(out, expected)
    assert out[0, 0] < 2.0 and out[0, 1] < -2.0          # both pushed down: divide positive, multiply negative
    # bit-exact with the HF processor's fp32 ops against the python float penalty
    x = torch.randn(1, 4096) * 5
    hf = torch.where(x < 0, x * 1.05, x / 1.05)
    assert torch.equal(repetition_penalty(x, torch.ones_like(x, dtype=torch.bool), torch.tensor([1.05])), hf)


def test_talker_processor_min_new_tokens_and_suppression():
    proc = TalkerLogitsProcessor(V, EOS)
    logits = torch.zeros(3, V)
    none_seen = torch.zeros(3, V, dtype=torch.bool)
    out = proc(logits, none_seen, torch.tensor([0, 1, 2]), torch.ones(3), torch.tensor([2, 2, 2]))
    assert torch.isinf(out[:2, EOS]).all() and out[2, EOS] == 0          # EOS blocked for steps 0, 1
    assert torch.isinf(out[:, 2048:EOS]).all() and torch.isinf(out[:, EOS + 1:]).all()
    assert (out[:, :2048] == 0).all()
    # a per-row minimum (benchmarks suppress EOS for fixed-length turns)
    out = proc(logits, none_seen, torch.tensor([5, 5, 5]), torch.ones(3), torch.tensor([2, 6, 100]))
    assert out[0, EOS] == 0 and torch.isinf(out[1:, EOS]).all()


def test_greedy_still_penalised():
    proc = TalkerLogitsProcessor(V, EOS)
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 9] = 1.0, 0.99          # 7 wins unless penalised (1/1.05 < 0.99)
    p = tensors(greedy=True)
    seen = torch.zeros(1, V, dtype=torch.bool)
    gen = torch.tensor([5])
    assert sample_talker(proc, logits, seen, gen, p).item() == 7
    mark_seen(seen, torch.tensor([7]))
    assert sample_talker(proc, logits, seen, gen, p).item() == 9


def test_temperature_and_top_k_ties_survive():
    logits = torch.tensor([[4.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    out = warp(logits, torch.tensor([2.0]), torch.tensor([2]), torch.tensor([1.0], dtype=torch.float64))
    assert torch.equal(out, torch.tensor([[2.0, 1.0, 1.0, 1.0, -INF, -INF]]))
    # top_k <= 0 disables, top_k > vocab keeps all
    for k in (0, 100):
        assert torch.isfinite(warp(logits, torch.ones(1), torch.tensor([k]), torch.ones(1, dtype=torch.float64))).all()


def hf_top_p(scores, top_p):
    """transformers TopPLogitsWarper.__call__ (min_tokens_to_keep=1)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
    sorted_indices_to_remove[..., -1:] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
    return scores.masked_fill(indices_to_remove, -INF)


def test_top_p_matches_hf_and_skips_at_one():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    top_p = torch.tensor([0.9, 0.5, 0.05, 1.0], dtype=torch.float64)
    out = warp(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), top_p)
    for b, p in enumerate(top_p.tolist()):
        want = logits[b:b + 1] if p == 1.0 else hf_top_p(logits[b:b + 1], p)
        assert torch.equal(out[b:b + 1], want)
    assert torch.isfinite(out[2]).sum() >= 1 and torch.isfinite(out[3]).all()
    # a probability that underflows to 0 must still survive top_p == 1 (HF skips the warper)
    tiny = torch.tensor([[0.0, -200.0]])
    assert torch.isfinite(warp(tiny, torch.ones(1), torch.zeros(1, dtype=torch.long),
                               torch.ones(1, dtype=torch.float64))).all()


def test_hash_is_splitmix64():
    def mix(z):
        m = (1 << 64) - 1
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    seed, frame, group = 123456789, 7, 3
    bits = random_bits(torch.tensor([seed]), torch.tensor([frame]), group, 8)[0].tolist()
    for tok, got in enumerate(bits):
        counter = (((frame * 32 + group) << 12) + tok)
        want = mix((mix(seed) + counter * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))
        assert got % (1 << 64) == want
    g = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 0, 2048)
    assert torch.isfinite(g).all() and abs(g.mean().item() - 0.5772) < 0.01   # Euler-Mascheroni


def test_seeded_sampling_reproducible_and_batch_invariant():
    torch.manual_seed(1)
    proc = TalkerLogitsProcessor(V, EOS)
    params = [SamplingParams(seed=s, temperature=0.5 + 0.1 * s, top_k=10 * s, top_p=[1.0, 0.8][s % 2])
              for s in range(8)]
    batch = SamplingTensors.from_params(params)
    alone = SamplingTensors.from_params(params[3:4])
    logits = torch.randn(8, V) * 2
    seen = torch.rand(8, V) < 0.01
    gen = torch.tensor([0, 3, 9, 4, 1, 30, 2, 5])
    for step in range(5):
        ids = sample_talker(proc, logits, seen, gen + step, batch)
        one = sample_talker(proc, logits[3:4], seen[3:4], gen[3:4] + step, alone)
        again = sample_talker(proc, logits, seen, gen + step, batch)
        assert ids[3] == one[0] and torch.equal(ids, again)
        for group in (1, 15):
            sub = sample_subtalker(logits[:, :2048], group, gen + step, batch)
            sub1 = sample_subtalker(logits[3:4, :2048], group, gen[3:4] + step, alone)
            assert sub[3] == sub1[0]
    # different frames / codebooks / seeds give different draws
    flat = torch.zeros(1, 2048)
    draws = {sample(flat, torch.tensor([False]), torch.ones(1), torch.zeros(1, dtype=torch.long),
                    torch.ones(1, dtype=torch.float64), torch.tensor([s]), torch.tensor([f]), g).item()
             for s in range(3) for f in range(3) for g in range(3)}
    assert len(draws) > 20


def test_empirical_distribution_matches_softmax():
    n = 20000
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    probs = logits.softmax(-1)
    ids = sample(logits.expand(n, -1), torch.zeros(n, dtype=torch.bool), torch.ones(n),
                 torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.float64),
                 torch.arange(n), torch.zeros(n, dtype=torch.long), 0)
    counts = torch.bincount(ids, minlength=6).double()
    expected = probs.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 30, (counts, expected)                    # df = 5; p(chi2 > 30) ~ 1.5e-5
    # temperature + top-k renormalise over the survivors; one row over many frames also follows it
    ids = sample(logits.expand(n, -1), torch.zeros(n, dtype=torch.bool), torch.full((n,), 0.7),
                 torch.full((n,), 3, dtype=torch.long), torch.ones(n, dtype=torch.float64),
                 torch.full((n,), 42), torch.arange(n), 2)
    counts = torch.bincount(ids, minlength=6).double()
    kept = torch.tensor([0, 3, 4])
    p = (logits[kept] / 0.7).softmax(-1).double() * n
    assert counts.sum() == counts[kept].sum()
    assert ((counts[kept] - p) ** 2 / p).sum().item() < 25   # df = 2


def test_greedy_is_argmax_first_index():
    torch.manual_seed(2)
    logits = torch.randn(5, 2048)
    logits[0, 10] = logits[0, 20] = 100.0                   # tie: first index wins
    p = tensors(5, greedy=True, seed=0)
    ids = sample_subtalker(logits, 4, torch.zeros(5, dtype=torch.long), p)
    assert torch.equal(ids, logits.argmax(-1)) and ids[0] == 10


def test_params_from_sampling_params():
    p = SamplingTensors.from_params([SamplingParams(greedy=True), SamplingParams(subtalker_greedy=True, seed=5),
                                     SamplingParams(top_p=0.9)])
    assert p.greedy.tolist() == [True, False, False] and p.sub_greedy.tolist() == [True, True, False]
    assert p.seed[1] == 5 and p.talker_top_p_any and not p.sub_top_p_any
    state = tensors(4, seed=0)
    state.assign(torch.tensor([2]), SamplingTensors.from_params([SamplingParams(seed=9, top_k=7)]))
    assert state.seed.tolist() == [0, 0, 9, 0] and state.top_k.tolist() == [50, 50, 7, 50]
    assert state.head(2).seed.shape == (2,) and state.head(2).seed.data_ptr() == state.seed.data_ptr()
    assert state.rows(torch.tensor([2, 0])).top_k.tolist() == [7, 50]
    with pytest.raises(ValueError):
        SamplingTensors.from_params([SamplingParams(temperature=0.0)])
    with pytest.raises(ValueError):
        SamplingTensors.from_params([SamplingParams(top_p=0.0)])


def test_subtalker_noise_of_a_frame_equals_per_codebook_draws():
    seed, frame = torch.tensor([3, 99, 2 ** 62]), torch.tensor([0, 7, 1000])
    batched = subtalker_noise(seed, frame, 15, 2048)
    for g in range(1, 16):
        assert torch.equal(batched[:, g - 1], gumbel_noise(seed, frame, g, 2048))
