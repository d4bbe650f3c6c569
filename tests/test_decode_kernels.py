"""The fused decode path (engine/model/kernels/) computes what the plain ops compute.

The kernels run in Triton's interpreter on the CPU here (tests/triton_cpu.py), in fp32, where the
fused and plain paths agree to rounding; on the GPU `bench/precision.py` compares them in bf16.
"""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.model.layers import Attention, RMSNorm, causal_mask, rope_cos_sin, rope_inv_freq
from engine.requests import SamplingParams, SpeechRequest
from engine.runner import ModelRunner
from engine.synth import synthesize
from tests.test_golden_generation import golden_requests
from tests.triton_cpu import require_triton


@pytest.fixture(scope="module")
def kernels():
    return require_triton()


def test_rms_norm_matches_torch(kernels):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 2, 96, generator=g), torch.rand(96, generator=g) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6), atol=1e-6, rtol=0)


def test_silu_mul_matches_torch(kernels):
    gu = torch.randn(5, 2, 2 * 96, generator=torch.Generator().manual_seed(1)) * 3
    torch.testing.assert_close(kernels.silu_mul(gu), kernels.silu_mul_reference(gu), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("with_plus", [False, True])
def test_embedding_sum_matches_torch(kernels, with_plus):
    """A frame's 16 lookups summed (tables of different sizes, allocated apart), then the text term."""
    g = torch.Generator().manual_seed(3)
    tables = [torch.randn(v, 96, generator=g) for v in (70, 50, 50, 50)]
    ids = torch.tensor([[3, 0, 49, 7], [69, 1, 2, 49], [0, 0, 0, 0]])
    plus = torch.randn(3, 96, generator=g) if with_plus else None
    expected = torch.stack([F.embedding(ids[:, i], t) for i, t in enumerate(tables)], dim=1).sum(dim=1)
    expected = expected if plus is None else expected + plus
    torch.testing.assert_close(kernels.embedding_sum(ids, tables, plus), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("t", [1, 2])
def test_decode_attention_matches_the_plain_attention(kernels, t):
    """The pre-norm, QK-norm, RoPE, the K/V write, causal GQA attention over ragged rows and the
    residual add, through the page table of a cache whose pages are tensors of their own (as on
    CUDA) against the plain attention over a one-pool cache; a row at the cache's end writes only the
    scratch page, and no other slot's K/V changes."""
    torch.manual_seed(2)
    heads, kv_heads, head_dim, hidden, cap, b, page = 4, 2, 32, 64, 40, 3, 16
    attn = Attention(hidden, heads, kv_heads, head_dim, 1e-6)
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    inv_freq = rope_inv_freq(head_dim, 1e6)
    plain, fused = (KVCache(1, b + 1, cap, kv_heads, head_dim, torch.float32, "cpu", page_size=page,
                            reserve_all=True, separate_pages=separate) for separate in (False, True))
    earlier = torch.randn(b + 1, cap, kv_heads, head_dim), torch.randn(b + 1, cap, kv_heads, head_dim)
    for c in (plain, fused):          # earlier keys, identical in both (slot b is not in the batch)
        c.write(0, *earlier, torch.zeros(b + 1, dtype=torch.long))
    start = torch.tensor([0, 17, cap + 1 - t])       # row 2 ends in the scratch page
    x = torch.randn(b, t, hidden)
    cos, sin = rope_cos_sin(start[:, None] + torch.arange(t), inv_freq, x.dtype)
    with torch.no_grad():
        expected = x + attn(norm(x), cos, sin, plain, 0, start, None, causal_mask(start, t, cap))
        attn.fuse()
        got = attn.decode(x, norm, fused, 0, start, inv_freq)
    torch.testing.assert_close(got[:2], expected[:2], atol=1e-5, rtol=0)    # row 2's output is never used
    for a, e in zip(fused.read(0, b + 1, cap), plain.read(0, b + 1, cap)):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)
    assert torch.equal(fused.read(0, b + 1, cap)[0][b], earlier[0][b])


@pytest.mark.parametrize("t", [1, 2])
def test_split_attention_matches_the_one_program_attention(kernels, t):
    """A row's keys cut over 2 or 4 programs a KV head, their softmax partials merged by the last to
    arrive, give what one program gives, with the same cache writes; rows whose later programs hold no
    key included (six blocks over four programs), and rows of fewer than SPLIT blocks, which one
    program does whole (one key; 40 keys over 4 programs, but cut over 2). The arrival counters are
    zero again after every launch."""
    torch.manual_seed(4)
    heads, kv_heads, head_dim, b, cap = 4, 2, 32, 3, 80
    caches = [KVCache(1, b, cap, kv_heads, head_dim, torch.float32, "cpu", page_size=16, reserve_all=True,
                      separate_pages=True) for _ in range(2)]
    earlier = torch.randn(b, cap, kv_heads, head_dim), torch.randn(b, cap, kv_heads, head_dim)
    for c in caches:
        c.write(0, *earlier, torch.zeros(b, dtype=torch.long))
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * head_dim)
    start = torch.tensor([0, 39, cap + 1 - t])       # 1 key (t = 1); 3 blocks of 16; the cache's end
    w = torch.rand(head_dim) + 0.5
    args = (heads, kv_heads, w, w, 1e-6, rope_inv_freq(head_dim, 1e6))
    expected = kernels.decode_attention(qkv, *args, caches[0], 0, start, kernels.ATTENTION_CONFIGS[0])
    splits = [c for c in kernels.ATTENTION_CONFIGS if c["SPLIT"] > 1]
    assert {c["SPLIT"] for c in splits} == {2, 4}
    for config in splits:
        got = kernels.decode_attention(qkv, *args, caches[1], 0, start, config)
        torch.testing.assert_close(got[:2], expected[:2], atol=1e-5, rtol=0, msg=str(config))
        for a, e in zip(caches[1].read(0, b, cap), caches[0].read(0, b, cap)):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=0)
        counters = kernels.attention._arrival_counters(torch.device("cpu"), f"split attention, {t} positions",
                                                       b * kv_heads)
        assert not counters.any()



