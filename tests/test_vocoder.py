"""Speech-tokenizer decoder against the official golden waveforms, and the streaming decoder against
the unchunked decode.

Streaming exactness is checked in fp64: an error in the carried state (contexts, frame counts,
window mask) costs >= 1e-3 there, while the only noise left is the fp32 RoPE tables (computed in fp32
by design, at window-local positions that differ from the unchunked decode's): ~3e-6. In fp32 the
BLAS kernels round differently for different lengths, and this tiny random model amplifies those
last-bit differences ~30x (activations reach ~700 before the last conv), to ~4e-5 -- as large as
fp32 vs fp64 of one unchunked decode -- so fp32 streaming is held to the golden 1e-4.
"""
import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import load_config
from engine.model.vocoder import UNUSED_KEYS, Vocoder, VocoderStreams
from engine.streaming import StreamingVocoder, WindowPolicy
from engine.weights import load_into, read_safetensors
from tests.triton_cpu import require_triton

SPF = 1920
GOLDEN_TOL = 1e-4
EXACT_TOL = 1e-5   # fp64 streaming vs unchunked: only the fp32 RoPE tables differ (~3e-6)


@pytest.fixture(scope="module")
def tensors(tiny_model_dir):
    return read_safetensors(tiny_model_dir / "speech_tokenizer" / "model.safetensors")


@pytest.fixture(scope="module")
def vocoder(tiny_model_dir, tensors):
    v = Vocoder(load_config(tiny_model_dir).decoder).eval()
    load_into(v, tensors, "decoder.")
    return v


@pytest.fixture(scope="module")
def vocoder64(vocoder):
    return copy.deepcopy(vocoder).double()


@pytest.fixture(scope="module")
def random_codes(golden_npz):
    """90 frames: more than the 72-frame attention window."""
    return torch.from_numpy(golden_npz("decode_only_330")["codes"][:90])


def stream(streams, slot, codes, schedule):
    """Decode codes [T,16] through one slot in windows of the given sizes; concatenated fp32 audio."""
    assert sum(schedule) == codes.shape[0]
    out, pos = [], 0
    for w in schedule:
        wav = streams.decode(torch.tensor([slot]), codes[None, pos:pos + w])
        assert wav.shape == (1, w * SPF) and wav.dtype == torch.float32
        out.append(wav[0])
        pos += w
    return torch.cat(out)


def maxdiff(a, b):
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


def test_loads_every_decoder_tensor_except_input_proj(vocoder, tensors):
    used = load_into(vocoder, tensors, "decoder.")
    unused = {k for k in tensors if k.startswith("decoder.") and k not in used}
    assert unused == {"decoder." + p + "weight" for p in UNUSED_KEYS}


@pytest.mark.parametrize("name", ["decode_only_40", "decode_only_330"])
def test_decode_matches_golden(vocoder, golden_npz, name):
    z = golden_npz(name)
    wav, samples = vocoder.decode(torch.from_numpy(z["codes"])[None])
    assert wav.dtype == torch.float32 and samples.tolist() == [len(z["wav"])] == [wav.shape[1]]
    assert maxdiff(wav[0], z["wav"]) < GOLDEN_TOL


def test_decode_chunking_differs_from_unchunked_after_300_frames(vocoder, golden_npz):
    """decode_only_330 only matches because the chunks restart at frame 300 with 25 frames of context."""
    codes = torch.from_numpy(golden_npz("decode_only_330")["codes"])[None]
    chunked = vocoder.decode(codes)[0]
    assert maxdiff(chunked[0, :300 * SPF], vocoder.decode_unchunked(codes[:, :300])[0]) < GOLDEN_TOL
    assert maxdiff(chunked[0, 300 * SPF:], vocoder.decode_unchunked(codes)[0, 300 * SPF:]) > 1e-3


def test_decode_ragged_batch(vocoder, golden_npz):
    z = golden_npz("decode_only_batch2")
    codes = torch.full((2, 20, 16), -1, dtype=torch.long)
    codes[0, :12] = torch.from_numpy(z["codes_0"])
    codes[1] = torch.from_numpy(z["codes_1"])
    wav, samples = vocoder.decode(codes)
    assert samples.tolist() == [12 * SPF, 20 * SPF] and wav.shape == (2, 20 * SPF)
    assert maxdiff(wav[0, :12 * SPF], z["wav_0"]) < GOLDEN_TOL
    assert maxdiff(wav[1], z["wav_1"]) < GOLDEN_TOL
    assert wav[0, 12 * SPF:].abs().max().item() == 0.0
    wav2, samples2 = vocoder.decode(codes, torch.tensor([12, 20]))
    assert torch.equal(wav, wav2) and torch.equal(samples, samples2)


