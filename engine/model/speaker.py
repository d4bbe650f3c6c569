"""Speaker encoder: 24 kHz waveform -> log-mel -> ECAPA-TDNN -> x-vector (MODEL.md §4, T18).

The x-vector goes into the talker's codec stream as is, so the mel front end reproduces the
official one exactly: reflect pad 384, STFT (n_fft 1024, hop 256, periodic Hann, center=False),
sqrt(power + 1e-9), librosa's Slaney mel filterbank (fmax 12 kHz), log of clamp(1e-5), in fp32.
Every convolution uses 'same' reflect padding, as in the checkpoint's modules.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import SpeakerConfig

SAMPLE_RATE = 24000
N_FFT = 1024
HOP = 256
N_MELS = 128
F_MAX = 12000.0


_F_SP = 200.0 / 3            # Slaney mel scale: linear below 1 kHz, 3 mels per 200 Hz ...
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = np.log(6.4) / 27.0  # ... logarithmic above


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.atleast_1d(np.asarray(hz, dtype=np.float64))
    mel = hz / _F_SP
    log_part = hz >= _MIN_LOG_HZ
    mel[log_part] = _MIN_LOG_MEL + np.log(hz[log_part] / _MIN_LOG_HZ) / _LOG_STEP
    return mel


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.atleast_1d(np.asarray(mel, dtype=np.float64))
    hz = _F_SP * mel
    log_part = mel >= _MIN_LOG_MEL
    hz[log_part] = _MIN_LOG_HZ * np.exp(_LOG_STEP * (mel[log_part] - _MIN_LOG_MEL))
    return hz


@functools.lru_cache(maxsize=4)
def mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS,
                   fmin: float = 0.0, fmax: float = F_MAX) -> np.ndarray:
    """librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax) (htk=False, norm='slaney'), float32 [n_mels, 1+n_fft/2].

    Same float64 arithmetic and the same float32 rounding points as librosa, so the values agree bit for bit.
    """
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_edges = np.linspace(_hz_to_slaney_mel(fmin)[0], _hz_to_slaney_mel(fmax)[0], n_mels + 2)
    hz_edges = _slaney_mel_to_hz(mel_edges)
    widths = np.diff(hz_edges)
    ramps = hz_edges[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    weights *= 2.0 / (hz_edges[2:] - hz_edges[:-2])[:, None]  # Slaney area normalisation
    weights.flags.writeable = False
    return weights


def speaker_mel(wav_24k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Log-mel features of the official speaker encoder: [n] -> [n // 256, 128] (or [B, n] -> [B, frames, 128]), fp32.

    Computed on the input's device (the official code uses the CPU).
    """
    y = torch.as_tensor(wav_24k, dtype=torch.float32)
    single = y.dim() == 1
    y = y.reshape(-1, y.shape[-1])
    pad = (N_FFT - HOP) // 2
    if y.shape[-1] <= pad:
        raise ValueError(f"waveform too short for the speaker mel: {y.shape[-1]} samples, need more than {pad}")
    y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=N_FFT, window=torch.hann_window(N_FFT, device=y.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(torch.tensor(mel_filterbank(), device=y.device), magnitude)
    mel = torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)
    return mel[0] if single else mel


class TDNNBlock(nn.Module):
    """Conv1d ('same' reflect padding) followed by ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation,
                              padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channel chunks processed hierarchically: chunk 0 as is, chunk i through blocks[i-1](chunk_i + out_{i-1})."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNNBlock(channels // scale, channels // scale, kernel_size, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = torch.chunk(x, self.scale, dim=1)
        outputs = [chunks[0]]
        for i, block in enumerate(self.blocks, start=1):
            outputs.append(block(chunks[i] if i == 1 else chunks[i] + outputs[-1]))
        return torch.cat(outputs, dim=1)


class SqueezeExcitation(nn.Module):
    """Channel gates from the time mean: sigmoid(conv2(relu(conv1(mean))))."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1, padding="same", padding_mode="reflect")
        self.conv2 = nn.Conv1d(se_channels, channels, 1, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """tdnn1 (k1) -> Res2Net -> tdnn2 (k1) -> squeeze-excitation, plus the input."""

    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int, kernel_size: int,
                 dilation: int):
        super().__init__()
        self.tdnn1 = TDNNBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, scale, kernel_size, dilation)
        self.tdnn2 = TDNNBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitation(out_channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor, eps: float = 1e-12):
    """Mean and std over time of x [B, C, T] under weights [B, 1 or C, T] summing to 1 over time."""
    mean = (weights * x).sum(dim=2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2).clamp(eps))
    return mean, std


class AttentiveStatsPooling(nn.Module):
    """Attention over time conditioned on the global mean/std, then the attention-weighted mean and std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        # 1/T in the activation dtype, as the official mask / mask.sum() (T itself rounds in bf16).
        uniform = x.new_ones(1, 1, frames) / x.new_tensor(float(frames))
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: log-mel [B, T, mel_dim] -> x-vector [B, enc_dim]; load with prefix 'speaker_encoder.'."""

    def __init__(self, cfg: SpeakerConfig):
        super().__init__()
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        self.blocks = nn.ModuleList([TDNNBlock(cfg.mel_dim, ch[0], ks[0], dil[0])])
        self.blocks.extend(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i])
                           for i in range(1, len(ch) - 1))
        self.mfa = TDNNBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, cfg.enc_dim, 1, padding="same", padding_mode="reflect")
        # reflect padding needs more frames than the widest one-sided pad
        self.min_frames = max(d * (k - 1) // 2 for k, d in zip(ks, dil)) + 1

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.to(self.fc.weight.dtype).transpose(1, 2)
        if x.shape[-1] < self.min_frames:
            raise ValueError(f"reference too short for the speaker encoder: {x.shape[-1]} mel frames, "
                             f"need at least {self.min_frames} ({self.min_frames * HOP} samples at 24 kHz)")
        features = []
        for block in self.blocks:
            x = block(x)
            features.append(x)
        x = self.mfa(torch.cat(features[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    @torch.inference_mode()
    def embed(self, wav_24k: np.ndarray | torch.Tensor) -> torch.Tensor:
        """x-vector [enc_dim] of one 24 kHz waveform; the mel is computed in fp32 on the CPU, as officially."""
        mel = speaker_mel(torch.as_tensor(wav_24k, dtype=torch.float32).cpu())
        return self(mel.unsqueeze(0).to(self.fc.weight.device))[0]
