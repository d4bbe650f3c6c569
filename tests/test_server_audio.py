"""app/audio.py: encodings, streaming resampler, fixed framing, containers (whole and streamed)."""
import io
import warnings

import numpy as np
import pytest
import soundfile as sf

from app.audio import (ALAW_OF_S16, SAMPLE_RATES, ULAW_OF_S16, AudioFormat, FileStreamEncoder, FormatError,
                       StreamEncoder, check_container, encode_file, encode_samples)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import audioop
    except ImportError:     # Python >= 3.13
        audioop = None


def chunks_of(pcm, sizes):
    out, i = [], 0
    for n in sizes:
        out.append(pcm[i:i + n])
        i += n
    return out


def tone(n, f=440.0):
    return (0.4 * np.sin(np.arange(n) * 2 * np.pi * f / 24000)).astype(np.float32)


@pytest.mark.skipif(audioop is None, reason="audioop is gone in this Python")
def test_g711_tables_match_audioop_for_every_s16_value():
    pcm = np.arange(-32768, 32768, dtype="<i2").tobytes()
    assert np.array_equal(np.frombuffer(audioop.lin2ulaw(pcm, 2), np.uint8), ULAW_OF_S16)
    assert np.array_equal(np.frombuffer(audioop.lin2alaw(pcm, 2), np.uint8), ALAW_OF_S16)


def test_g711_known_values():
    assert encode_samples(np.zeros(1, np.float32), "mulaw") == b"\xff"
    assert encode_samples(np.zeros(1, np.float32), "alaw") == b"\xd5"
    assert encode_samples(np.array([1.0, -1.0], np.float32), "mulaw") == b"\x80\x00"


def test_sample_encodings_round_trip():
    x = tone(1000)
    s16 = np.frombuffer(encode_samples(x, "pcm_s16le"), "<i2")
    assert np.abs(s16 / 32767 - x).max() < 1e-4
    f32 = np.frombuffer(encode_samples(x, "f32le"), "<f4")
    assert np.array_equal(f32, x)
    assert encode_samples(np.array([2.0, -3.0], np.float32), "pcm_s16le") == np.array([32767, -32767], "<i2").tobytes()


@pytest.mark.parametrize("rate", SAMPLE_RATES)
def test_stream_encoder_sample_count_is_exact_however_chunked(rate):
    pcm = tone(25 * 1920)
    a, b = StreamEncoder(AudioFormat("pcm_s16le", rate)), StreamEncoder(AudioFormat("pcm_s16le", rate))
    out_a = [m for c in chunks_of(pcm, [1920] * 25) for m in a.encode(c)] + a.flush()
    out_b = [m for c in chunks_of(pcm, [3840, 15360, 15360, 13440]) for m in b.encode(c)] + b.flush()
    total = len(pcm) * rate // 24000
    for out, enc in ((out_a, a), (out_b, b)):
        assert sum(len(d) for _, d in out) == 2 * total == 2 * enc.samples
        offsets = [o for o, _ in out]
        assert offsets == sorted(offsets) and offsets[0] == 0
    if rate == 24000:
        assert b"".join(d for _, d in out_a) == encode_samples(pcm, "pcm_s16le")


def test_resampled_audio_is_the_same_signal():
    pcm = tone(24000, f=300.0)
    enc = StreamEncoder(AudioFormat("f32le", 8000))
    data = b"".join(d for c in chunks_of(pcm, [1920] * 12 + [960]) for _, d in enc.encode(c)) + \
        b"".join(d for _, d in enc.flush())
    y = np.frombuffer(data, "<f4")
    ref = (0.4 * np.sin(np.arange(8000) * 2 * np.pi * 300 / 8000)).astype(np.float32)
    assert len(y) == 8000
    assert np.abs(y[200:-200] - ref[200:-200]).max() < 0.01


def test_fixed_frames_telephony():
    enc = StreamEncoder(AudioFormat("mulaw", 8000, 20))
    out = [m for c in chunks_of(tone(10 * 1920), [3840] + [1920] * 8) for m in enc.encode(c)] + enc.flush()
    assert all(len(d) == 160 for _, d in out)                    # 20 ms of 8 kHz mu-law
    assert len(out) == 10 * 80 // 20                             # 800 ms of audio, no padding needed
    assert [o for o, _ in out] == [160 * i for i in range(len(out))]


def test_fixed_frames_pad_the_last_frame_with_silence():
    enc = StreamEncoder(AudioFormat("pcm_s16le", 16000, 30))   # 480 samples per frame
    out = enc.encode(tone(1920)) + enc.flush()                   # 1280 samples = 2 frames + 320
    assert [len(d) for _, d in out] == [960, 960, 960]
    assert out[-1][1][640:] == b"\x00" * 320
    assert enc.samples == 1440


@pytest.mark.parametrize("fmt", [dict(encoding="opus"), dict(sample_rate=44000), dict(frame_ms=0),
                                 dict(frame_ms=3000), dict(sample_rate=11025, frame_ms=20), dict(frame_ms=True)])
def test_bad_stream_formats(fmt):
    with pytest.raises(FormatError):
        AudioFormat(**fmt)


@pytest.mark.parametrize("response_format,rate", [("aac", 24000), ("opus", 44100), ("wav", 12345), ("mp4", 24000)])
def test_bad_containers(response_format, rate):
    with pytest.raises(FormatError):
        check_container(response_format, rate)


def resampled_reference(pcm, rate):
    enc = StreamEncoder(AudioFormat("f32le", rate))
    data = b"".join(d for _, d in enc.encode(pcm) + enc.flush())
    return np.frombuffer(data, "<f4")


@pytest.mark.parametrize("response_format", ["wav", "flac", "mp3", "opus"])
@pytest.mark.parametrize("rate", [24000, 16000, 8000])
def test_whole_files_decode(response_format, rate):
    pcm = tone(10 * 1920)
    y, sr = sf.read(io.BytesIO(encode_file(pcm, response_format, rate)), dtype="float32")
    assert sr == rate
    assert len(y) == 10 * 1920 * rate // 24000
    if response_format in ("wav", "flac"):
        assert np.abs(y - resampled_reference(pcm, rate)).max() < 1e-3


@pytest.mark.parametrize("response_format", ["wav", "pcm", "mp3", "opus", "flac"])
def test_streamed_files(response_format):
    pcm = tone(20 * 1920)
    enc = FileStreamEncoder(response_format, 24000)
    pieces = [enc.encode(c) for c in chunks_of(pcm, [3840] + [1920 * 4] * 4 + [5760])] + [enc.flush()]
    data = b"".join(pieces)
    assert sum(1 for p in pieces[:-1] if p) >= 2 or response_format == "opus"   # bytes flow before the end
    if response_format == "pcm":
        assert data == encode_samples(pcm, "pcm_s16le")
        return
    if response_format == "flac":      # a live FLAC stream has no total length, which libsndfile cannot read
        assert data[:4] == b"fLaC" and len(data) > 1000
        return
    y, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == 24000
    n = len(pcm)
    if response_format == "wav":
        assert len(y) == n and np.abs(y - pcm).max() < 1e-4
    else:                               # codec delay/padding: a streamed file has no trimming header
        assert n <= len(y) <= n + 3000