@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (16, 8)])
def test_short_attention_matches_the_program_per_head(kernels, t, heads, kv_heads):
    """Over a short cache, every `_short_attention_kernel` config (all of a row's KV heads in one
    program, or a few) gives what one program per KV head gives, and writes the same new keys and
    values: rows with no older key and with most of the cache's, over two pages of their own."""
    torch.manual_seed(5)
    head_dim, cap, b = 32, 32, 2
    caches = [KVCache(1, b, cap, kv_heads, head_dim, torch.float32, "cpu", page_size=16, reserve_all=True,
                      separate_pages=True) for _ in range(2)]
    earlier = torch.randn(b, cap, kv_heads, head_dim), torch.randn(b, cap, kv_heads, head_dim)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * head_dim)
    start = torch.tensor([0, cap - t])
    qw, kw = torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5
    args = (heads, kv_heads, qw, kw, 1e-6, rope_inv_freq(head_dim, 1e6))
    caches[0].write(0, *earlier, torch.zeros(b, dtype=torch.long))
    expected = kernels.decode_attention(qkv, *args, caches[0], 0, start, kernels.ATTENTION_CONFIGS[0])
    short = [c for c in kernels.attention_configs(caches[1]) if "KVH" in c]
    assert {c["KVH"] for c in short} == ({1, 2} if kv_heads == 2 else {1, 2, 4, 8})
    for config in short:
        caches[1].write(0, *earlier, torch.zeros(b, dtype=torch.long))
        got = kernels.decode_attention(qkv, *args, caches[1], 0, start, config)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=str(config))
        for a, e in zip(caches[1].read(0, b, cap), caches[0].read(0, b, cap)):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=0)


def test_short_attention_is_offered_for_short_caches_only(kernels, monkeypatch):
    """The code predictor's cache (16 positions, 8 KV heads) gets the short kernel's configs, each
    within the key tile's limit; the talker's does not, nor does any with QWEN3_TTS_SHORT_ATTENTION=0."""
    predictor = KVCache(1, 4, 16, 8, 128, torch.float32, "cpu", page_size=16, reserve_all=True)
    talker = KVCache(1, 1, 512, 8, 128, torch.float32, "cpu", page_size=64, reserve_all=True)
    short = [c for c in kernels.attention_configs(predictor) if "KVH" in c]
    assert short == kernels.attention.SHORT_ATTENTION_CONFIGS
    assert kernels.attention_configs(talker) == kernels.ATTENTION_CONFIGS
    monkeypatch.setattr(kernels.attention, "SHORT_ATTENTION", False)
    assert kernels.attention_configs(predictor) == kernels.ATTENTION_CONFIGS


@pytest.fixture(scope="module")
def fused_model(tiny_model_dir, kernels):
    """The model on the fused decode path (the GEMM, attention and sampling kernels)."""
    model = load_model(tiny_model_dir)
    for stack in (model.talker.model, model.talker.code_predictor.model):
        stack.fuse()
        stack.fused_decode = True      # as on CUDA; here the interpreter runs the kernels
    return model


@pytest.mark.parametrize("name", ["xvec_eos", "batch3_icl"])
def test_fused_decode_reproduces_golden_codes(fused_model, golden_cases, golden_npz, name):
    """Greedy codes through the fused decode path equal the official implementation's."""
    z = golden_npz(name)
    results = synthesize(fused_model, golden_requests(fused_model, golden_cases[name], z, max_frames=8))
    for i, res in enumerate(results):
        n = res.codes.shape[0]
        np.testing.assert_array_equal(res.codes, z[f"codes_{i}"][:n])
        assert n == min(8, z[f"codes_{i}"].shape[0])


