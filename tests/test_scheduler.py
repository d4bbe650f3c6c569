"""The scheduler on the tiny golden model (CPU, fp32): batch invariance, streaming audio, incremental
text, cancel, out-of-memory recovery, and the golden codes through the whole streaming path.

Audio exactness (streamed windows == one decode of all the codes; alone == in a batch) is checked
with the vocoder in fp64, where a wrong carried state or a lost or repeated sample shows at full
size while float noise is ~1e-13. In fp32 this tiny random vocoder amplifies last-bit differences of
BLAS kernels run at different lengths or batch sizes to ~3e-5 (see tests/test_vocoder.py), so fp32
audio is held to the golden tolerance, 1e-4.
"""
import asyncio
import copy
import itertools
import random
import threading
import time

import numpy as np
import pytest
import torch

from engine.loader import load_model
from engine.requests import AudioChunk, SamplingParams, SpeechRequest, TurnResult, VoicePrompt
from engine.streaming import WindowAudio, WindowPolicy
from engine.scheduler import Overloaded, Scheduler, _Outbox
from oom import inject_out_of_memory

SPF = 1920
GREEDY = SamplingParams(greedy=True)
SEEDED = SamplingParams(seed=1234)

# Golden x-vector / ICL cases (greedy, max_new_tokens=32 -> 31 frames unless EOS).
CASES = {
    "xvec_en": ("Hello world, this is a streaming speech test.", "english", "ref_en", False),
    "xvec_auto": ("Auto language detection, no language tag.", "auto", "ref_en", False),
    "xvec_eos": ("Calibration prompt for the end of speech token.", "english", "ref_calib", False),
    "icl_en": ("I cloned this voice from a short reference clip.", "english", "ref_en", True),
    "icl_zh": ("这是一个零样本语音克隆的例子。", "chinese", "ref_synth", True),
}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def model64(model):
    """The same model with the vocoder in fp64 (talker unchanged, so the codes are the same)."""
    m = copy.copy(model)
    m.vocoder = copy.deepcopy(model.vocoder).double()
    return m


@pytest.fixture(scope="module")
def voices(golden_npz):
    out = {}
    for ref in ("ref_en", "ref_synth", "ref_calib"):
        z = golden_npz(ref)
        xvector = torch.from_numpy(z["xvector"])
        out[ref] = VoicePrompt(xvector)
        out[ref + "_icl"] = VoicePrompt(xvector, torch.from_numpy(z["ref_codes"]),
                                        [int(i) for i in z["ref_text_ids"][3:-2]])   # R = ref_ids[3:-2]
    return out


@pytest.fixture(params=["sequential", "overlapped", "audio-after-windows", "deferred-audio"])
def overlap(request, monkeypatch):
    """The scheduler reading each step back at once (the CPU's default), or while the next one runs
    (a CUDA device's: the host one step behind), sending the last windows' audio before or after
    launching the next ones (`Scheduler.audio_after_windows`), or as it lands (`Scheduler.defer_audio`:
    here two looks in three find a window's audio not there yet, as a busy GPU's would be, so it goes
    out only when it must, or a look or two later)."""
    if request.param == "audio-after-windows":
        monkeypatch.setattr(Scheduler, "audio_after_windows", True)
    if request.param == "deferred-audio":
        monkeypatch.setattr(Scheduler, "defer_audio", 3)
        looks = itertools.count()
        monkeypatch.setattr(WindowAudio, "ready", lambda self: next(looks) % 3 == 0)
    return request.param != "sequential"


def request(voices, case, sampling=GREEDY, max_frames=31, **kw):
    text, language, ref, icl = CASES[case]
    return SpeechRequest(text, voices[ref + ("_icl" if icl else "")], language, sampling,
                         max_frames=max_frames, **kw)


def audio(chunks):
    return np.concatenate([c.pcm for c in chunks]) if chunks else np.zeros(0, np.float32)