@pytest.mark.parametrize("name", ["xvec_en", "icl_en", "batch3_xvec", "batch3_icl", "batch2_eos"])
def test_decode_generation_cases(vocoder, golden_cases, golden_npz, name):
    """decode_input_codes_i -> decode_full_wav_i, all items of a case in one ragged batch."""
    z = golden_npz(name)
    items = [torch.from_numpy(z[f"decode_input_codes_{i}"]) for i in range(golden_cases[name]["batch_size"])]
    codes = torch.nn.utils.rnn.pad_sequence(items, batch_first=True, padding_value=-1)
    wav, samples = vocoder.decode(codes)
    for i, c in enumerate(items):
        ref = z[f"decode_full_wav_{i}"]
        assert samples[i].item() == len(ref) == c.shape[0] * SPF
        assert maxdiff(wav[i, :len(ref)], ref) < GOLDEN_TOL


@pytest.mark.parametrize("schedule", [
    [1] * 6 + [84],
    [1, 2, 4, 8] * 4 + [30],
    [8] * 11 + [2],
    [3, 1, 7, 2, 61, 1, 15],
])
def test_streaming_equals_unchunked_fp64(vocoder64, random_codes, schedule):
    ref = vocoder64.decode_unchunked(random_codes[None])[0]
    out = stream(VocoderStreams(vocoder64, 4), 2, random_codes, schedule)
    assert out.shape == ref.shape
    assert maxdiff(out, ref) < EXACT_TOL


def test_streaming_fp32_within_golden_tolerance(vocoder, random_codes):
    ref = vocoder.decode_unchunked(random_codes[None])[0]
    out = stream(VocoderStreams(vocoder, 2), 0, random_codes, [1, 2, 4, 8, 16, 32, 27])
    assert maxdiff(out, ref) < GOLDEN_TOL


def test_primed_icl_stream(vocoder, vocoder64, golden_npz):
    """prime(ref codes), then the generated codes: the full decode of ref ++ codes minus the ref audio."""
    z = golden_npz("icl_en")
    ref_codes, codes = torch.from_numpy(z["ref_codes"]), torch.from_numpy(z["codes_0"])
    cut = ref_codes.shape[0] * SPF
    full = vocoder64.decode_unchunked(torch.cat([ref_codes, codes])[None])[0]
    schedule = [1, 2, 4, 8, 16]
    streams = VocoderStreams(vocoder64, 3)
    streams.prime(torch.tensor([1]), ref_codes[None])
    assert maxdiff(stream(streams, 1, codes, schedule), full[cut:]) < EXACT_TOL
    # fp32 streaming against the official decode of ref ++ codes (one chunk: 67 frames)
    streams32 = VocoderStreams(vocoder, 3)
    streams32.prime(torch.tensor([1]), ref_codes[None])
    assert maxdiff(stream(streams32, 1, codes, schedule), z["decode_full_wav_0"][cut:]) < GOLDEN_TOL


def test_batched_streams_with_different_histories(vocoder64, random_codes):
    """Slot 3 runs 10 frames alone, then advances together with a fresh slot 0 (and a padding row)."""
    a, b = random_codes[:40], random_codes[40:70]
    ref_a = vocoder64.decode_unchunked(a[None])[0]
    ref_b = vocoder64.decode_unchunked(b[None])[0]
    streams = VocoderStreams(vocoder64, 4)
    head = stream(streams, 3, a[:10], [4, 6])
    slots = torch.tensor([3, streams.pad_slot, 0])
    out_a, out_b, pos = [head], [], 0
    for w in [1, 3, 8, 2, 16]:
        codes = torch.stack([a[10 + pos:10 + pos + w], random_codes[:w], b[pos:pos + w]])
        wav = streams.decode(slots, codes)
        assert wav.shape == (3, w * SPF)
        out_a.append(wav[0])
        out_b.append(wav[2])
        pos += w
    assert maxdiff(torch.cat(out_a), ref_a) < EXACT_TOL
    assert maxdiff(torch.cat(out_b), ref_b) < EXACT_TOL


def test_reset_forgets_the_slot(vocoder64, random_codes):
    first, second = random_codes[:20], random_codes[20:36]
    fresh = vocoder64.decode_unchunked(second[None])[0]
    streams = VocoderStreams(vocoder64, 2)
    stream(streams, 1, first, [8, 12])
    assert maxdiff(stream(streams, 1, second, [16]), fresh) > 1e-3   # the slot's history matters ...
    streams.reset(torch.tensor([1]))
    assert maxdiff(stream(streams, 1, second, [2, 14]), fresh) < EXACT_TOL   # ... until reset