def test_fused_decode_reproduces_golden_codes_through_the_short_attention(fused_model, golden_cases, golden_npz,
                                                                         kernels, monkeypatch):
    """The same with the code predictor's attention in `_short_attention_kernel` (the GPU's timing may
    pick it; off the GPU the first config, one program a KV head, runs)."""
    fastest = kernels.launch.fastest

    def short_first(key, configs, *args, **kwargs):
        return next((c for c in configs if "KVH" in c), None) or fastest(key, configs, *args, **kwargs)
    monkeypatch.setattr(kernels.attention, "fastest", short_first)
    z = golden_npz("batch3_icl")
    results = synthesize(fused_model, golden_requests(fused_model, golden_cases["batch3_icl"], z, max_frames=8))
    for i, res in enumerate(results):
        np.testing.assert_array_equal(res.codes, z[f"codes_{i}"][:res.codes.shape[0]])


def test_fused_decode_samples_the_same_frames(tiny_model_dir, fused_model):
    """Seeded sampling over rows of different lengths: the same frames with and without the kernels."""
    plain = load_model(tiny_model_dir)
    d = plain.config.talker.transformer.hidden_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randn(n, d, generator=g) * 0.5 for n in (7, 3)]
    text = torch.randn(2, d, generator=g) * 0.5
    frames = []
    for model in (plain, fused_model):
        runner = ModelRunner(model, 2, 32)
        runner.admit([0, 1], [SamplingParams(seed=11), SamplingParams(seed=12, temperature=0.7)], [20, 20])
        runner.prefill([0, 1], prompts)
        frames.append(torch.stack([runner.step(2, [True, i != 1], text).result().frames for i in range(4)]))
    torch.testing.assert_close(frames[1], frames[0], atol=0, rtol=0)


def test_fused_decode_past_16_rows_leaves_its_input_alone(tiny_model_dir, fused_model):
    """Past 16 rows a stack's residual adds are cuBLAS's into its own buffer (no copy of the residual
    first): the talker's decode forward of 18 rows over earlier keys is the plain forward's, and the
    input it was given is left as it was."""
    plain = load_model(tiny_model_dir).talker.model
    fused = fused_model.talker.model
    t = plain.layers[0].self_attn
    g = torch.Generator().manual_seed(9)
    b, cap = 18, 32
    caches = [KVCache(len(plain.layers), b, cap, t.kv_heads, t.head_dim, torch.float32, "cpu", page_size=16,
                      reserve_all=True) for _ in range(2)]
    for layer in range(len(plain.layers)):
        earlier = [torch.randn(b, cap, t.kv_heads, t.head_dim, generator=g) for _ in range(2)]
        for c in caches:
            c.write(layer, *earlier, torch.zeros(b, dtype=torch.long))
    start = torch.randint(0, cap - 1, (b,), generator=g)
    x = torch.randn(b, 1, fused.norm.weight.shape[0], generator=g)
    given = x.clone()
    with torch.no_grad():
        expected = plain(x, caches[0], start, kmax=cap)
        got = fused(x, caches[1], start, kmax=cap)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(x, given)


def test_advance_rows_matches_the_tensor_ops(kernels, tiny_model_dir):
    """The end of a decode step in one kernel: a row that moves (active and alive) takes the new hidden
    state and c0, marks the c0 seen and counts a c0 and a position; one that samples EOS, passes its
    frame limit or fills the cache stops; rows inactive or finished keep their state. The same state
    and packed rows as the runner's tensor ops."""
    from engine.runner import EOS, LIMIT, RUNNING
    runner = ModelRunner(load_model(tiny_model_dir), 6, 32)
    g = torch.Generator().manual_seed(8)
    d, v = runner.h.shape[1], runner.seen.shape[1]
    # rows: moves; samples EOS; passes its limit; fills the cache; inactive; finished earlier
    act = torch.tensor([True, True, True, True, False, True])
    new_c0 = torch.tensor([5, runner.eos_id, 7, 9, 11, 13])
    hidden, frames = torch.randn(6, d, generator=g), torch.randint(0, 2048, (6, 16), generator=g)

    def state():
        return kernels.RowState(torch.tensor([True, True, True, True, True, False]), torch.randn(6, d, generator=g),
                                torch.tensor([1, 2, 3, 4, 5, 6]), torch.rand(6, v, generator=g) < 0.1,
                                torch.tensor([3, 4, 10, 2, 1, 6]), torch.tensor([10, 12, 15, 31, 5, 9]),
                                torch.tensor([20, 20, 10, 20, 20, 20]))
    before = state()
    expected_state, got_state = (kernels.RowState(*(t.clone() for t in before)) for _ in range(2))
    expected = runner._advance(act, new_c0, hidden, frames, expected_state)
    got = kernels.advance_rows(act, new_c0, hidden, frames, got_state, runner.eos_id, runner.capacity,
                               (RUNNING, EOS, LIMIT))
    assert expected[:, 16].tolist() == [RUNNING, EOS, LIMIT, LIMIT, RUNNING, RUNNING]
    assert expected[:, 17].tolist() == [1, 1, 1, 1, 0, 0]
    assert torch.equal(got, expected)
    for name, a, e, b in zip(kernels.RowState._fields, got_state, expected_state, before):
        assert torch.equal(a, e), name
        assert torch.equal(a[4:], b[4:]), name               # the rows that did not move: untouched
    assert got_state.alive.tolist() == [True, False, False, False, True, False]


