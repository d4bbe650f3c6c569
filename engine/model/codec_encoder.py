"""Speech-tokenizer encoder: 24 kHz waveform -> 12.5 Hz codes [T, 16] (HF Mimi's encoder path, MODEL.md §8, T19).

SEANet (causal convs, zero left padding) -> transformer (LayerNorm with bias, RoPE theta 1e4,
LayerScale, exact GELU, fully causal attention: the 250 window applies only under FlashAttention-2,
which the official code never uses for the tokenizer) -> stride-2 downsample (replicate padding)
-> split RVQ: the semantic and the acoustic quantizer both read the same latent through their own
input_proj. Nearest neighbours come from the argmin of `torch.cdist` in fp32 with the official
shapes, because its matmul formulation decides near-ties in the late residual levels.
Everything is causal, so right zero-padding in a batch leaves each row's valid frames unchanged.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import EncoderConfig
from .layers import LayerScale, apply_rope, rope_cos_sin, rope_inv_freq

DOWNSAMPLE = 2  # the 12 Hz codec halves Mimi's 25 Hz latent


class CausalConv1d(nn.Module):
    """Mimi's causal conv: pad (k-1)*d+1-stride on the left, and on the right just enough for a whole last frame."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left_pad = (kernel_size - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right_pad = -x.shape[-1] % self.stride
        return self.conv(F.pad(x, (self.left_pad, right_pad), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """x + Conv_k1(ELU(Conv_k(ELU(x)))) with a hidden width dim // compress; `block` indices mirror the checkpoint."""

    def __init__(self, dim: int, cfg: EncoderConfig, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([nn.ELU(), CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), CausalConv1d(hidden, dim, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SeanetEncoder(nn.Module):
    """Waveform [B, 1, n] -> latent [B, hidden, ceil(n / prod(ratios))]."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        layers = [CausalConv1d(cfg.audio_channels, cfg.num_filters, cfg.kernel_size)]
        width = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            layers += [ResnetBlock(width, cfg, cfg.dilation_growth_rate ** j) for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), CausalConv1d(width, width * 2, 2 * ratio, stride=ratio)]
            width *= 2
        layers += [nn.ELU(), CausalConv1d(width, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    """[B, T, hidden] -> [B, T, hidden], positions 0..T-1, no final norm."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)  # fp32, not a buffer: dtype casts leave it alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.arange(x.shape[1], device=x.device)[None], self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Codebook(nn.Module):
    """EMA codebook buffers; the table is embed_sum / clamp(cluster_usage, 1e-5), in the buffer dtype (T20)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))  # training-time flag, kept to mirror the checkpoint
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantization(nn.Module):
    """One RVQ level; exists for the checkpoint path `layers.K.codebook.*`."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualVectorQuantizer(nn.Module):
    """input_proj, then per layer: nearest table entry of the residual, subtract it."""

    def __init__(self, cfg: EncoderConfig, num_layers: int):
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.codebook_dim, 1, bias=False)
        self.layers = nn.ModuleList(VectorQuantization(cfg.codebook_size, cfg.codebook_dim) for _ in range(num_layers))

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [B, hidden, T] -> codes [B, T, num_layers] int64."""
        residual = self.input_proj(latent).transpose(1, 2)  # [B, T, dim]
        B, T, dim = residual.shape
        codes = []
        for layer in self.layers:
            table = layer.codebook.table()
            # the official [1, B*T, dim] x [1, size, dim] cdist (mm formulation), argmin over fp32 distances
            dist = torch.cdist(residual.reshape(1, B * T, dim).float(), table[None].float(), p=2)[0]
            idx = dist.argmin(dim=-1).view(B, T)
            residual = residual - F.embedding(idx, table)
            codes.append(idx)
        return torch.stack(codes, dim=-1)


class SplitResidualVectorQuantizer(nn.Module):
    """Semantic RVQ (code 0) and acoustic RVQ (codes 1..), both on the same latent.

    Only the acoustic levels that are kept are built: a residual level never changes earlier ones.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVectorQuantizer(cfg, semantic)
        self.acoustic_residual_vector_quantizer = ResidualVectorQuantizer(cfg, cfg.valid_num_quantizers - semantic)

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.semantic_residual_vector_quantizer.encode(latent),
                          self.acoustic_residual_vector_quantizer.encode(latent)], dim=-1)


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """On the CPU, encode with one intra-op thread: PyTorch's ELU rounds differently at the edges of
    each thread's chunk, and the late RVQ levels sit on near-ties, so with several threads the
    reference codes would depend on the host's core count (one thread reproduces the official ones)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class CodecEncoder(nn.Module):
    """Mimi encoder of `speech_tokenizer/model.safetensors`; load with prefix 'encoder.'."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if not cfg.num_semantic_quantizers < cfg.valid_num_quantizers <= cfg.num_quantizers:
            raise ValueError(f"need num_semantic_quantizers < valid_num_quantizers <= num_quantizers, got "
                             f"{cfg.num_semantic_quantizers}, {cfg.valid_num_quantizers}, {cfg.num_quantizers}")
        self.encoder = SeanetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        self.downsample = CausalConv1d(cfg.hidden_size, cfg.hidden_size, 2 * DOWNSAMPLE, stride=DOWNSAMPLE, bias=False,
                                       pad_mode="replicate")
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        self.samples_per_frame = math.prod(cfg.upsampling_ratios) * DOWNSAMPLE
        # Checkpoint tensors (under 'encoder.') that encoding never reads: decode-side projections and
        # the acoustic levels past the kept ones. For the loader's unused-tensor warning.
        q = "quantizer.acoustic_residual_vector_quantizer."
        self.unused_checkpoint_prefixes = (
            "quantizer.semantic_residual_vector_quantizer.output_proj.", q + "output_proj.",
            *(f"{q}layers.{i}." for i in range(cfg.valid_num_quantizers - cfg.num_semantic_quantizers,
                                               cfg.num_quantizers - cfg.num_semantic_quantizers)))

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor, lengths: torch.Tensor | list[int]) -> list[torch.Tensor]:
        """wav [B, n] 24 kHz (rows right-padded), lengths [B] valid samples -> per row codes [ceil(len/1920), 16] int64."""
        weight = self.downsample.conv.weight
        wav = torch.as_tensor(wav).to(device=weight.device, dtype=weight.dtype)  # cast first, as officially (§8.1)
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=wav.device)
        if wav.dim() != 2 or lengths.shape != (wav.shape[0],):
            raise ValueError(f"expected wav [B, n] and lengths [B], got {list(wav.shape)} and {list(lengths.shape)}")
        if bool((lengths < 1).any()) or bool((lengths > wav.shape[1]).any()):
            raise ValueError(f"lengths must be in 1..{wav.shape[1]}, got {lengths.tolist()}")
        valid = torch.arange(wav.shape[1], device=wav.device) < lengths[:, None]
        wav = torch.where(valid, wav, torch.zeros((), dtype=wav.dtype, device=wav.device))
        with _one_cpu_thread(wav.device):
            codes = self.quantizer.encode(self.latent(wav))  # [B, ceil(n / 1920), 16]
        frames = (lengths + self.samples_per_frame - 1) // self.samples_per_frame
        return [row[:f] for row, f in zip(codes, frames.tolist())]

    def latent(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, n] -> the 12.5 Hz latent [B, hidden, ceil(n / 1920)] that the RVQ quantizes."""
        x = self.encoder(wav[:, None, :])
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.downsample(x)