def test_bf16_keeps_fp32_rope_and_streams(vocoder, random_codes):
    v = copy.deepcopy(vocoder).to(torch.bfloat16)
    assert v.pre_transformer.inv_freq.dtype == torch.float32
    torch.testing.assert_close(v.pre_transformer.inv_freq, vocoder.pre_transformer.inv_freq, rtol=0, atol=0)
    streams = VocoderStreams(v, 2)
    assert streams.state.dtype == torch.bfloat16
    wav = streams.decode(torch.tensor([0, 1]), torch.stack([random_codes[:2], random_codes[2:4]]))
    assert wav.dtype == torch.float32 and wav.shape == (2, 2 * SPF)
    assert torch.isfinite(wav).all() and wav.abs().max().item() <= 1.0
    assert streams.frames[:2].tolist() == [2, 2]


def test_channels_last_convs_stream_the_same_audio(vocoder, random_codes, monkeypatch):
    """On CUDA the convs run as 2-D convs over activations with their channels adjacent in memory, the
    weights stored so too (`Vocoder.channels_last_weights`), and the Triton kernels between them keep
    that layout. All forced on here on the CPU (the kernels in Triton's interpreter): the streamed
    audio is the channels-first path's, and past the pre-conv every conv reads its activation and
    weight in place (a layout copy of one would cost a pass over it; on CUDA the output conv's
    weight, zero-padded to 16 channels there, is copied too: 16 x 96 x 7 numbers)."""
    from engine.model import vocoder as vocoder_module
    kernels = require_triton()
    monkeypatch.setattr(vocoder_module, "snake_beta", kernels.snake_beta_triton)
    monkeypatch.setattr(vocoder_module, "residual_tail", kernels.residual_tail_triton)
    schedule, codes = [2, 3], random_codes[:5]
    plain = stream(VocoderStreams(vocoder, 2), 1, codes, schedule)
    copies, as_2d_itself = [], vocoder_module._as_2d

    def as_2d(x):
        copies.append(not x.unsqueeze(2).is_contiguous(memory_format=torch.channels_last))
        return as_2d_itself(x)
    monkeypatch.setattr(vocoder_module, "_channels_last", lambda x: True)
    monkeypatch.setattr(vocoder_module, "_as_2d", as_2d)
    last = stream(VocoderStreams(copy.deepcopy(vocoder).channels_last_weights(), 2), 1, codes, schedule)
    assert maxdiff(last, plain) < GOLDEN_TOL
    # every conv but the residual units' 1x1 ones (in `residual_tail`) and the depthwise ones (channels
    # first): an input and a weight each
    convs = sum(isinstance(m, vocoder_module.CausalConvTranspose1d)
                or isinstance(m, vocoder_module.CausalConv1d) and m.conv.groups == 1 for m in vocoder.modules())
    units = sum(isinstance(m, vocoder_module.ResidualUnit) for m in vocoder.modules())
    assert len(copies) == 2 * (convs - units) * len(schedule)
    assert sum(copies) == len(schedule)          # the pre-conv's input (the quantizer's output) alone