def check_stream(chunks, result, window=(2, 8)):
    """Chunks tile the turn with no gap or overlap and add up to frames*1920; unless window is None,
    the first has window[0] frames and the others one of the policy's sizes (but the last: a flush)."""
    sizes = WindowPolicy(*window).sizes() if window else None
    offset = 0
    for i, c in enumerate(chunks):
        assert c.pcm.dtype == np.float32 and c.sample_offset == offset and c.frame_offset == offset // SPF
        frames = c.pcm.shape[0] // SPF
        assert c.pcm.shape[0] == frames * SPF and frames > 0
        if sizes and i < len(chunks) - 1:
            assert frames in ([window[0]] if i == 0 else sizes), [len(c.pcm) // SPF for c in chunks]
        offset += c.pcm.shape[0]
    assert offset == result.samples == result.frames * SPF


def one_shot(model, codes, voice):
    """Decoding all the codes at once (prefixed by the reference in ICL), the reference part dropped."""
    codes = torch.from_numpy(codes)
    if voice.icl:
        codes = torch.cat([voice.ref_codes, codes])
    wav = model.vocoder.decode_unchunked(codes[None])[0].float().numpy()
    return wav[(voice.ref_codes.shape[0] if voice.icl else 0) * SPF:]


def run_alone(model, req, **kw):
    with Scheduler(model, 1, keep_codes=True, **kw) as sch:
        return sch.submit(req).collect(60)


def wait_steps(sch, steps, timeout=30):
    deadline = time.monotonic() + timeout
    while sch.stats().steps < steps:
        assert time.monotonic() < deadline, "scheduler made no progress"
        time.sleep(0.001)


EXACT = 1e-5     # fp64 vocoder: only its fp32 RoPE tables differ between window sizes (~3e-6)
FP32 = 1e-4      # the golden waveform tolerance


@pytest.mark.parametrize("precision", ["fp32", "fp64-vocoder"])
def test_golden_cases_stream_exactly(model, model64, voices, golden_npz, precision, overlap):
    """Golden cases in one batch: golden codes, golden audio (1e-4), streamed == one-shot decode."""
    m, tol, cases = (model, FP32, list(CASES)) if precision == "fp32" else (model64, EXACT, ["xvec_eos", "icl_en"])
    with Scheduler(m, 8, overlap=overlap, keep_codes=True) as sch:
        handles = {case: sch.submit(request(voices, case)) for case in cases}
        results = {case: h.collect(60) for case, h in handles.items()}
    for case, (chunks, result) in results.items():
        g = golden_npz(case)
        np.testing.assert_array_equal(result.codes, g["codes_0"], err_msg=case)
        assert result.reason == ("eos" if case == "xvec_eos" else "max_frames")
        check_stream(chunks, result)
        wav = audio(chunks)
        np.testing.assert_allclose(wav, one_shot(m, result.codes, request(voices, case).voice), rtol=0, atol=tol)
        # The official ICL cut may keep one extra reference sample at the start (MODEL.md 9.2).
        np.testing.assert_allclose(wav, g["wav_0"][-wav.shape[0]:], rtol=0, atol=FP32)
        assert 0 < result.ttfa_ms and result.queue_ms <= result.ttfa_ms


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_alone_equals_in_batch_arriving_at_different_frames(model64, voices, sampling, overlap):
    model = model64
    target = request(voices, "icl_en", sampling, max_frames=20)
    alone_chunks, alone = run_alone(model, target, overlap=overlap)
    companions = ["xvec_en", "xvec_eos", "icl_zh", "xvec_auto", "xvec_en", "icl_en", "xvec_eos"]
    arrivals = []
    with Scheduler(model, 8, overlap=overlap, keep_codes=True) as sch:
        handles = []
        for i, case in enumerate(companions[:3]):
            handles.append(sch.submit(request(voices, case, SamplingParams(seed=i), max_frames=22 - 3 * i)))
        wait_steps(sch, 3)
        arrivals.append(sch.stats().steps)
        mine = sch.submit(target)
        for i, case in enumerate(companions[3:]):
            wait_steps(sch, arrivals[-1] + 2)
            arrivals.append(sch.stats().steps)
            handles.append(sch.submit(request(voices, case, SamplingParams(greedy=i % 2 == 0, seed=7 + i),
                                              max_frames=6 + 4 * i)))
        chunks, batched = mine.collect(60)
        others = [h.collect(60) for h in handles]
    assert len(set(arrivals)) == len(arrivals)     # they really joined at different frames
    assert all(r.reason in ("eos", "max_frames") for _, r in others)
    np.testing.assert_array_equal(batched.codes, alone.codes)
    assert batched.frames == alone.frames and batched.reason == alone.reason
    check_stream(chunks, batched)
    np.testing.assert_allclose(audio(chunks), audio(alone_chunks), rtol=0, atol=EXACT)


def test_64_concurrent_requests_of_different_lengths(model, voices, golden_npz, overlap):
    """16 slots, chunked prefill (8 positions per row, 24 per step) and cache pages of 4 positions
    (turns outgrow their reservations): every request gets the first frames of its golden codes
    (greedy), as many as its limit allows, and every page is back on the free list at the end."""
    cases = list(CASES)
    golden = {case: golden_npz(case)["codes_0"] for case in cases}
    with Scheduler(model, 16, overlap=overlap, keep_codes=True, window_frames=(1, 4), kv_page_size=4,
                   prefill_chunk=8, prefill_budget=24) as sch:
        jobs = []
        for i in range(64):
            case, frames = cases[i % len(cases)], (i * 7) % 23
            jobs.append((case, frames, sch.submit(request(voices, case, max_frames=frames))))
        done = [(case, frames, *h.collect(120)) for case, frames, h in jobs]
        stats = sch.stats()
        cache = sch.runner.cache
        assert cache.pages_in_use == 0 and cache.pages_free > 0
    for case, frames, chunks, result in done:
        expected = min(frames, 18) if case == "xvec_eos" else frames    # xvec_eos stops on EOS after 18
        assert result.frames == expected, (case, frames, result)
        assert result.reason == ("eos" if case == "xvec_eos" and frames >= 18 else "max_frames")
        np.testing.assert_array_equal(result.codes, golden[case][:expected])
        check_stream(chunks, result, window=(1, 4))
    assert stats.active == 0 and stats.queued == 0 and stats.frames_generated == sum(r.frames for *_, r in done)
    assert stats.kv_cache_bytes == cache.bytes_held() > 0
    phases = {"admission", "prefill", "step launch", "read-back", "vocoder launch", "audio out"}
    assert set(stats.host_seconds) == phases and all(t > 0 for t in stats.host_seconds.values())


@pytest.mark.parametrize("defer", [2, 1000])
def test_deferred_audio_waits_only_when_it_must(model, voices, golden_npz, monkeypatch, defer):
    """`defer_audio` with audio that never lands by itself (as a GPU far behind would have it): every
    window still goes out, in order and whole (golden codes, chunks that tile each turn), because each is
    waited for when it must be: a session's first audio at once, the others `defer` iterations late or
    at the latest before a step could write over the codes they read (`ring_iterations` after their
    launch), or once there is no step left to run. Windows are left unsent meanwhile (the point of it).
    (No listener counts as running short here, however slow the machine: the window policy's
    simulation tests that rule.)"""
    monkeypatch.setattr(Scheduler, "defer_audio", defer)
    monkeypatch.setattr(WindowAudio, "ready", lambda self: False)
    monkeypatch.setattr(WindowPolicy, "running_short", lambda self, held_s, step_s: False)
    with Scheduler(model, 4, overlap=True, keep_codes=True, window_frames=(1, 2)) as sch:
        ages, first_audio_ages = [], []
        launch_step, send_audio = sch._launch_step, sch._send_audio

        def launch_checked(launched):     # iterations since the oldest unsent launch, at each step's launch
            ages.append(sch._iterations - min((u.iteration for u in sch._unsent), default=sch._iterations))
            launch_step(launched)

        def send_timed(launched):         # iterations from a first window's launch to its audio
            if any(s.samples == 0 for sessions, _ in launched.windows for s in sessions):
                first_audio_ages.append(sch._iterations - launched.iteration)
            send_audio(launched)

        monkeypatch.setattr(sch, "_launch_step", launch_checked)
        monkeypatch.setattr(sch, "_send_audio", send_timed)
        cases = ["xvec_en", "icl_en", "xvec_eos", "icl_zh", "xvec_auto", "xvec_en"]
        handles = [(case, sch.submit(request(voices, case, max_frames=24))) for case in cases]
        done = [(case, *h.collect(60)) for case, h in handles]
    for case, chunks, result in done:
        np.testing.assert_array_equal(result.codes, golden_npz(case)["codes_0"][:result.frames])
        check_stream(chunks, result, window=(1, 2))
    ring = sch.vocoder.ring_iterations
    assert max(ages) < ring, "a step launched while a window's codes could still be read"
    assert max(ages) == min(defer, ring - 2) + 1, "audio left for later iterations, as late as allowed"
    assert max(first_audio_ages) == 1      # first audio: the iteration after its window's launch


def test_text_in_pieces_gives_the_same_codes(model, voices, overlap):
    whole = request(voices, "xvec_en")
    expected_chunks, expected = run_alone(model, whole, overlap=overlap)
    text = whole.text
    pieces = [text[:1], text[1:4], text[4:12], text[12:13], text[13:27], text[27:]]
    assert "".join(pieces) == text
    with Scheduler(model, 2, overlap=overlap, keep_codes=True) as sch:
        busy = sch.submit(request(voices, "xvec_auto"))       # keeps steps going while text is missing
        h = sch.submit(SpeechRequest("", whole.voice, whole.language, GREEDY, text_complete=False, max_frames=31))
        for piece in pieces:
            h.push_text(piece)
            wait_steps(sch, sch.stats().steps + 3)
        early = h.get(30)              # audio made so far is sent while the text is still incomplete
        assert isinstance(early, AudioChunk)
        h.finish_text()
        chunks, result = h.collect(60)
        busy.collect(60)
        stats = sch.stats()
    chunks = [early, *chunks]
    assert stats.text_waits > 0                                # it did sit out steps waiting for text
    np.testing.assert_array_equal(result.codes, expected.codes)
    check_stream(chunks, result, window=None)
    np.testing.assert_allclose(audio(chunks), audio(expected_chunks), rtol=0, atol=FP32)
    with pytest.raises(RuntimeError):
        h.push_text("more")


def test_a_burst_is_admitted_with_one_text_embedding_call(model, voices, golden_npz, monkeypatch):
    """Requests waiting together are admitted together: their prompts' texts embedded in one call (a
    call a session was most of a burst's admission time), and each turn still gets its golden codes."""
    calls = []
    embed_text = model.prompts.embed_text
    monkeypatch.setattr(model.prompts, "embed_text", lambda ids: calls.append(len(ids)) or embed_text(ids))
    cases = ["xvec_en", "icl_en", "xvec_auto", "icl_zh"]
    sch = Scheduler(model, 4, keep_codes=True)
    handles = {case: sch.submit(request(voices, case)) for case in cases}
    with sch:                                   # started with all four waiting
        results = {case: h.collect(60)[1] for case, h in handles.items()}
    assert len(calls) == 1 and calls[0] > len(cases)
    for case, result in results.items():
        np.testing.assert_array_equal(result.codes, golden_npz(case)["codes_0"], err_msg=case)


def test_stop_ends_open_requests(model, voices, overlap):
    sch = Scheduler(model, 1, overlap=overlap).start()
    waiting_for_text = sch.submit(SpeechRequest("Hello", voices["ref_en"], "english", GREEDY, text_complete=False))
    queued = sch.submit(request(voices, "xvec_en"))
    sch.stop(30)
    for h in (waiting_for_text, queued):
        _, r = h.collect(5)
        assert r.reason == "error" and r.error == "scheduler stopped"
    with pytest.raises(RuntimeError):
        sch.submit(request(voices, "xvec_en"))


def test_incremental_icl_starts_once_its_prompt_text_is_there(model, voices, overlap):
    whole = request(voices, "icl_zh")
    _, expected = run_alone(model, whole, overlap=overlap)
    with Scheduler(model, 1, overlap=overlap, keep_codes=True) as sch:
        h = sch.submit(SpeechRequest(whole.text[:3], whole.voice, whole.language, GREEDY, text_complete=False,
                                     max_frames=31))
        time.sleep(0.05)
        assert sch.stats().steps == 0 and sch.stats().queued == 1   # not enough text for the ICL prompt yet
        for ch in whole.text[3:]:
            h.push_text(ch)
        h.finish_text()
        _, result = h.collect(60)
    np.testing.assert_array_equal(result.codes, expected.codes)


def test_cancel_frees_the_slot_within_one_step(model, voices, monkeypatch, overlap):
    with Scheduler(model, 2, overlap=overlap, keep_codes=True) as sch:
        closed_at = {}
        close = sch._close

        def recording_close(s, reason, error=None):
            closed_at[reason] = sch.stats().steps
            close(s, reason, error)

        monkeypatch.setattr(sch, "_close", recording_close)
        long_ = sch.submit(request(voices, "xvec_en"))
        victim = sch.submit(request(voices, "icl_en"))
        queued = sch.submit(request(voices, "xvec_auto", max_frames=5))    # no free slot yet
        first = victim.get(30)
        assert isinstance(first, AudioChunk)
        victim.cancel()
        at_cancel = sch.stats().steps
        chunks, result = victim.collect(30)
        assert result.reason == "cancelled" and result.frames < 31
        assert closed_at["cancelled"] - at_cancel <= 1
        assert result.samples == first.pcm.shape[0] + sum(c.pcm.shape[0] for c in chunks)   # what was sent
        _, r = queued.collect(30)                                  # the freed slot took the queued request
        assert r.reason == "max_frames" and r.frames == 5
        assert long_.collect(30)[1].frames == 31
        # Cancelling a request that is still queued ends it without it ever taking a slot.
        waiting = sch.submit(SpeechRequest("", voices["ref_en"], "english", GREEDY, text_complete=False))
        waiting.cancel()
        _, r = waiting.collect(30)
        assert r.reason == "cancelled" and r.frames == 0 and sch.stats().queued == 0


def test_out_of_memory_mid_step_is_recovered(model, voices, golden_npz, monkeypatch, overlap):
    cases = ["xvec_en", "icl_en", "xvec_eos", "icl_zh"]
    failing = {"talker": {2, 3, 9, 10, 11, 12, 20}, "predictor": {5, 14}, "vocoder": {1, 4, 5}}
    inject_out_of_memory(monkeypatch, model, failing)
    # 2-frame windows throughout, so the vocoder makes its calls 1, 4 and 5 whatever the machine's speed
    # (past the first, a window's size follows how far generation runs ahead of real time)
    with Scheduler(model, 4, overlap=overlap, keep_codes=True, oom_defer_iterations=1, window_frames=(2, 2)) as sch:
        handles = [sch.submit(request(voices, c)) for c in cases]
        results = [h.collect(60) for h in handles]
        assert sch.stats().oom_recoveries == sum(len(f) for f in failing.values())
    monkeypatch.undo()
    for case, (chunks, result) in zip(cases, results):
        assert result.reason == ("eos" if case == "xvec_eos" else "max_frames")
        np.testing.assert_array_equal(result.codes, golden_npz(case)["codes_0"])
        np.testing.assert_allclose(audio(chunks), one_shot(model, result.codes, request(voices, case).voice),
                                   rtol=0, atol=FP32)
        check_stream(chunks, result)


def test_admissions_wait_for_cache_room(model, voices, golden_npz):
    """With room in the cache's page budget for one turn's estimate, a second turn waits in the
    queue until the first ends and its pages come back; both get their golden codes."""
    with Scheduler(model, 2, keep_codes=True, kv_page_size=4) as sch:
        sch.submit(request(voices, "xvec_en")).collect(60)
        one_turn = sch.runner.cache.pages_held          # pages the turn's estimate took
    with Scheduler(model, 2, keep_codes=True, kv_page_size=4) as sch:
        sch.runner.cache.max_pages = one_turn + one_turn // 2
        first, second = (sch.submit(request(voices, "xvec_en")) for _ in range(2))
        wait_steps(sch, 3)
        stats = sch.stats()
        assert (stats.active, stats.queued) == (1, 1)
        results = [first.collect(60)[1], second.collect(60)[1]]
    for r in results:
        assert r.reason == "max_frames"
        np.testing.assert_array_equal(r.codes, golden_npz("xvec_en")["codes_0"])
    with Scheduler(model, 2, kv_page_size=4) as sch:       # a turn whose estimate never fits: an error
        sch.runner.cache.max_pages = 2
        _, result = sch.submit(request(voices, "xvec_en")).collect(60)
        assert result.reason == "error" and "does not fit in the KV cache" in result.error


def test_out_of_memory_while_reserving_admits_the_turns_before_it(model, voices, golden_npz, monkeypatch):
    """Turns admitted together reserve their cache pages in one go, in order: the device running out
    of memory at the second turn's first page admits the first, and the others wait and come in once
    admissions resume. Every turn gets its golden codes."""
    sch = Scheduler(model, 3, keep_codes=True, kv_page_size=4, oom_defer_iterations=2)
    prompt = sch.prompts.build(model.tokenizer.text_ids(CASES["xvec_en"][0]), voices["ref_en"], "english")
    pages_first_turn = -(-(prompt.embeds.shape[0] + 31 + 1) // 4)      # its estimate: the prompt and 31 frames
    take_page, taken = sch.runner.cache._take_page, []

    def flaky():
        taken.append(1)
        if len(taken) == pages_first_turn + 1:
            raise torch.OutOfMemoryError("injected: the second turn's first page")
        return take_page()
    monkeypatch.setattr(sch.runner.cache, "_take_page", flaky)
    handles = [sch.submit(request(voices, "xvec_en")) for _ in range(3)]
    with sch:
        results = [h.collect(60)[1] for h in handles]
    assert sch.stats().oom_recoveries == 1
    assert results[0].queue_ms < min(r.queue_ms for r in results[1:])
    for r in results:
        np.testing.assert_array_equal(r.codes, golden_npz("xvec_en")["codes_0"])


def test_a_turn_that_outgrows_a_full_cache_ends_with_its_audio(model, voices, golden_npz, overlap):
    """A turn that runs past its reservation when the page budget is spent ends as at its frame
    limit after the retries, with every frame it made delivered, and its pages come back."""
    with Scheduler(model, 1, overlap=overlap, keep_codes=True, kv_page_size=4, frames_per_token=0.0, frame_margin=2,
                   oom_defer_iterations=1) as sch:
        cache = sch.runner.cache
        cache.max_pages = 8
        chunks, result = sch.submit(request(voices, "xvec_en")).collect(60)
        assert cache.pages_in_use == 0 and sch.stats().oom_recoveries == 0    # a budget, not a device error
    assert result.reason == "max_frames" and 0 < result.frames < 31
    assert sch.runner.lengths[0] == 8 * 4          # it ran until every position it could have was used
    np.testing.assert_array_equal(result.codes, golden_npz("xvec_en")["codes_0"][:result.frames])
    check_stream(chunks, result)


def test_async_iteration_and_limits(model, voices, overlap):
    async def speak(sch):
        h = sch.submit(request(voices, "xvec_eos", SEEDED, max_frames=7))
        items = [item async for item in h]
        return h, items

    with Scheduler(model, 2, overlap=overlap, window_frames=(1, 3)) as sch:
        h, items = asyncio.run(speak(sch))
    assert all(isinstance(i, AudioChunk) for i in items[:-1]) and isinstance(items[-1], TurnResult)
    check_stream(items[:-1], items[-1], window=(1, 3))
    assert items[-1].frames == 7 and items[-1].codes is None
    assert h.id

    idle = Scheduler(model, 1, overlap=overlap, max_queue=2)      # not started: submissions just queue
    for _ in range(3):                           # one for the free slot, two waiting
        idle.submit(request(voices, "xvec_en"))
    with pytest.raises(Overloaded):
        idle.submit(request(voices, "xvec_en"))
    with pytest.raises(ValueError):
        idle.submit(SpeechRequest("text", voices["ref_en"], "klingon"))
    with pytest.raises(ValueError):
        idle.submit(SpeechRequest("", voices["ref_en"]))


def test_a_slow_iteration_is_logged_with_its_phases(model, voices, caplog, overlap):
    """An iteration longer than `slow_iteration_s` (here a vocoder window made slow) is logged with the
    time of each phase, and the turn still completes."""
    with Scheduler(model, 2, overlap=overlap, slow_iteration_s=0.15) as sch:
        launch_windows, slowed = sch._launch_windows, []

        def slow_launch_windows(ended, launched, after=None):
            if sch.stats().steps >= 3 and not slowed:
                slowed.append(True)
                time.sleep(0.3)
            launch_windows(ended, launched, after)
        sch._launch_windows = slow_launch_windows
        with caplog.at_level("WARNING", logger="engine.scheduler"):
            chunks, result = sch.submit(request(voices, "xvec_en", max_frames=8)).collect(60)
    assert result.reason == "max_frames" and result.frames == 8
    slow = [r.getMessage() for r in caplog.records if "slow engine iteration" in r.getMessage()]
    this = [m for m in slow if float(m.split("vocoder launch ")[1].split(",")[0].split(" ms")[0]) >= 290]
    assert len(this) == 1 and "1 decoding" in this[0] and "0 Triton kernels compiled" in this[0], slow


def test_a_burst_of_chunks_wakes_the_readers_loop_once():
    """Chunks put into 64 outboxes from another thread all reach their readers on one event loop,
    in order, and a burst costs the loop one wake-up (a call_soon_threadsafe), not one per chunk."""
    boxes = [_Outbox() for _ in range(64)]
    pcm = np.zeros(4, np.float32)

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        plain = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), plain(*a))[1]
        received = {i: [] for i in range(len(boxes))}

        async def read(i):
            while len(received[i]) < 3:
                received[i].append((await boxes[i].aget()).frame_offset)
        readers = [asyncio.create_task(read(i)) for i in range(len(boxes))]
        await asyncio.sleep(0.05)                # every reader waits on its outbox

        def burst(k):
            for box in boxes:
                box.put(AudioChunk(pcm, k, 0))
        for k in range(3):
            thread = threading.Thread(target=burst, args=(k,))
            thread.start()
            thread.join()                        # the whole burst is in before the loop runs again
            await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        return received, len(wakeups)

    received, wakeups = asyncio.run(main())
    assert all(r == [0, 1, 2] for r in received.values())
    assert wakeups == 3