@pytest.mark.parametrize("radix_bits", [4, 8])
def test_sample_rows_matches_plain_sampling(kernels, radix_bits):
    """Greedy rows, temperatures, top-k of 0 (off), 1, 50 and past the vocab, suppressed (-inf) ids,
    tied logits, and logits that share their high bits (the k-th largest told apart only in the
    last digits, either sign): the same ids as `sample` without top-p, with each top-k search the GPU
    may pick."""
    config = next(c for c in kernels.SAMPLE_CONFIGS if c["RADIX_BITS"] == radix_bits)   # warps: no matter here
    from engine.sampling import gumbel_noise, sample
    g = torch.Generator().manual_seed(6)
    b = 7
    logits = torch.randn(b, 3072, generator=g) * 3
    logits[:, -1024:] = float("-inf")
    logits[3, :100] = 2.5                                 # a tie across the top-k boundary
    ulps = torch.randperm(2048, generator=g)
    logits[5, :2048] = 1.5 + ulps * 2.0 ** -22             # 2048 fp32 values 2 ulps apart
    logits[6, :2048] = -1.5 - ulps * 2.0 ** -22
    greedy = torch.tensor([True, False, False, False, False, False, False])
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.9, 1.3, 1.0, 1.0])
    top_k = torch.tensor([50, 0, 1, 50, 5000, 50, 7])
    seed, frame, no_top_p = torch.arange(b) + 100, torch.arange(b), torch.ones(b, dtype=torch.float64)
    seed[0] = (1 << 63) - 1                               # the hash's full 64-bit range
    for v, codebook in ((3072, 0), (2048, 5), (2048, 15)):
        noise = gumbel_noise(seed, frame, codebook, v)
        expected = sample(logits[:, :v], greedy, temperature, top_k, no_top_p, seed, frame, codebook,
                          top_p_any=False, noise=noise)
        got = kernels.sample_rows(logits[:, :v], greedy, temperature, top_k, seed, frame, codebook, config)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_sample_rows_applies_the_talker_processor_first(kernels):
    """With `processing`, the kernel applies the talker's logits processor (repetition penalty on seen
    ids of either sign, EOS blocked before min_new_tokens, the control ids suppressed) before it
    samples: the same ids as the processor's ops and then `sample`, greedy rows and sampled."""
    from engine.sampling import TalkerLogitsProcessor, sample
    g = torch.Generator().manual_seed(11)
    b, v, eos = 6, 3072, 2150
    logits = torch.randn(b, v, generator=g) * 3
    logits[:, 2048:] += 4             # control ids (and EOS) the likeliest, unless suppressed or blocked
    seen = torch.rand(b, v, generator=g) < 0.3
    penalty = torch.tensor([1.0, 1.3, 2.0, 1.1, 5.0, 1.3])
    generated, min_new = torch.tensor([0, 1, 2, 7, 0, 30]), torch.full((b,), 2)
    greedy = torch.tensor([True, False, False, True, False, False])
    temperature, top_k = torch.full((b,), 0.9), torch.tensor([50, 0, 1, 50, 5, 50])
    seed, no_top_p = torch.arange(b) + 3, torch.ones(b, dtype=torch.float64)
    processor = TalkerLogitsProcessor(v, eos)
    expected = sample(processor(logits, seen, generated, penalty, min_new), greedy, temperature, top_k, no_top_p, seed,
                      generated, 0, top_p_any=False)
    processing = kernels.TalkerProcessing(seen, penalty, min_new, eos, processor.suppress_from)
    got = kernels.sample_rows(logits, greedy, temperature, top_k, seed, generated, 0, processing=processing)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert ((got < 2048) | (got == eos)).all() and not (got[generated < 2] == eos).any()


def test_sample_rows_writes_the_picks_embeddings(kernels):
    """With `embed`, each row's pick's table row is written out as well (the next code-predictor step's
    input), for greedy and sampled rows; the ids are those without it."""
    g = torch.Generator().manual_seed(12)
    b, v = 3, 2048
    logits, table = torch.randn(b, v, generator=g) * 3, torch.randn(v, 96, generator=g)
    greedy, temperature, top_k = torch.tensor([True, False, False]), torch.full((b,), 0.9), torch.tensor([50, 50, 0])
    seed, frame = torch.arange(b) + 1, torch.arange(b)
    rows = torch.full((b, 2, 96), float("nan"))[:, 1]          # a strided view, as the predictor's x[:, 0] may be
    got = kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, 5, embed=(table, rows))
    assert torch.equal(got, kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, 5))
    assert torch.equal(rows, table[got])


