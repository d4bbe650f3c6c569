"""engine.audio_io: decoding, mono mix, librosa-compatible resampling, and rejection of bad uploads."""
import io

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.audio_io import AudioError, decode_audio, load_reference, resample


def encode(wav: np.ndarray, sr: int, fmt: str = "WAV", subtype: str | None = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wav, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def sine(freq: float, sr: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(sr * seconds)) / sr)).astype(np.float32)


def peak_frequency(wav: np.ndarray, sr: int) -> float:
    spectrum = np.abs(np.fft.rfft(wav * np.hanning(len(wav))))
    return float(np.fft.rfftfreq(len(wav), 1 / sr)[spectrum.argmax()])


def test_pcm16_is_scaled_like_librosa():
    ints = np.array([0, 1, -1, 32767, -32768, 12345], dtype=np.int16)
    wav, sr = decode_audio(encode(ints, 24000))
    assert sr == 24000 and wav.dtype == np.float32
    np.testing.assert_array_equal(wav, ints.astype(np.float32) / 32768)


def test_float_wav_is_bit_exact():
    x = np.random.default_rng(0).uniform(-1, 1, 5000).astype(np.float32)
    wav, sr = decode_audio(encode(x, 44100, subtype="FLOAT"))
    assert sr == 44100
    np.testing.assert_array_equal(wav, x)


def test_stereo_is_averaged():
    rng = np.random.default_rng(1)
    stereo = rng.uniform(-0.5, 0.5, (3000, 2)).astype(np.float32)
    wav, _ = decode_audio(encode(stereo, 24000, subtype="FLOAT"))
    assert wav.shape == (3000,)
    np.testing.assert_allclose(wav, stereo.mean(axis=1), atol=1e-7)


@pytest.mark.parametrize("fmt,subtype", [("FLAC", "PCM_16"), ("OGG", "VORBIS")])
def test_compressed_formats(fmt, subtype):
    x = sine(440, 24000, 0.5)
    wav, sr = decode_audio(encode(x, 24000, fmt, subtype))
    assert sr == 24000 and abs(len(wav) - len(x)) < 2048
    n = min(len(wav), len(x))
    assert np.corrcoef(wav[:n], x[:n])[0, 1] > 0.99


@pytest.mark.parametrize("sr", [16000, 22050, 48000])
def test_load_reference_resamples_to_24k(sr):
    x = sine(300, sr, 1.3)
    out = load_reference(encode(x, sr))
    assert out.dtype == np.float32 and out.ndim == 1
    assert len(out) == int(np.ceil(len(x) * (24000 / sr)))  # librosa: ceil(n * ratio), ratio rounded first
    assert abs(peak_frequency(out, 24000) - 300) < 2


def test_load_reference_24k_is_unchanged(tmp_path):
    x = np.random.default_rng(2).uniform(-0.9, 0.9, 24000).astype(np.float32)
    data = encode(x, 24000, subtype="FLOAT")
    np.testing.assert_array_equal(load_reference(data), x)
    path = tmp_path / "ref.wav"
    path.write_bytes(data)
    np.testing.assert_array_equal(load_reference(path), x)
    np.testing.assert_array_equal(load_reference(str(path)), x)


def test_resample_22050_to_24000_keeps_frequency_and_length_ratio():
    x = sine(1000, 22050, 2.0)
    y = resample(x, 22050, 24000)
    assert y.dtype == np.float32
    assert len(y) == int(np.ceil(len(x) * (24000 / 22050)))
    assert abs(peak_frequency(y, 24000) - 1000) < 1
    # same amplitude in the steady part (HQ filter: passband flat)
    assert abs(np.abs(y[2000:-2000]).max() - 0.5) < 0.01
    np.testing.assert_array_equal(resample(x, 22050, 22050), x)


def _wav_with_rate(sr: int) -> bytes:
    return encode(np.zeros(int(min(sr, 48000)), np.float32), sr)


BAD_INPUTS = {
    "empty": (b"", "empty"),
    "not bytes": ([1, 2, 3], "must be bytes"),
    "not audio": (b"hello, this is not a sound file" * 20, "cannot decode"),
    "truncated header": (encode(sine(200, 24000, 0.5), 24000)[:20], "cannot decode"),
    "no samples": (encode(np.zeros(0, np.float32), 24000), "no samples"),
    "nan": (encode(np.array([0.0, np.nan, 0.1] * 1000, np.float32), 24000, subtype="FLOAT"), "NaN"),
    "inf": (encode(np.array([0.0, np.inf, 0.1] * 1000, np.float32), 24000, subtype="FLOAT"), "infinite"),
    "rate too low": (_wav_with_rate(100), "sample rate"),
    "rate too high": (_wav_with_rate(1_000_000), "sample rate"),
    "too many channels": (encode(np.zeros((4800, 12), np.float32), 24000, subtype="FLOAT"), "channel"),
    "too long": (encode(np.zeros(24000 * 31, np.int16), 24000), "longer than"),
    "too short": (encode(np.zeros(100, np.int16), 24000), "shorter than"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_audio_error(case):
    data, message = BAD_INPUTS[case]
    with pytest.raises(AudioError, match=message):
        load_reference(data)


def test_missing_file_is_audio_error(tmp_path):
    with pytest.raises(AudioError, match="cannot read"):
        load_reference(tmp_path / "nope.wav")


def test_audio_error_is_value_error():
    assert issubclass(AudioError, ValueError)


def test_decode_reads_at_most_the_limit():
    data = encode(np.zeros(24000 * 5, np.int16), 24000)
    assert decode_audio(data, max_seconds=5)[0].shape == (24000 * 5,)
    with pytest.raises(AudioError, match="longer than"):
        decode_audio(data, max_seconds=4.9)


_VALID_WAV = encode(sine(220, 16000, 0.3), 16000)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=512),
    st.lists(st.tuples(st.integers(0, len(_VALID_WAV) - 1), st.integers(0, 255)), min_size=1, max_size=8)
    .map(lambda edits: _mutate(_VALID_WAV, edits)),
    st.integers(1, len(_VALID_WAV) - 1).map(lambda n: _VALID_WAV[:n]),
))
def test_hostile_bytes_never_crash(data):
    try:
        out = load_reference(data)
    except AudioError:
        return
    assert out.dtype == np.float32 and out.ndim == 1 and np.isfinite(out).all()


def _mutate(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for pos, value in edits:
        b[pos] = value
    return bytes(b)
