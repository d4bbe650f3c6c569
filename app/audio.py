"""Turning the engine's 24 kHz float32 chunks into what a client asked for.

Two consumers: a WebSocket session wants raw encoded bytes (s16le, f32le, G.711 mu-law / A-law) at
some rate, optionally cut into fixed frames (telephony: 20 ms of 8 kHz mu-law = 160 bytes); REST
wants a container file (wav, flac, mp3, Ogg/Opus), whole or streamed. Both resample with soxr's
streaming resampler, so a turn's output has exactly n * rate / 24000 samples however it was chunked.
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import soundfile as sf
import soxr

MODEL_RATE = 24000
SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
BYTES_PER_SAMPLE = {"pcm_s16le": 2, "f32le": 4, "mulaw": 1, "alaw": 1}
SILENCE_BYTE = {"pcm_s16le": b"\x00", "f32le": b"\x00", "mulaw": b"\xff", "alaw": b"\xd5"}
FRAME_MS_RANGE = (5, 1000)


class FormatError(ValueError):
    """A format the client asked for that cannot be produced; the message says why."""


def _g711_tables() -> tuple[np.ndarray, np.ndarray]:
    """s16 -> mu-law and s16 -> A-law byte for all 65536 inputs (ITU-T G.711, as audioop/sox do it)."""
    pcm = np.arange(-32768, 32768, dtype=np.int32)
    # mu-law on the 14-bit magnitude, bias 0x84 >> 2, clip 8159
    v = pcm >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(v), 8159) + (0x84 >> 2)
    seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), mag)
    ulaw = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (seg + 1)) & 0xF)) ^ mask
    # A-law on the 13-bit value
    v = pcm >> 3
    mask = np.where(v >= 0, 0xD5, 0x55)
    mag = np.where(v >= 0, v, -v - 1)
    seg = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), mag)
    quant = (mag >> np.maximum(seg, 1)) & 0xF
    alaw = np.where(seg >= 8, 0x7F, (seg << 4) | quant) ^ mask
    return ulaw.astype(np.uint8), alaw.astype(np.uint8)


ULAW_OF_S16, ALAW_OF_S16 = _g711_tables()


def to_s16(pcm: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


def encode_samples(pcm: np.ndarray, encoding: str) -> bytes:
    """float32 samples in [-1, 1] -> bytes of `encoding`."""
    if encoding == "f32le":
        return np.clip(pcm, -1.0, 1.0).astype("<f4").tobytes()
    s16 = to_s16(pcm)
    if encoding == "pcm_s16le":
        return s16.tobytes()
    table = ULAW_OF_S16 if encoding == "mulaw" else ALAW_OF_S16
    return table[s16.astype(np.int32) + 32768].tobytes()


def check_rate(sample_rate) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate not in SAMPLE_RATES:
        raise FormatError(f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))}, got {sample_rate!r}")
    return sample_rate


class Resampler:
    """soxr's ResampleStream from 24 kHz (a pass-through at 24 kHz); `flush` returns the tail."""

    def __init__(self, rate: int):
        self.stream = None if rate == MODEL_RATE else soxr.ResampleStream(MODEL_RATE, rate, 1, dtype="float32", quality="HQ")

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, dtype=np.float32)
        return pcm if self.stream is None else self.stream.resample_chunk(pcm, last=False)

    def flush(self) -> np.ndarray:
        if self.stream is None:
            return np.zeros(0, np.float32)
        return self.stream.resample_chunk(np.zeros(0, np.float32), last=True)


@dataclass(frozen=True)
class AudioFormat:
    """A raw stream format of the WebSocket session."""
    encoding: str = "pcm_s16le"
    sample_rate: int = MODEL_RATE
    frame_ms: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.encoding, str) or self.encoding not in BYTES_PER_SAMPLE:
            raise FormatError(f"encoding must be one of {', '.join(BYTES_PER_SAMPLE)}, got {self.encoding!r}")
        check_rate(self.sample_rate)
        if self.frame_ms is not None:
            lo, hi = FRAME_MS_RANGE
            if isinstance(self.frame_ms, bool) or not isinstance(self.frame_ms, int) or not lo <= self.frame_ms <= hi:
                raise FormatError(f"frame_ms must be an integer from {lo} to {hi}, got {self.frame_ms!r}")
            if (self.frame_ms * self.sample_rate) % 1000:
                raise FormatError(f"frame_ms {self.frame_ms} is not a whole number of samples at {self.sample_rate} Hz")

    @property
    def frame_samples(self) -> Optional[int]:
        return None if self.frame_ms is None else self.frame_ms * self.sample_rate // 1000

    def to_dict(self) -> dict:
        return {"encoding": self.encoding, "sample_rate": self.sample_rate, "frame_ms": self.frame_ms}


class StreamEncoder:
    """One turn's audio as messages of encoded bytes, each tagged with its first sample's offset.

    Without frame_ms a message is whatever one engine chunk resampled to; with it every message is
    exactly one frame, and `flush` pads the last partial frame with silence.
    """

    def __init__(self, fmt: AudioFormat):
        self.fmt = fmt
        self.resample = Resampler(fmt.sample_rate)
        self.width = BYTES_PER_SAMPLE[fmt.encoding]
        self.pending = bytearray()      # encoded bytes of an incomplete frame (frame_ms only)
        self.samples = 0                # output samples handed out so far (including padding)

    def _messages(self, data: bytes) -> list[tuple[int, bytes]]:
        out = []
        step = self.fmt.frame_samples
        if step is None:
            if data:
                out.append((self.samples, data))
                self.samples += len(data) // self.width
            return out
        self.pending += data
        size = step * self.width
        while len(self.pending) >= size:
            out.append((self.samples, bytes(self.pending[:size])))
            del self.pending[:size]
            self.samples += step
        return out

    def encode(self, pcm: np.ndarray) -> list[tuple[int, bytes]]:
        return self._messages(encode_samples(self.resample(pcm), self.fmt.encoding))

    def flush(self) -> list[tuple[int, bytes]]:
        out = self._messages(encode_samples(self.resample.flush(), self.fmt.encoding))
        if self.pending:
            size = self.fmt.frame_samples * self.width
            frame = bytes(self.pending) + SILENCE_BYTE[self.fmt.encoding] * (size - len(self.pending))
            self.pending.clear()
            out.append((self.samples, frame))
            self.samples += self.fmt.frame_samples
        return out