def test_a_first_window_goes_to_the_device_ahead_of_the_next_step(model, voices):
    """Overlapped, the step in flight that closes a session's first window is read back before the
    next step is launched: the first window's decode comes right after its two frames' steps (time
    to first audio is not one step longer), and later windows follow the step after them. Windows of
    2 frames throughout: past the first, their size follows how far generation runs ahead of real time
    (`WindowPolicy`, its own tests), which is the machine's speed here."""
    calls = []
    with Scheduler(model, 1, overlap=True, window_frames=(2, 2)) as sch:
        step, decode = sch.runner.step, sch.vocoder.decode
        sch.runner.step = lambda *a: (calls.append("step"), step(*a))[1]
        sch.vocoder.decode = lambda slots, frames, after=None: (calls.append(f"window {frames}"),
                                                                decode(slots, frames, after=after))[1]
        chunks, result = sch.submit(request(voices, "xvec_en", max_frames=12)).collect(60)
    assert result.frames == 12 and [c.pcm.shape[0] // SPF for c in chunks][0] == 2
    assert calls[:3] == ["step", "step", "window 2"]
    # frames 2 and 3 (steps 3 and 4) close the next window, read back while step 5 runs
    assert calls[3:7] == ["step", "step", "step", "window 2"], calls


def test_random_traffic_gives_each_session_its_own_audio(model64, voices, overlap):
    """Sessions arriving at random moments, some with their text in pieces, some cancelled after a
    few chunks, ending on EOS or at random frame limits, 6 slots for 20 turns: each gets the codes it
    makes alone (seeded sampling is batch-invariant), chunks that tile its turn, and the audio of its
    codes (fp64 vocoder: exact); a cancelled one gets a prefix of that."""
    rng = random.Random(5)
    plans = []
    for i in range(20):
        case = "xvec_eos" if i % 5 == 0 else rng.choice(list(CASES))    # greedy, it ends on EOS after 18
        sampling = GREEDY if i % 5 == 0 else SamplingParams(seed=50 + i, temperature=0.8)
        req = request(voices, case, sampling, max_frames=24 if i % 5 == 0 else rng.randint(0, 24))
        plans.append((req, rng.choice([1, 1, 3]), rng.choice([None, None, None, 1, 3]), rng.uniform(0, 0.05)))
    alone = [run_alone(model64, req) for req, *_ in plans]
    received = [None] * len(plans)

    def listen(i, h, cancel_after):
        chunks = []
        while True:
            item = h.get(60)
            if isinstance(item, TurnResult):
                received[i] = (chunks, item)
                return
            chunks.append(item)
            if len(chunks) == cancel_after:
                h.cancel()

    with Scheduler(model64, 6, overlap=overlap, keep_codes=True, window_frames=(1, 4)) as sch:
        listeners = []
        for i, (req, pieces, cancel_after, pause) in enumerate(plans):
            time.sleep(pause)
            if pieces == 1:
                h = sch.submit(req)
            else:
                h = sch.submit(SpeechRequest("", req.voice, req.language, req.sampling, text_complete=False,
                                             max_frames=req.max_frames))
            listeners.append(threading.Thread(target=listen, args=(i, h, cancel_after)))
            listeners[-1].start()
            if pieces > 1:
                cuts = sorted(rng.sample(range(1, len(req.text)), pieces - 1))
                for a, b in zip([0, *cuts], [*cuts, len(req.text)]):
                    h.push_text(req.text[a:b])
                    time.sleep(0.01)
                h.finish_text()
        for t in listeners:
            t.join(120)
        assert sch.stats().active == 0 and sch.runner.cache.pages_in_use == 0
    for (req, _, cancel_after, _), (chunks, result), (alone_chunks, expected) in zip(plans, received, alone):
        if result.reason == "cancelled":
            assert cancel_after is not None and result.frames <= expected.frames
            np.testing.assert_array_equal(result.codes, expected.codes[:result.frames])
            assert result.samples == sum(c.pcm.shape[0] for c in chunks) <= result.frames * SPF
            np.testing.assert_allclose(audio(chunks), audio(alone_chunks)[:result.samples], rtol=0, atol=EXACT)
            continue
        assert (result.reason, result.frames) == (expected.reason, expected.frames)
        np.testing.assert_array_equal(result.codes, expected.codes)
        check_stream(chunks, result, window=None)
        np.testing.assert_allclose(audio(chunks), audio(alone_chunks), rtol=0, atol=EXACT)
    assert {r.reason for _, r in received} == {"eos", "max_frames", "cancelled"}


def test_an_icl_voice_is_primed_once_and_copied_after(model64, voices):
    """The vocoder stream of an ICL voice is primed by decoding its reference once; later sessions
    with the same voice (together, or in a later iteration) start from a copy of that state and get
    exactly the audio of their codes decoded after the reference."""
    voice = voices["ref_en_icl"]
    t_ref = voice.ref_codes.shape[0]
    with Scheduler(model64, 4, keep_codes=True) as sch:
        widths = []
        decode = sch.vocoder.streams.decode
        sch.vocoder.streams.decode = lambda slots, codes: (widths.append(codes.shape[1]), decode(slots, codes))[1]
        first = [sch.submit(request(voices, "icl_en", SamplingParams(seed=i), max_frames=6)) for i in range(2)]
        results = [h.collect(60) for h in first]
        results.append(sch.submit(request(voices, "icl_en", SamplingParams(seed=2), max_frames=6)).collect(60))
    assert widths.count(t_ref) == 1 and t_ref > 8       # the only window of the reference's length
    for chunks, result in results:
        assert result.frames == 6
        np.testing.assert_allclose(audio(chunks), one_shot(model64, result.codes, voice), rtol=0, atol=EXACT)


def test_the_engine_loop_reads_nothing_back_but_its_results(model, voices, monkeypatch):
    """On a GPU the host stays one step ahead only while nothing in an iteration waits for the device. Turns
    joining and leaving the slots (ICL and x-vector, overlapped as on a GPU) make no `.item()`, `.tolist()`,
    `.cpu()`, `.nonzero()` or `t[mask]` on a tensor, and no `t[index] = <Python number>` (an upload from
    pageable memory: on a GPU it waits for the step in flight, as the admissions' resets did; bench/README,
    eighteenth session). The results come back as host copies (`engine.host.ToHost`), read with
    `.numpy()`."""
    import traceback
    waits = []

    def note(what):
        frames = [f for f in traceback.extract_stack() if "/engine/" in f.filename]
        if frames:
            f = frames[-1]
            waits.append(f"{what} at {f.filename.rsplit('/engine/')[-1]}:{f.lineno} {f.line}")

    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def masked(index):      # a boolean mask as an index: its size comes from the device (a nonzero)
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

    def checked_getitem(t, index):
        if masked(index):
            note("t[mask]")
        return getitem(t, index)

    def checked_setitem(t, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        if isinstance(value, (bool, int, float)) and any(isinstance(p, (torch.Tensor, list)) for p in parts):
            note("t[index] = scalar")
        if masked(index):
            note("t[mask] = ...")
        return setitem(t, index, value)
    monkeypatch.setattr(torch.Tensor, "__getitem__", checked_getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", checked_setitem)
    for name in ("item", "tolist", "cpu", "nonzero"):
        def read(t, *args, _name=name, _real=getattr(torch.Tensor, name), **kwargs):
            note(_name)
            return _real(t, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    with Scheduler(model, 3, overlap=True) as sch:
        handles = [sch.submit(request(voices, case, SamplingParams(seed=i, min_new_tokens=frames), max_frames=frames))
                   for i, (case, frames) in enumerate([("xvec_en", 6), ("icl_en", 9), ("xvec_auto", 4),
                                                       ("icl_zh", 7), ("xvec_en", 5)])]
        results = [h.collect(60)[1] for h in handles]
    assert [r.reason for r in results] == ["max_frames"] * 5
    assert waits == []


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_a_slot_goes_to_the_next_session_once_the_last_audio_of_the_one_before_is_out(model, voices, overlap):
    """An ended session holds its slot until its last window's audio is sent (on a GPU that window may
    take its codes from the slot's ring after later steps were launched: no other session may write
    there first); then the next session takes the slot, and each gets all of its own audio."""
    sch = Scheduler(model, 1, overlap=overlap)
    closed_at_start, start = [], sch.vocoder.start

    def recording_start(slots, ref_codes):
        closed_at_start.append([h._session.closed for h in handles])
        return start(slots, ref_codes)
    sch.vocoder.start = recording_start
    handles = [sch.submit(request(voices, "xvec_en", SamplingParams(seed=i, min_new_tokens=n), max_frames=n))
               for i, n in enumerate((5, 7, 3))]      # all queued before the engine thread starts
    with sch:
        results = [h.collect(60) for h in handles]
    assert closed_at_start == [[False] * 3, [True, False, False], [True, True, False]]
    for (chunks, result), n in zip(results, (5, 7, 3)):
        assert result.reason == "max_frames" and result.frames == n and audio(chunks).shape[0] == n * SPF