def test_sample_rows_takes_bf16_logits(kernels):
    """bf16 logits (a bf16 head's output) are sampled as their exact fp32 values: the same ids as
    the kernel and `sample` give for the cast logits."""
    from engine.sampling import sample
    g = torch.Generator().manual_seed(7)
    b, v = 6, 2048
    logits = (torch.randn(b, v, generator=g) * 3).bfloat16()
    greedy = torch.tensor([True, False, False, False, False, True])
    temperature, top_k = torch.full((b,), 0.9), torch.tensor([50, 0, 1, 50, 5, 50])
    seed, frame, no_top_p = torch.arange(b) + 7, torch.arange(b) * 3, torch.ones(b, dtype=torch.float64)
    got = kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, 4)
    torch.testing.assert_close(got, kernels.sample_rows(logits.float(), greedy, temperature, top_k, seed, frame, 4),
                               atol=0, rtol=0)
    expected = sample(logits, greedy, temperature, top_k, no_top_p, seed, frame, 4, top_p_any=False)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_sample_rows_top_k_threshold_at_high_temperature(kernels):
    """The top-k threshold, found on the logits before the temperature divides them (16 bits of a bf16
    logit, 32 of an fp32 one), keeps exactly the plain warp's tokens: at high temperatures a token it
    let through by mistake would often win. Ties at the threshold included (bf16 logits repeat)."""
    from engine.sampling import sample
    g = torch.Generator().manual_seed(9)
    b, v = 64, 2048
    temperature = torch.rand(b, generator=g) * 8 + 0.5
    top_k = torch.tensor([1, 2, 3, 5, 17, 50, 400, 0] * 8)
    greedy, no_top_p = torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.float64)
    seed, frame = torch.arange(b) + 3, torch.arange(b) % 5
    for logits in ((torch.randn(b, v, generator=g) * 2).bfloat16(), torch.randn(b, v, generator=g) * 2):
        got = kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, 3)
        expected = sample(logits, greedy, temperature, top_k, no_top_p, seed, frame, 3, top_p_any=False)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_sample_rows_draws_follow_the_plain_hash(kernels):
    """The kernel's in-kernel Gumbel noise follows `gumbel_noise`: with all-zero logits and no top-k a
    row's pick is the argmax of its noise alone, the same over many seeds, frames and codebooks."""
    from engine.sampling import gumbel_noise
    b, v = 64, 2048
    seed = torch.randint(0, 1 << 62, (b,), generator=torch.Generator().manual_seed(3)) * 2 + 1
    frame = torch.arange(b) * 37
    logits = torch.zeros(b, v)
    ones, no_greedy, no_top_k = torch.ones(b), torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.long)
    for codebook in (0, 1, 15):
        got = kernels.sample_rows(logits, no_greedy, ones, no_top_k, seed, frame, codebook)
        torch.testing.assert_close(got, gumbel_noise(seed, frame, codebook, v).argmax(-1), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17])
@pytest.mark.parametrize("epilogue", ["plain", "norm", "norm+gate", "residual"])
def test_skinny_linear_matches_the_separate_ops(kernels, rows, epilogue):
    """`linear` with its folded-in RMSNorm / SwiGLU gate / residual add, skinny kernel or (17 rows)
    cuBLAS, against the separate ops; and every launch config the GPU may time and pick (tiles are
    independent of the epilogue: all of them with the gate, the first of each kernel otherwise)."""
    g = torch.Generator().manual_seed(7)
    x, w, r = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g), torch.randn(rows, 100, generator=g)
    nw = torch.rand(96, generator=g) + 0.5
    norm, gated, residual = "norm" in epilogue, "gate" in epilogue, epilogue == "residual"
    n = 100 if gated or residual else 200
    w, residual_ = (w[:n], r) if residual else (w, None)
    expected = F.linear(F.rms_norm(x, (96,), nw, 1e-6) if norm else x, w)
    expected = kernels.silu_mul_reference(expected) if gated else expected + r if residual else expected
    args = (nw if norm else None, 1e-6, gated, residual_)
    torch.testing.assert_close(kernels.linear(x[:, None], w, *args), expected[:, None], atol=1e-4, rtol=1e-4)
    configs = kernels.linear_configs(rows, 96, gated, 4) if rows <= kernels.SKINNY_ROWS else []
    assert any(c.get("PRELOAD") for c in configs) == (rows <= kernels.SKINNY_ROWS)
    if not gated:
        kind = [(c["kernel"], c.get("PRELOAD", False)) for c in configs]
        configs = [c for i, c in enumerate(configs) if i == 0 or kind[i] != kind[i - 1]]
    for config in configs:
        out = torch.full((rows, n), float("nan"))
        kernels.skinny_linear(x, w, out, config, *args)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=str(config))
    if residual:        # in place: the same bits; past SKINNY_ROWS written into the residual's own buffer
        r_own = r.clone()
        got = kernels.linear(x, w, residual=r_own, in_place=True)
        assert torch.equal(got, kernels.linear(x, w, residual=r))
        assert (got.data_ptr() == r_own.data_ptr()) == (rows > kernels.SKINNY_ROWS)