# ---- REST containers ----------------------------------------------------------------------------

# response_format -> (content type, soundfile format and subtype, or None for raw samples)
CONTAINERS = {
    "wav": ("audio/wav", ("WAV", "PCM_16")),
    "flac": ("audio/flac", ("FLAC", "PCM_16")),
    "mp3": ("audio/mpeg", ("MP3", "MPEG_LAYER_III")),
    "opus": ("audio/ogg", ("OGG", "OPUS")),
    "pcm": ("audio/pcm", None),          # OpenAI's name for s16le
    "pcm_s16le": ("audio/pcm", None),
    "f32le": ("audio/pcm", None),
    "mulaw": ("audio/basic", None),
    "alaw": ("audio/x-alaw-basic", None),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def check_container(response_format, sample_rate) -> None:
    if not isinstance(response_format, str) or response_format not in CONTAINERS:
        raise FormatError(f"response_format must be one of {', '.join(CONTAINERS)}, got {response_format!r}")
    check_rate(sample_rate)
    if response_format == "opus" and sample_rate not in OPUS_RATES:
        raise FormatError(f"opus supports sample_rate {', '.join(map(str, OPUS_RATES))}, got {sample_rate}")


def _raw_encoding(response_format: str) -> str:
    return "pcm_s16le" if response_format == "pcm" else response_format


def _sf_options(response_format: str) -> dict:
    # Constant bit rate: a streamed MP3 has no LAME header (it is written at the end), and decoders
    # (libsndfile/mpg123 among them) then estimate the length from the bit rate, exact only for CBR.
    return {"bitrate_mode": "CONSTANT", "compression_level": 0.5} if response_format == "mp3" else {}


def encode_file(pcm: np.ndarray, response_format: str, sample_rate: int) -> bytes:
    """A whole turn (24 kHz float32) as one file of `response_format` at `sample_rate`."""
    resample = Resampler(sample_rate)
    out = np.concatenate([resample(pcm), resample.flush()])
    container = CONTAINERS[response_format][1]
    if container is None:
        return encode_samples(out, _raw_encoding(response_format))
    buf = io.BytesIO()
    sf.write(buf, out, sample_rate, format=container[0], subtype=container[1], **_sf_options(response_format))
    return buf.getvalue()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown length (0xFFFFFFFF sizes), as streaming servers send."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + b"\xff\xff\xff\xff" + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + b"\xff\xff\xff\xff"


class _ForwardSink:
    """A write-only file for libsndfile that hands bytes out as soon as they are written.

    Encoders seek back at close to patch headers (FLAC STREAMINFO, the MP3 LAME frame); bytes already
    handed out cannot change, so those patches are dropped: the stream stays valid with "unknown
    length" headers, like any live stream.
    """

    def __init__(self):
        self.tail = bytearray()   # written, not yet handed out; starts at offset `emitted`
        self.emitted = 0
        self.pos = 0

    def write(self, data) -> int:
        data = bytes(data)
        n = len(data)
        if self.pos < self.emitted:
            skip = min(n, self.emitted - self.pos)
            data, self.pos = data[skip:], self.pos + skip
        off = self.pos - self.emitted
        self.tail[off:off + len(data)] = data
        self.pos += len(data)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        end = self.emitted + len(self.tail)
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else end + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        return b""

    def take(self) -> bytes:
        data = bytes(self.tail)
        self.emitted += len(data)
        self.tail.clear()
        return data


class FileStreamEncoder:
    """A `response_format` file produced piece by piece while the turn is generated (stream: true)."""

    def __init__(self, response_format: str, sample_rate: int):
        self.resample = Resampler(sample_rate)
        self.container = CONTAINERS[response_format][1]
        self.samples = 0
        self.header = b""
        self.file = self.sink = None
        if response_format == "wav":
            self.header, self.raw = streaming_wav_header(sample_rate), "pcm_s16le"
        elif self.container is None:
            self.raw = _raw_encoding(response_format)
        else:
            self.raw = None
            self.sink = _ForwardSink()
            self.file = sf.SoundFile(self.sink, "w", samplerate=sample_rate, channels=1, format=self.container[0],
                                     subtype=self.container[1], **_sf_options(response_format))

    def _encode(self, pcm: np.ndarray) -> bytes:
        self.samples += len(pcm)
        if self.raw is not None:
            data = encode_samples(pcm, self.raw)
        else:
            if len(pcm):
                self.file.write(pcm)
            data = self.sink.take()
        head, self.header = self.header, b""
        return head + data

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._encode(self.resample(pcm))

    def flush(self) -> bytes:
        data = self._encode(self.resample.flush())
        if self.file is not None:
            self.file.close()
            data += self.sink.take()
        return data

    def close(self) -> None:
        """Drop the encoder without finishing the file (client gone)."""
        if self.file is not None and not self.file.closed:
            self.file.close()
