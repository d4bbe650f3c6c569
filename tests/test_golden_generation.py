"""Every golden generation case through the runner + synth: codes exact, frame counts, wav within 1e-4.

The voice comes from the golden x-vector / ref_codes (the reference-audio path has its own test in
test_loader.py), so these tests isolate prompt building, the runner and the decode.
"""
import numpy as np
import pytest
import torch

from engine.loader import load_model
from engine.requests import SamplingParams, SpeechRequest, VoicePrompt
from engine.runner import EOS, LIMIT, RUNNING, ModelRunner
from engine.synth import icl_cut, synthesize

GREEDY = SamplingParams(greedy=True)
CASES = ["xvec_en", "xvec_zh", "xvec_es", "xvec_auto", "xvec_en_nonstreaming", "icl_en", "icl_zh",
         "icl_en_nonstreaming", "batch3_xvec", "batch3_icl", "xvec_eos", "batch2_eos"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def golden_requests(model, case, z, max_frames=31):
    icl = case["mode"] == "icl"
    voice = VoicePrompt(torch.from_numpy(z["xvector"]), torch.from_numpy(z["ref_codes"]) if icl else None,
                        model.tokenizer.ref_text_ids(case["ref_text"]) if icl else None)
    return [SpeechRequest(text=it["text"], voice=voice, language=it["language"], sampling=GREEDY,
                          max_frames=max_frames, non_streaming_text=case["non_streaming_mode"])
            for it in case["items"]]


@pytest.fixture(scope="module")
def golden_results(model, golden_cases, golden_npz):
    """synthesize() of a golden case, computed once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = synthesize(model, golden_requests(model, golden_cases[name], golden_npz(name)))
        return cache[name]
    return get


@pytest.mark.parametrize("name", CASES)
def test_golden_case(golden_cases, golden_npz, golden_results, name):
    case, z = golden_cases[name], golden_npz(name)
    results = golden_results(name)
    assert len(results) == case["batch_size"]
    for i, (res, item) in enumerate(zip(results, case["items"])):
        np.testing.assert_array_equal(res.codes, z[f"codes_{i}"])
        assert res.codes.shape[0] == item["n_frames"]
        assert res.reason == ("eos" if item["stop_reason"].startswith("eos") else "max_frames")
        assert res.wav.dtype == np.float32 and res.wav.shape == z[f"wav_{i}"].shape == (item["wav_samples"],)
        np.testing.assert_allclose(res.wav, z[f"wav_{i}"], atol=1e-4, rtol=0)


def test_frame_accounting(model, golden_cases, golden_npz, golden_results):
    """EOS is never a frame; max_new_tokens-1 frames at the limit; 1920 samples per x-vector frame."""
    case, z = golden_cases["batch2_eos"], golden_npz("batch2_eos")
    eos_row, limit_row = golden_results("batch2_eos")
    seq = z["talker_sequences"][0]
    assert seq[18] == 2150 and eos_row.codes.shape[0] == 18          # EOS sampled as c0 number 18
    assert not (eos_row.codes[:, 0] == 2150).any() and eos_row.codes.max() < 2048
    assert limit_row.codes.shape[0] == z["talker_sequences"].shape[1] - 1 == 31
    assert eos_row.wav.shape[0] == 18 * 1920 and limit_row.wav.shape[0] == 31 * 1920
    # max_frames=N gives N frames, whatever N (the official max_new_tokens = N + 1).
    for n in (0, 1, 5):
        (res,) = synthesize(model, golden_requests(model, case, z, max_frames=n)[:1])
        np.testing.assert_array_equal(res.codes, z["codes_0"][:n])
        assert res.reason == "max_frames" and res.wav.shape[0] == n * 1920


def test_synthesize_refuses_a_batch_with_an_empty_text(model, golden_cases, golden_npz):
    """A request the prompt builder refuses fails the batch with the builder's error (prompts are built
    in one go, `PromptBuilder.build_many`), before anything is generated."""
    good = golden_requests(model, golden_cases["batch2_eos"], golden_npz("batch2_eos"))[0]
    empty = SpeechRequest(text="", voice=good.voice, language=good.language)
    with pytest.raises(ValueError, match="empty text"):
        synthesize(model, [good, empty])


def test_icl_cut_formula():
    assert icl_cut(1, 49, 1920) == 1919                      # the official off-by-one (MODEL.md 9.2)
    assert icl_cut(36, 67, 1920) == int(36 / 67 * (67 * 1920))
    assert icl_cut(0, 0, 1920) == 0


def _prompt(model, name, golden_cases, golden_npz, i=0):
    case, z = golden_cases[name], golden_npz(name)
    req = golden_requests(model, case, z)[i]
    p = model.prompts.build(model.tokenizer.text_ids(req.text), req.voice, req.language, req.non_streaming_text)
    return p, z[f"codes_{i}"]


def _text_term(model, prompt, k):
    return prompt.trailing[k] if k < prompt.trailing.shape[0] else model.prompts.tts_pad


@pytest.mark.parametrize("page_size", [64, 5])
def test_runner_rows_sit_out_and_slots_reuse(model, golden_cases, golden_npz, page_size):
    """Rows that sit out keep their state; chunked prefill next to another row; a freed slot is reused
    (its pages released and taken again, or kept). Pages of 5 positions: every few frames a row
    enters a page it has not reserved."""
    (pa, ga), (pb, gb), (pc, gc) = (_prompt(model, n, golden_cases, golden_npz) for n in ("xvec_en", "icl_zh", "xvec_es"))
    runner = ModelRunner(model, max_batch=2, capacity=128, kv_bucket=16, page_size=page_size)
    runner.admit([0, 1], [GREEDY, GREEDY], [31, 12])
    # Row 1's prompt arrives in two chunks; row 0's in one call together with row 1's first chunk.
    assert runner.prefill([0, 1], [pa.embeds, pb.embeds[:20]], last=[True, False]) == [RUNNING, RUNNING]
    assert runner.prefill([1], [pb.embeds[20:]]) == [RUNNING]
    rows = {0: (pa, ga, []), 1: (pb, gb[:12], [])}       # slot -> (prompt, expected codes, frames so far)
    queue = [(pc, gc)]                                     # admitted into the first slot that frees up
    sit_out = {(0, 3), (0, 4), (1, 7), (0, 15), (1, 15), (1, 16)}
    done, t = 0, 0
    while rows:
        active = [s in rows and (s, t) not in sit_out for s in (0, 1)]
        text = torch.stack([_text_term(model, rows[s][0], len(rows[s][2])) if s in rows else model.prompts.tts_pad
                            for s in (0, 1)])
        out = runner.step(2, active, text).result()
        for s in (0, 1):
            if not active[s]:
                assert out.status[s] == RUNNING
                continue
            prompt, expected, frames = rows[s]
            frames.append(out.frames[s].numpy())
            if out.status[s] == RUNNING:
                continue
            assert out.status[s] == LIMIT
            np.testing.assert_array_equal(np.stack(frames), expected)
            done += 1
            del rows[s]
            if queue:
                prompt, expected = queue.pop()
                if page_size == 5:
                    runner.release([s])
                    assert runner.cache.page_counts[s] == 0 and runner.cache.pages_free > 0
                runner.admit([s], [GREEDY], [31])
                assert runner.prefill([s], [prompt.embeds]) == [RUNNING]
                rows[s] = (prompt, expected, [])
        t += 1
    assert done == 3


def test_prefill_reads_its_status_back_only_where_a_row_can_end(model, golden_cases, golden_npz, monkeypatch):
    """A row's first c0 can end it only with a frame limit of 0, min_new_tokens 0 (EOS allowed at
    once) or a full cache; otherwise the prefill returns RUNNING without reading the device back
    (on a GPU that read waits for the decode step in flight, every admission under load)."""
    p, _ = _prompt(model, "xvec_en", golden_cases, golden_npz)
    reads, cpu = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: reads.append(t.shape) or cpu(t, *a, **k))
    runner = ModelRunner(model, max_batch=3, capacity=128)
    runner.admit([0, 1], [GREEDY, SamplingParams(seed=3)], [31, 5])
    assert runner.prefill([0, 1], [p.embeds, p.embeds]) == [RUNNING, RUNNING] and not reads
    runner.admit([2], [GREEDY], [0])
    assert runner.prefill([2], [p.embeds]) == [LIMIT] and reads
    reads.clear()
    runner.admit([0], [SamplingParams(greedy=True, min_new_tokens=0)], [31])
    assert runner.prefill([0], [p.embeds]) == [RUNNING] and reads
    reads.clear()
    runner = ModelRunner(model, max_batch=1, capacity=p.embeds.shape[0])
    runner.admit([0], [GREEDY], [31])
    assert runner.prefill([0], [p.embeds]) == [LIMIT] and reads


def test_runner_reports_eos(model, golden_cases, golden_npz):
    p, g = _prompt(model, "xvec_eos", golden_cases, golden_npz)
    runner = ModelRunner(model, max_batch=1, capacity=64)
    runner.admit([0], [GREEDY], [100])
    runner.prefill([0], [p.embeds])
    frames, status, k = [], RUNNING, 0
    while status == RUNNING:
        out = runner.step(1, [True], _text_term(model, p, k)[None]).result()
        frames.append(out.frames[0].numpy())
        status, k = out.status[0], k + 1
    assert status == EOS
    np.testing.assert_array_equal(np.stack(frames), g)


def test_a_step_launched_before_the_last_is_read_keeps_a_finished_row_finished(model, golden_cases, golden_npz):
    """The scheduler launches step k+1 before it reads step k: the codes are the same, and a row that
    ended with EOS in step k does not advance in step k+1 (its result says so, its cache stays)."""
    p, g = _prompt(model, "xvec_eos", golden_cases, golden_npz)
    runner = ModelRunner(model, max_batch=1, capacity=64)
    runner.admit([0], [GREEDY], [100])
    runner.prefill([0], [p.embeds])
    frames, k = [], 0
    step = runner.step(1, [True], _text_term(model, p, 0)[None])
    while True:
        following = runner.step(1, [True], _text_term(model, p, k + 1)[None])   # before `step` is read
        out = step.result()
        assert out.advanced[0]
        frames.append(out.frames[0].numpy())
        if out.status[0] != RUNNING:
            break
        step, k = following, k + 1
    assert out.status[0] == EOS
    np.testing.assert_array_equal(np.stack(frames), g)
    after = following.result()
    assert not after.advanced[0] and after.status[0] == RUNNING
    assert int(runner.length[0]) == p.embeds.shape[0] + len(frames)


def test_seeded_sampling_is_batch_invariant(model, golden_cases, golden_npz):
    case, z = golden_cases["batch3_xvec"], golden_npz("batch3_xvec")
    reqs = golden_requests(model, case, z, max_frames=12)
    sampled = [SpeechRequest(text=r.text, voice=r.voice, language=r.language, max_frames=12,
                             sampling=SamplingParams(seed=1234 + i)) for i, r in enumerate(reqs)]
    together = synthesize(model, sampled)
    alone = synthesize(model, sampled[1:2])[0]
    np.testing.assert_array_equal(together[1].codes, alone.codes)
    again = synthesize(model, sampled[1:2])[0]
    np.testing.assert_array_equal(again.codes, alone.codes)
    other_seed = synthesize(model, [SpeechRequest(text=reqs[1].text, voice=reqs[1].voice, language=reqs[1].language,
                                                  max_frames=12, sampling=SamplingParams(seed=99))])[0]
    assert not np.array_equal(other_seed.codes, alone.codes)
    assert not np.array_equal(together[1].codes, z["codes_1"][:12])   # sampling, not greedy


@pytest.mark.parametrize("name", ["xvec_es", "xvec_eos"])
def test_xvector_cases_from_reference_wav(model, golden_dir, golden_cases, golden_npz, name):
    """The whole path from the reference recording: make_voice (resample, mel, x-vector) + synthesize.

    (ICL from the wav is checked against the library path in test_cli.py: the tiny codec encoder's
    fp32 near-ties make its ref_codes differ from the golden ones in a few late codebooks.)"""
    import soundfile as sf

    case, z = golden_cases[name], golden_npz(name)
    wav, sr = sf.read(golden_dir / "cases" / case["ref_audio"], dtype="float32")
    voice = model.make_voice(wav, sr, x_vector_only=True)
    item = case["items"][0]
    (res,) = synthesize(model, [SpeechRequest(text=item["text"], voice=voice, language=item["language"],
                                              sampling=GREEDY, max_frames=31)])
    np.testing.assert_array_equal(res.codes, z["codes_0"])
    np.testing.assert_allclose(res.wav, z["wav_0"], atol=1e-4, rtol=0)


def test_tabulated_text_embeddings_keep_the_golden_codes(tiny_model_dir, golden_cases, golden_npz):
    """`Talker.tabulate_text` (what a CUDA device gets at load): the same text rows, the same greedy codes."""
    model = load_model(tiny_model_dir)
    ids = torch.randint(0, model.config.talker.text_vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    before = model.talker.embed_text(ids)
    model.talker.tabulate_text(chunk=10_000)     # several chunks, the last one short
    assert model.talker.model.text_embedding is None and model.talker.text_projection is None
    torch.testing.assert_close(model.talker.embed_text(ids), before, atol=1e-6, rtol=0)
    for name in ("xvec_en", "icl_en"):
        z = golden_npz(name)
        for i, res in enumerate(synthesize(model, golden_requests(model, golden_cases[name], z))):
            np.testing.assert_array_equal(res.codes, z[f"codes_{i}"])
