"""Reading untrusted reference audio: decode, validate, mix to mono, resample to 24 kHz.

The official code loads references with `librosa.load(path, sr=None)` (soundfile underneath: PCM is
scaled by 1/32768, channels are averaged) and resamples with `librosa.resample`, i.e. soxr at HQ
quality, then fixes the length to ceil(n * sr_out / sr_in) (MODEL.md §4.1, §8.1, T28). This module
does the same without librosa. Every way an upload can be wrong raises `AudioError`, which a server
maps to HTTP 422; bounded reads keep a small compressed file from expanding into gigabytes.
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

TARGET_RATE = 24000
MIN_RATE = 4000      # below this there is no usable speech band
MAX_RATE = 192000
MAX_CHANNELS = 8


class AudioError(ValueError):
    """The audio cannot be used as a reference; the message says why (for the client)."""


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/OGG/MP3/... file held in memory to (float32 mono [n], sample rate).

    With `max_seconds`, at most that much audio is decoded; longer input is an AudioError.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AudioError(f"audio data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise AudioError("audio data is empty")
    try:
        with sf.SoundFile(io.BytesIO(bytes(data))) as f:
            sr, channels = f.samplerate, f.channels
            if not MIN_RATE <= sr <= MAX_RATE:
                raise AudioError(f"unsupported sample rate {sr} Hz (expected {MIN_RATE}..{MAX_RATE} Hz)")
            if not 1 <= channels <= MAX_CHANNELS:
                raise AudioError(f"unsupported channel count {channels} (expected 1..{MAX_CHANNELS})")
            limit = -1 if max_seconds is None else math.floor(max_seconds * sr) + 1
            frames = f.read(frames=limit, dtype="float32", always_2d=True)
    except AudioError:
        raise
    except (RuntimeError, TypeError, ValueError, OSError, EOFError) as e:  # LibsndfileError is a RuntimeError
        reason = getattr(e, "error_string", None) or str(e)  # libsndfile's reason, without the BytesIO repr
        raise AudioError(f"cannot decode audio (not a supported audio file, or truncated): {reason}") from e
    if frames.shape[0] == 0:
        raise AudioError("audio contains no samples")
    if max_seconds is not None and frames.shape[0] > max_seconds * sr:
        raise AudioError(f"audio is longer than the {max_seconds:g} s limit")
    if not np.isfinite(frames).all():
        raise AudioError("audio contains NaN or infinite samples")
    wav = frames[:, 0] if channels == 1 else frames.T.mean(axis=0)  # librosa.to_mono
    return np.ascontiguousarray(wav, dtype=np.float32), sr


def resample(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """librosa.resample(wav, orig_sr=sr_in, target_sr=sr_out) with its default res_type 'soxr_hq'."""
    wav = np.asarray(wav, dtype=np.float32)
    if sr_in == sr_out:
        return wav
    out = soxr.resample(wav, sr_in, sr_out, quality="soxr_hq")
    n_out = int(np.ceil(wav.shape[-1] * (float(sr_out) / sr_in)))  # librosa's fix_length target
    if out.shape[-1] > n_out:
        out = out[:n_out]
    elif out.shape[-1] < n_out:
        out = np.pad(out, (0, n_out - out.shape[-1]))
    return np.ascontiguousarray(out, dtype=np.float32)


# The built-in voice: espeak-ng en-us saying "Hello, this is the default voice of the speech server."
# (3.2 s, 24 kHz PCM16), cloned from its x-vector where no reference is given (the server's default
# voice, `qwen3-tts synth` without --ref-audio).
BUILTIN_VOICE_WAV = Path(__file__).resolve().parent / "assets" / "default_voice.wav"


def load_reference(data: bytes | str | Path, max_seconds: float = 30.0, min_seconds: float = 0.1) -> np.ndarray:
    """A reference voice sample (file bytes or a path) as float32 mono at 24 kHz.

    `min_seconds` keeps out clips too short for the speaker encoder's convolutions.
    """
    if isinstance(data, (str, Path)):
        try:
            data = Path(data).read_bytes()
        except OSError as e:
            raise AudioError(f"cannot read reference audio file {data}: {e}") from e
    wav, sr = decode_audio(data, max_seconds=max_seconds)
    if wav.shape[0] < min_seconds * sr:
        raise AudioError(f"audio is shorter than {min_seconds:g} s ({wav.shape[0]} samples at {sr} Hz)")
    return resample(wav, sr, TARGET_RATE)