def test_stream_state_of_the_12hz_decoder_is_under_a_megabyte():
    """A stream's state (every op's left context) for the 0.6B model's decoder in bf16: the attention
    keeps its last 71 inputs (8 layers x 71 x 512), not their keys and values (4x as many), so 256
    slots hold 0.22 GB, not 0.67."""
    cfg = load_config(Path(__file__).parents[1] / "engine" / "testing" / "configs" / "0.6b").decoder
    with torch.device("meta"):
        v = Vocoder(cfg).to(torch.bfloat16)
    context = v.initial_context(1)
    attention = {op: buf for op, buf in context.items() if hasattr(op, "q_proj")}
    assert [buf.shape for buf in attention.values()] == [(1, 71, 512)] * 8
    assert sum(buf.numel() * buf.element_size() for buf in context.values()) == 852_096
    streams = VocoderStreams(v, 256)
    assert len(streams.ops) == 29 and streams.state.shape == (257, 852_096 // 2)   # one row a stream, + a spare


def test_window_activations_of_the_12hz_decoder():
    """The most activation memory alive at once in an 8-frame window of 64 streams (what the vocoder
    graphs' pool must hold), modeled on the meta device: three tensors of the highest rate
    (64 x 96 x 15,360 bf16, 180 MiB each: a residual unit's input, its conv's input and output) and
    the gathered stream state. A copy more of any of them (a concatenated context, a block's input
    held to its end) shows here; with both, as before, it was 0.99 GiB."""
    from bench.activation_peak import window_peak
    from engine.model import vocoder as vocoder_module
    kernels = vocoder_module.snake_beta, vocoder_module.residual_tail
    live = window_peak(Path(__file__).parents[1] / "engine" / "testing" / "configs" / "0.6b", 64, 8)
    assert (vocoder_module.snake_beta, vocoder_module.residual_tail) == kernels     # put back
    assert 0.60 * 2**30 < live.peak < 0.65 * 2**30
    assert sorted(shape for _, shape, _ in live.at_peak[:3]) == [(64, 96, 15360), (64, 96, 15360), (64, 96, 15414)]


class ReplayOnCPU:
    """What a captured CUDA graph does, on the CPU: each replay reruns the captured call on the same
    static input buffers and writes into the same output tensor (the next replay overwrites it)."""

    def __init__(self, forward):
        self.forward = forward
        self.out = forward()

    def replay(self):
        self.out.copy_(self.forward())


def test_vocoder_graphs_split_wide_batches_and_odd_windows(vocoder64, random_codes, monkeypatch):
    """`VocoderGraphs` decodes 5 streams with at most 2 a replay, in windows of captured sizes and of
    others: the same audio as one eager decode of everything."""
    from engine import graphs as graphs_module

    def capture(forward, pool, context=None):
        graph = ReplayOnCPU(forward)
        return graph, graph.out

    monkeypatch.setattr(graphs_module, "capture_graph", capture)
    codes = torch.stack([random_codes[10 * i:10 * i + 31] for i in range(5)])
    slots = torch.tensor([4, 0, 2, 1, 3])
    reference = VocoderStreams(vocoder64, 6).decode(slots, codes)
    graphs = graphs_module.VocoderGraphs(VocoderStreams(vocoder64, 6), [2, 4, 8], pool=object(), max_batch=2)
    pieces, t = [], 0
    for w in (3, 8, 5, 7, 1, 2, 5):
        pieces.append(graphs.decode(slots, codes[:, t:t + w]).clone())
        t += w
    assert {bucket for bucket, _ in graphs.graphs} == {1, 2}
    assert maxdiff(torch.cat(pieces, dim=1), reference) < EXACT_TOL


def test_a_turns_last_window_is_decoded_padded_in_the_next_sizes_group(vocoder64, random_codes):
    """A finished turn's 3 remaining frames join another stream's 4-frame window: one decode, the
    extra frame code 0 whatever its ring holds, its audio dropped; both streams' audio as one-shot."""
    sv = StreamingVocoder(vocoder64, 2, WindowPolicy(2, 8), frame_audio_s=0.08)
    sv.start([0, 1], [None, None])
    codes = [random_codes[:5], random_codes[40:46]]           # slot 0: 2 + 3 (last); slot 1: 2 + 4
    out = [[], []]

    def step(rows, k):
        sv.add(np.array(rows), torch.stack([codes[r][min(k, len(codes[r]) - 1)] for r in (0, 1)]))
        sv.confirm(np.array(rows))

    for k in range(2):
        step([0, 1], k)
    [(group, frames)] = sv.due(np.array([0, 1]), np.array([False, False]), 0.01)
    assert list(group) == [0, 1] and frames == 2                          # both first windows
    for slot, pcm in zip(group, sv.decode(group, frames).wait()):
        out[slot].append(pcm)
    for k in range(2, 5):
        step([0, 1], k)
    step([1], 5)
    sv.pending[0, 5 % sv.ring] = 5000       # what a step launched after the turn's end may leave: no code
    # slot 0's turn ended with 3 frames; slot 1's listener is running dry (a 1 s step): its 4 close
    groups = sv.due(np.array([0, 1]), np.array([True, False]), 1.0, last=np.array([True, False]))
    assert [(list(g), w) for g, w in groups] == [([0, 1], 4)]
    group, frames = groups[0]
    for slot, pcm in zip(group, sv.decode(group, frames).wait()):
        out[slot].append(pcm)
    assert [len(p) for p in out[0]] == [2 * SPF, 3 * SPF] and [len(p) for p in out[1]] == [2 * SPF, 4 * SPF]
    for slot in (0, 1):
        assert maxdiff(np.concatenate(out[slot]), vocoder64.decode_unchunked(codes[slot][None])[0]) < EXACT_TOL