def test_off_the_gpu_linear_runs_one_program_for_all_columns(kernels, monkeypatch):
    """Triton's interpreter runs a grid's programs one after another (~16 ms each): off the GPU `linear`
    takes a config whose one program covers the 2,048 columns of a code-predictor head."""
    grids, launch = [], kernels.launch.launch_kernel
    monkeypatch.setattr(kernels.gemm, "launch_kernel",
                        lambda kernel, grid, *args: (grids.append(grid), launch(kernel, grid, *args)))
    for rows in (1, 3):
        x, w = torch.randn(rows, 32), torch.randn(2048, 32)
        torch.testing.assert_close(kernels.linear(x, w), x @ w.T, atol=1e-4, rtol=1e-4)
    assert grids == [(1,), (1,)]


def test_a_config_that_does_not_build_is_passed_over(kernels, monkeypatch, caplog):
    """A candidate this GPU cannot build (shared memory, ptxas, a compile error on an architecture the
    configs were not tested on) times as infinite, with a warning, and the warm-up picks among the
    others instead of stopping."""
    import triton
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.launch, "PARALLEL_COMPILE", False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())
    failures = {1: triton.runtime.errors.OutOfResources(1, 0, "shared memory"),
                2: triton.compiler.errors.CompilationError(None, None, "arange's end must exceed its start"),
                3: triton.runtime.errors.PTXASError("ptxas failed")}

    def launch(c, compile_only=False):
        if c["n"] in failures:
            raise failures[c["n"]]
        return {4: 2.0, 5: 1.0}[c["n"]]
    with caplog.at_level("WARNING"):
        best = kernels.launch.fastest(("a test key",), [{"n": n} for n in range(1, 6)], launch)
    assert best == {"n": 5}
    assert sum("does not build" in r.message for r in caplog.records) == 3


def test_picks_are_kept_on_disk_for_the_next_process(kernels, monkeypatch, tmp_path):
    """A config timed once is kept in the tuning cache's file; a later process (a fresh cache, no picks
    in memory) takes it without timing, unless it is no longer one of its key's configs; another GPU
    model, or other QWEN3_TTS_* settings, have a file of their own."""
    launch = kernels.launch
    gpu = {"name": "Test GPU"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), dict(name=gpu["name"], major=9, minor=0)))
    monkeypatch.setattr(launch, "PARALLEL_COMPILE", False)
    timings = []
    monkeypatch.setattr(launch, "timed",
                        lambda time, config: timings.append(config) or (1.0 if config["n"] == 2 else 2.0))
    key, configs = ("a test key", 7, torch.float16), [{"n": n, "warps": 4} for n in range(4)]

    def new_process():
        monkeypatch.setattr(launch, "fastest_configs", {})
        monkeypatch.setattr(launch, "fastest_times", {})
        monkeypatch.setattr(launch, "tuning_cache", launch.TuningCache(str(tmp_path)))

    for _ in range(2):
        new_process()
        assert launch.fastest(key, configs, lambda config: None) is configs[2]
        assert launch.fastest_times[key] == 1.0
    assert len(timings) == 4                                  # the first process timed, the second read
    assert os.path.dirname(launch.tuning_cache.path()) == str(tmp_path)
    new_process()
    assert launch.fastest(key, configs[:2] + configs[3:], lambda config: None) == configs[0]
    assert len(timings) == 7                                  # its pick is gone from the configs: timed again
    gpu["name"] = "Another GPU"
    new_process()
    assert launch.fastest(key, configs, lambda config: None) == configs[2] and len(timings) == 11
    monkeypatch.setenv("QWEN3_TTS_PDL", "0")                  # settings that change what is timed: a file too
    new_process()
    assert launch.fastest(key, configs, lambda config: None) == configs[2] and len(timings) == 15
    assert len(list(tmp_path.glob("launch-configs-*.json"))) == 3


def test_the_tuning_cache_folder_comes_from_the_environment(kernels, monkeypatch, tmp_path):
    launch = kernels.launch
    monkeypatch.setenv("QWEN3_TTS_TUNING_CACHE", "0")
    assert launch._tuning_cache() is None
    monkeypatch.setenv("QWEN3_TTS_TUNING_CACHE", str(tmp_path / "picks"))
    assert launch._tuning_cache().folder == str(tmp_path / "picks")
    monkeypatch.delenv("QWEN3_TTS_TUNING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert launch._tuning_cache().folder == str(tmp_path / "qwen3-tts-server")


@pytest.fixture
def timed_on_copies(kernels, monkeypatch):
    """`launch.fastest` as on a GPU, with its CUDA-graph timing replaced by one that runs each launch over
    the copies once and records them; the configs' times come from `times` (config index -> ms)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.launch, "PARALLEL_COMPILE", False)
    monkeypatch.setattr(kernels.launch, "fastest_configs", {})
    for module in (kernels.gemm, kernels.attention):
        monkeypatch.setattr(module, "copies_beyond_l2", lambda nbytes, device, most=64: 3)
    seen = {"launches": [], "times": {}}

    def graph_time(launches, config):
        for launch in launches:
            launch(config)
        seen["launches"].append(launches)
        return seen["times"].get(len(seen["launches"]) - 1, 10.0)
    monkeypatch.setattr(kernels.launch, "graph_time", graph_time)
    return seen


def test_linear_times_its_configs_on_copies_of_its_weights(kernels, timed_on_copies):
    """On the GPU `linear` times each config as a decode step runs it: over weight copies that together
    overflow L2 (the same values, their own memory), and keeps the fastest."""
    g = torch.Generator().manual_seed(8)
    x, w, nw = torch.randn(1, 96, generator=g), torch.randn(200, 96, generator=g), torch.rand(96, generator=g) + 0.5
    configs = kernels.linear_configs(1, 96, True, 4)
    timed_on_copies["times"] = {2: 1.0}
    got = kernels.linear(x, w, nw, 1e-6, gated=True)
    torch.testing.assert_close(got, kernels.silu_mul_reference(F.linear(F.rms_norm(x, (96,), nw, 1e-6), w)),
                               atol=1e-4, rtol=1e-4)
    assert len(timed_on_copies["launches"]) == len(configs)
    copies = [f.keywords["weight"] for f in timed_on_copies["launches"][0][1:]]
    assert len(copies) == 2 and all(torch.equal(c, w) and c.data_ptr() != w.data_ptr() for c in copies)
    key = kernels.linear_timing_key(1, 100, 96, x.dtype, True, True, False)
    assert kernels.launch.fastest_configs[key] == configs[2]


def test_attention_is_timed_for_the_calls_longest_rows(kernels, timed_on_copies, monkeypatch):
    """The configs are timed on scratch rows as long as the call's kmax (an eager decode's kv bucket;
    at least ATTENTION_TIMING_MIN_KEYS, ATTENTION_TIMING_KEYS when not told, at most
    ATTENTION_TIMING_MAX_KEYS and the capacity: the decode graphs' one bucket is the capacity), each
    length on its own: a row's keys split over programs pay only for long rows. (Two of the configs,
    one split: in the interpreter all of them took 100 s.)"""
    attention = kernels.attention
    configs = attention.ATTENTION_CONFIGS
    monkeypatch.setattr(attention, "ATTENTION_CONFIGS", [configs[0], configs[-1]])
    assert attention.ATTENTION_CONFIGS[-1]["SPLIT"] > 1
    for capacity, cases in ((300, ((None, 256), (64, 128), (200, 200), (1000, 300))), (8448, ((8448, 512),))):
        cache = KVCache(1, 1, capacity, 2, 32, torch.float32, "cpu", page_size=16, reserve_all=True,
                        separate_pages=True)
        qkv, w = torch.randn(1, 1, 8 * 32), torch.ones(32)
        for kmax, keys in cases:
            kernels.decode_attention(qkv, 4, 2, w, w, 1e-6, rope_inv_freq(32, 1e6), cache, 0, torch.tensor([3]),
                                     kmax=kmax)
            assert timed_on_copies["launches"][-1][0].keywords["cache"].capacity == keys
    assert len(timed_on_copies["launches"]) == 5 * len(attention.ATTENTION_CONFIGS)


def test_attention_times_its_configs_on_scratch_layers(kernels, timed_on_copies):
    """`decode_attention` times its configs over the layers of a scratch cache (never the live one),
    read one after another as a decode step does, with and without its prefetch."""
    heads, kv_heads, head_dim, b = 4, 2, 32, 2
    cache = KVCache(1, b, 40, kv_heads, head_dim, torch.float32, "cpu", page_size=16, reserve_all=True,
                    separate_pages=True)
    cache.write(0, torch.randn(b, 40, kv_heads, head_dim), torch.randn(b, 40, kv_heads, head_dim),
                torch.zeros(b, dtype=torch.long))
    before = [t.clone() for t in cache.read(0, b, 40)]
    qkv = torch.randn(b, 1, (heads + 2 * kv_heads) * head_dim)
    start = torch.tensor([5, 17])
    timed_on_copies["times"] = {len(kernels.ATTENTION_CONFIGS) - 1: 1.0}
    w = torch.ones(head_dim)
    got = kernels.decode_attention(qkv, heads, kv_heads, w, w, 1e-6, rope_inv_freq(head_dim, 1e6), cache, 0, start)
    expected = kernels.decode_attention(qkv, heads, kv_heads, w, w, 1e-6, rope_inv_freq(head_dim, 1e6), cache, 0,
                                        start, kernels.ATTENTION_CONFIGS[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    launches = timed_on_copies["launches"][0]
    scratch = launches[0].keywords["cache"]
    assert scratch is not cache and scratch.num_layers == 3
    assert [f.keywords["layer"] for f in launches] == [0, 1, 2]
    assert {c["PREFETCH"] for c in kernels.ATTENTION_CONFIGS} == {True, False}
    key = ("attention", b, 1, heads, kv_heads, head_dim, qkv.dtype, cache.capacity, cache.page_size, 40)
    assert kernels.launch.fastest_configs[key] == kernels.ATTENTION_CONFIGS[-1]
    after = cache.read(0, b, 40)      # the live rows changed only at the new positions
    for a, e in zip(after, before):
        e[0, 5], e[1, 17] = a[0, 5], a[1, 17]
        torch.testing.assert_close(a, e, atol=0, rtol=0)


def test_candidate_configs_compile_side_by_side(kernels, monkeypatch, caplog):
    """`launch.fastest` first has every config it will time compiled at once: each launch asked only to
    compile, all inside one Triton async-compile context; where that fails it turns itself off and
    the configs compile at their first launch. (On the GPU a fresh machine's warm-up is mostly these
    compiles; tests/compile_kernels.py compiles the real kernels in threads.)"""
    from triton.runtime import _async_compile
    monkeypatch.setattr(kernels.launch, "PARALLEL_COMPILE", True)
    seen = []
    kernels.launch.compile_candidates([{"a": 1}, {"a": 2}], lambda c, compile_only=False: seen.append(
        (c["a"], compile_only, _async_compile.active_mode.get() is not None)))
    assert seen == [(1, True, True), (2, True, True)]
    assert _async_compile.active_mode.get() is None

    def broken(c, compile_only=False):
        raise TypeError("no warmup here")
    kernels.launch.compile_candidates([{"a": 1}, {"a": 2}], broken)
    assert kernels.launch.PARALLEL_COMPILE is False and "parallel Triton compiles are off" in caplog.text
    kernels.launch.compile_candidates([{"a": 1}, {"a": 2}], lambda c, compile_only=False: seen.append(c))
    assert len(seen) == 2                      # off: nothing more is queued


def test_head_sizes_the_attention_kernel_takes(kernels):
    """Other head sizes keep the plain ops (`DecoderStack.fuse` asks before choosing the kernel)."""
    assert [kernels.decode_attention_supports(d) for d in (16, 32, 48, 64, 128)] == [False, True, False, True, True]
    cache = KVCache(1, 1, 4, 1, 16, torch.float32, "cpu", reserve_all=True)
    with pytest.raises(ValueError, match="unsupported"):
        kernels.decode_attention(torch.zeros(1, 1, 48), 1, 1, torch.ones(16), torch.ones(16), 1e-6,
                                 torch.ones(8), cache, 0, torch.zeros(1, dtype=torch.long))


def test_triton_compiles_are_counted(kernels):
    """Each kernel variant Triton builds goes through its post-compile hook, which counts it (and
    still calls a hook installed before ours)."""
    import triton
    hook = triton.knobs.runtime.jit_post_compile_hook
    assert hook is not None
    before = kernels.launch.compiles
    hook(key=None, repr="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert kernels.launch.compiles == before + 1


def test_fused_decode_of_a_narrower_code_predictor_matches_the_plain_ops(kernels, tmp_path):
    """A code predictor narrower than the talker (its inputs through `small_to_mtp_projection`) on the
    fused decode path gives the plain ops' greedy codes (the talker's 16-wide heads keep the plain ops,
    as `DecoderStack.fuse` decides on a GPU)."""
    from engine.testing import random_model
    from tests.test_random_model import NARROW_PREDICTOR
    folder = random_model.build("tiny", 4, tmp_path / "m", overrides=NARROW_PREDICTOR)
    plain, fused = load_model(folder), load_model(folder)
    for stack in (fused.talker.model, fused.talker.code_predictor.model):
        stack.fuse()
        stack.fused_decode = kernels.decode_attention_supports(stack.layers[0].self_attn.head_dim)
    assert fused.talker.code_predictor.model.fused_decode and not fused.talker.model.fused_decode
    ref = np.random.default_rng(0).standard_normal(3 * 24000).astype(np.float32) * 0.1
    codes = [synthesize(m, [SpeechRequest("Hello there, a narrower predictor.", m.make_voice(ref, 24000), "english",
                                          SamplingParams(greedy=True), max_frames=4)])[0].codes for m in (plain, fused)]
    assert codes[0].shape == (4, 16)
    np.testing.assert_array_equal(codes[1], codes[0])
