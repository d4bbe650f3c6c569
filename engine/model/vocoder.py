"""Speech-tokenizer decoder (`decoder.*`): 16 codes per 80 ms frame -> 1920 samples at 24 kHz.

MODEL.md section 7. Every operation is causal, so output sample n depends only on frames <= n // 1920
and the decoder can stream exactly. To make that a property of the code rather than a second
implementation, every op that looks back in time takes its left context explicitly: the modules
below read `context[op]` (the tail of what the op saw before: a conv's last input samples, the
attention's last window-1 inputs) and replace it with the tail after this window. A whole
utterance is the same forward with a zero context, which is exactly the official zero padding; a
stream keeps the context between windows in `VocoderStreams`.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DecoderConfig
from .layers import LayerScale, RMSNorm, SwiGLU, rope_cos_sin, rope_inv_freq
from .kernels import new_samples, residual_tail, snake_beta, window_attention

# Checkpoint tensors the decode path never reads (the RVQ input projections serve encoding only);
# pass to `engine.weights.warn_unused(..., ignore_prefixes=...)` with the "decoder." prefix.
UNUSED_KEYS = ("quantizer.rvq_first.input_proj.", "quantizer.rvq_rest.input_proj.")


def _prepend_context(op: nn.Module, x: torch.Tensor, context: dict, activation=None) -> torch.Tensor:
    """[op's left context, activation(x)] along time (activation(x) alone for an op without one);
    stores a copy of the last op.context_len samples as the next context. A copy, not a view: a view
    would keep the whole input alive until the window ends, every conv's at once (10 GiB for an
    8-frame window of 256 streams on an H200).

    activation: a SnakeBeta to apply to x, which writes the context ahead of its output in the same
    pass (no second copy of the activation, at the decoder's highest rates its largest tensors)."""
    if not op.context_len:
        return x if activation is None else activation(x)
    if activation is None:
        x = _cat_samples(context[op], x) if _channels_last(x) else torch.cat([context[op], x], dim=-1)
    else:
        x = activation(x, left=context[op])
    context[op] = x[..., x.shape[-1] - op.context_len:].clone()
    return x


def _cat_samples(left: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[left, x] along time, in x's layout (torch.cat of 3-D tensors returns channels first)."""
    out = new_samples(x, left.shape[-1] + x.shape[-1])
    out[..., :left.shape[-1]] = left
    out[..., left.shape[-1]:] = x
    return out


# On CUDA the convs run over channels-last activations (`CausalConv1d`): each conv alone 24-52% faster
# (`bench.conv_layout`), 256 streams 7% faster through the scheduler with every window size captured
# under cuDNN's timing (an H100; bench/README.md, 2026-12-06 fourth session). QWEN3_TTS_CHANNELS_LAST=0
# goes back to channels-first convs.
CHANNELS_LAST = os.environ.get("QWEN3_TTS_CHANNELS_LAST", "1") != "0"


def _channels_last(x: torch.Tensor) -> bool:
    return CHANNELS_LAST and x.is_cuda


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] (or a weight [O, I, k]) as [B, C, 1, T] in channels-last layout: a view when x's
    channels are adjacent in memory already, else a copy."""
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)


def channels_adjacent(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] (or a weight [O, I, k]) with its channels adjacent in memory, strides (T*C, 1, C)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


MIN_CUDNN_OUT_CHANNELS = 16   # below this, cuDNN runs a conv with its slow generic kernel


class CausalConv1d(nn.Module):
    """Stride-1 conv whose left pad, (k-1)*dilation samples, is the previous input (zeros at the start).

    With `CHANNELS_LAST` (the default) the conv runs on CUDA as a 2-D one over channels-last activations
    ([B, C, 1, T], channels adjacent in memory): cuDNN's kernels take that layout, and around a conv of
    channels-first tensors it converts the input and the output (an H100, 8-frame windows of 32
    streams: each conv 24-52% faster without, `bench.conv_layout`). Depthwise convs (the ConvNeXt
    blocks', at the low rates) stay channels-first: not measured the other way. A conv with fewer than
    16 output channels (the vocoder's last, to 1 channel) runs with its weight zero-padded to 16 and
    the extra channels dropped: cuDNN has only its generic kernel for so few (implicit_convolve_sgemm,
    22% of an 8-frame window for 256 streams on an H200).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context_len = (kernel_size - 1) * dilation
        self.context_shape = (in_channels, self.context_len)

    def forward(self, x: torch.Tensor, context: dict, bias: bool = True, activation=None) -> torch.Tensor:
        """bias=False leaves the bias out (the caller adds it in a kernel it runs anyway); `activation`
        (a SnakeBeta) is applied to x first, in the pass that prepends the context."""
        x = _prepend_context(self, x, context, activation)
        conv = self.conv
        weight, b = conv.weight, conv.bias if bias else None
        pad = MIN_CUDNN_OUT_CHANNELS - conv.out_channels
        if x.is_cuda and pad > 0 and conv.groups == 1:
            weight = F.pad(weight, (0, 0, 0, 0, 0, pad))
            b = None if b is None else F.pad(b, (0, pad))
        if _channels_last(x) and conv.groups == 1:
            y = F.conv2d(_as_2d(x), _as_2d(weight), b, dilation=(1, conv.dilation[0])).squeeze(2)
        else:
            y = F.conv1d(x.contiguous(), weight, b, dilation=conv.dilation, groups=conv.groups)
        return y[:, :conv.out_channels]


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d(k, stride s) keeping output samples [t*s, (t+1)*s) per input t (drops the last k-s, T22).

    Those samples also depend on the ceil(k/s)-1 previous inputs, which are its context.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.context_len = math.ceil(kernel_size / stride) - 1
        self.context_shape = (in_channels, self.context_len)

    def forward(self, x: torch.Tensor, context: dict, activation=None, bias: bool = True) -> torch.Tensor:
        """The kept samples, a view of the conv's output (the kernels after it read rows with a
        stride: no copy of the decoder's largest tensors); `activation` and `bias` as in
        `CausalConv1d.forward`."""
        n = x.shape[-1] * self.stride
        x = _prepend_context(self, x, context, activation)
        first = self.context_len * self.stride            # output of the context inputs, already emitted
        b = self.conv.bias if bias else None
        if _channels_last(x):      # as `CausalConv1d`
            y = F.conv_transpose2d(_as_2d(x), _as_2d(self.conv.weight), b, stride=(1, self.stride))
            return y.squeeze(2)[..., first:first + n]
        return F.conv_transpose1d(x, self.conv.weight, b, stride=self.stride)[..., first:first + n]


class SnakeBeta(nn.Module):
    """x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel (log-scale alpha, beta)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, left: torch.Tensor | None = None) -> torch.Tensor:
        """bias: a per-channel bias to add to x first (the preceding conv's, left out of it); left:
        samples [B, C, L] to put ahead of the output (the next conv's left context)."""
        return snake_beta(x, self.alpha, self.beta, bias, left)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm(1e-6) -> Linear 4x -> exact GELU -> Linear -> gamma, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, context: dict) -> torch.Tensor:
        h = self.norm(self.dwconv(x, context).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, context: dict, x_bias: torch.Tensor | None = None) -> torch.Tensor:
        """x + conv2(act2(conv1(act1(x)))): act1 in the pass that prepends conv1's context, the rest
        (conv1's bias, act2, the 1x1 conv2 and its bias, the residual add) one kernel on CUDA.
        x_bias: a per-channel bias x still lacks (the upsampling conv's, before a block's first unit),
        added in those two passes over x: cuDNN leaves a conv's bias to a pass of its own (9 of them an
        8-frame window of 32 streams took 0.34 ms on an H100, most of it these convs')."""
        act1 = self.act1 if x_bias is None else functools.partial(self.act1, bias=x_bias)
        y = self.conv1(x, context, bias=False, activation=act1)
        return residual_tail(x, y, self.act2.alpha, self.act2.beta, self.conv1.conv.bias,
                             self.conv2.conv.weight, self.conv2.conv.bias, x_bias=x_bias)


class DecoderBlock(nn.Module):
    """SnakeBeta, upsampling ConvTranspose(2r, r), residual units with dilations 1, 3, 9.

    The caller runs `upsample`, then each of `units` itself: a call's caller holds its argument, so
    a block's own forward would keep its input (and each unit's) alive until the block ends, at the
    decoder's highest rate 120-180 MiB more at the peak of an 8-frame window of 64 streams.
    """

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate),
                                    *(ResidualUnit(out_dim, d) for d in (1, 3, 9))])

    def upsample(self, x: torch.Tensor, context: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The upsampling conv's output without its bias, and that bias (the first unit adds it)."""
        conv = self.block[1]
        return conv(x, context, activation=self.block[0], bias=False), conv.conv.bias

    @property
    def units(self) -> nn.ModuleList:
        return self.block[2:]


class Codebook(nn.Module):
    """One VQ codebook stored as running sums: vector = embedding_sum / clamp(cluster_usage, 1e-5) (T20)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # Gathering the rows first divides the same numbers as dividing the whole table (module dtype).
        usage = F.embedding(codes, self.cluster_usage[:, None]).clamp(min=1e-5)
        return F.embedding(codes, self.embedding_sum) / usage


class ResidualQuantizer(nn.Module):
    """Codebook vectors of several codebooks summed in order, then `output_proj` (1x1 conv, no bias)."""

    def __init__(self, num_codebooks: int, size: int, dim: int, out_dim: int):
        super().__init__()
        self.vq = nn.ModuleDict({"layers": nn.ModuleList(
            nn.ModuleDict({"_codebook": Codebook(size, dim)}) for _ in range(num_codebooks))})
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, n] -> [B, out_dim, T]."""
        layers = self.vq["layers"]
        q = layers[0]["_codebook"](codes[..., 0])
        for g in range(1, len(layers)):
            q = q + layers[g]["_codebook"](codes[..., g])
        return self.output_proj(q.transpose(1, 2))


class SplitQuantizer(nn.Module):
    """Semantic codebook 0 (`rvq_first`) and acoustic 1..15 (`rvq_rest`) with their own projections."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        dim, n_first = cfg.codebook_dim // 2, cfg.num_semantic_quantizers
        self.n_first = n_first
        self.rvq_first = ResidualQuantizer(n_first, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualQuantizer(cfg.num_quantizers - n_first, cfg.codebook_size, dim, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[..., :self.n_first]) + self.rvq_rest(codes[..., self.n_first:])


class WindowAttention(nn.Module):
    """Causal sliding-window attention (query at p sees keys p-window < j <= p, T21), no QK-norm.

    Its context is its last window-1 inputs, [B, window-1, hidden]: their keys and values are computed
    again each window. That holds a quarter of what keeping the keys and values would (512 numbers a
    frame and layer against 2 x 16 heads x 64 on the 12 Hz decoder: 0.6 MB a stream against 2.3 MB)
    for 71 more rows in two small GEMMs.
    RoPE positions are local to [context, new frames] (key k at k, query i at window-1+i): attention
    depends only on relative positions, and the angles stay small however long a stream runs.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.context_len = cfg.sliding_window - 1
        self.context_shape = (self.context_len, cfg.hidden_size)

    def forward(self, x, cos, sin, first_key, context: dict) -> torch.Tensor:
        """x [B, t, hidden]; cos/sin [window-1+t, head_dim] for positions 0..window-2+t; first_key [B]:
        the first of [context, x]'s keys that is a real frame."""
        b, t, _ = x.shape
        seen = torch.cat([context[self], x], dim=1)                  # [B, S + t, hidden]
        context[self] = seen[:, t:]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(seen).view(b, -1, self.kv_heads, self.head_dim)
        v = self.v_proj(seen).view(b, -1, self.kv_heads, self.head_dim)
        return self.o_proj(window_attention(q, k, v, cos, sin, first_key).reshape(b, t, -1))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = WindowAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, h, cos, sin, first_key, context: dict) -> torch.Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), cos, sin, first_key, context))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class Transformer(nn.Module):
    """`pre_transformer`: input_proj, sliding-window layers with RoPE (theta 1e4), norm, output_proj."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.window = cfg.sliding_window
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def _apply(self, fn, recurse=True):
        """Move inv_freq with the module but keep it fp32: cos/sin are computed in fp32 (section 11)."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.norm.weight.device)
        return self

    def forward(self, x: torch.Tensor, start: torch.Tensor, context: dict) -> torch.Tensor:
        """x [B, t, latent], frames start[b].. of each row; context holds the previous window-1 frames."""
        t, past = x.shape[1], self.window - 1
        cos, sin = rope_cos_sin(torch.arange(past + t, device=x.device), self.inv_freq, x.dtype)
        # Key k of [context, x] is frame start - past + k (a real frame from k = past - start on) and
        # query i is frame start + i.
        first_key = (past - start).clamp(min=0)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, first_key, context)
        return self.output_proj(self.norm(h))


class Vocoder(nn.Module):
    """The speech-tokenizer decoder, parameter names as under `decoder.` of speech_tokenizer/model.safetensors."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.quantizer = SplitQuantizer(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)])
            for r in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7),
            *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv1d(dims[-1], 1, 7),
        ])
        self.samples_per_frame = math.prod(cfg.upsampling_ratios) * math.prod(cfg.upsample_rates)
        self.num_codebooks = cfg.num_quantizers

    def channels_last_weights(self) -> "Vocoder":
        """Every conv's weight with its input channels adjacent in memory (same values), so the
        channels-last convs on CUDA read it in place instead of copying it each call."""
        for m in self.modules():
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and m.groups == 1:
                m.weight.data = channels_adjacent(m.weight.data)
        return self

    def context_ops(self) -> list[nn.Module]:
        """The ops that look back in time, each with its `context_shape` (per stream), in module order."""
        return [m for m in self.modules() if getattr(m, "context_len", 0) > 0]

    def initial_context(self, batch: int, device=None, dtype=None) -> dict:
        """Zero left context of every op that has one: the state of a stream before its first frame."""
        p = self.pre_conv.conv.weight
        return {m: torch.zeros(batch, *m.context_shape, device=device or p.device, dtype=dtype or p.dtype)
                for m in self.context_ops()}

    def forward(self, codes: torch.Tensor, start: torch.Tensor, context: dict) -> torch.Tensor:
        """codes [B, t, 16] in 0..2047, the frames start[b].. of each row -> wav [B, t*1920] (module dtype).

        `context` (from `initial_context` or a previous call) is updated in place to follow these frames.
        """
        h = self.pre_conv(self.quantizer(codes), context)
        h = self.pre_transformer(h.transpose(1, 2), start, context).transpose(1, 2)
        for upsample, convnext in self.upsample:
            h = convnext(upsample(h, context), context)
        h = self.decoder[0](h, context)
        for block in self.decoder[1:-2]:
            h, bias = block.upsample(h, context)
            for unit in block.units:     # each unit's input is let go once it returns (`DecoderBlock`)
                h, bias = unit(h, context, x_bias=bias), None
        wav = self.decoder[-1](h, context, activation=self.decoder[-2])
        return wav.squeeze(1).clamp(min=-1, max=1)

    @torch.no_grad()
    def decode_unchunked(self, codes: torch.Tensor) -> torch.Tensor:
        """All T frames in one pass (positions 0..T-1, zero padding): what streaming reproduces. fp32 [B, T*1920]."""
        start = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        return self(codes, start, self.initial_context(codes.shape[0])).float()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, lengths: torch.Tensor | None = None,
               chunk: int = 300, left_context: int = 25) -> tuple[torch.Tensor, torch.Tensor]:
        """The official final decode (section 7.7-7.8): codes [B, T, 16], rows padded with -1.

        Returns fp32 wav [B, T*1920] (zero past each row's end) and the valid samples per row,
        lengths*1920 (lengths default: the frames whose first code is not -1).
        """
        if lengths is None:
            lengths = (codes[..., 0] >= 0).sum(1)
        codes = codes.clamp(min=0)
        spf, total = self.samples_per_frame, codes.shape[1]
        pieces = [torch.zeros(codes.shape[0], 0, device=codes.device)]
        for start in range(0, total, chunk):
            end = min(start + chunk, total)
            ctx = left_context if start - left_context > 0 else start
            pieces.append(self.decode_unchunked(codes[:, start - ctx:end])[:, ctx * spf:])
        wav = torch.cat(pieces, dim=1)
        samples = lengths.to(codes.device) * spf
        wav = wav.masked_fill(torch.arange(wav.shape[1], device=wav.device) >= samples[:, None], 0.0)
        return wav, samples


class VocoderStreams:
    """Streaming decode state of up to `max_streams` streams, preallocated and slot-indexed.

    Row s of `state` holds stream s's left context of every op that has one, side by side (a
    window's gather and write-back, and a slot's reset, are one kernel each, not one per op: 29 on
    the 12 Hz decoder); `frames` counts its frames (which of the attention's context frames are
    real). `decode` advances several streams by the same W frames in one batched call; the audio of a
    stream, concatenated over its windows of any sizes, equals `Vocoder.decode_unchunked` of all its
    frames. The call has static shapes per (batch, W) and no host sync, so it can be captured in a
    CUDA graph; rows padding a batch to a captured size use `pad_slot`, a spare slot nobody owns.
    A slot must not appear twice in one call.
    """

    def __init__(self, vocoder: Vocoder, max_streams: int):
        self.vocoder = vocoder
        self.max_streams = max_streams
        self.pad_slot = max_streams
        self.ops = vocoder.context_ops()
        self.offsets = [0]
        for op in self.ops:
            self.offsets.append(self.offsets[-1] + math.prod(op.context_shape))
        p = vocoder.pre_conv.conv.weight
        self.state = torch.zeros(max_streams + 1, self.offsets[-1], dtype=p.dtype, device=p.device)
        self.frames = torch.zeros(max_streams + 1, dtype=torch.long, device=p.device)

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the streams in `slots`: they restart as if no frame had been decoded."""
        self.state.index_fill_(0, slots, 0)
        self.frames.index_fill_(0, slots, 0)

    @torch.no_grad()
    def decode(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Next W frames of each stream: slots [B] long, codes [B, W, 16] -> fp32 wav [B, W*1920]."""
        rows = self.state.index_select(0, slots)
        context = {op: rows[:, a:b].view(-1, *op.context_shape)        # views of the gathered rows
                   for op, a, b in zip(self.ops, self.offsets, self.offsets[1:])}
        start = self.frames.index_select(0, slots)
        wav = self.vocoder(codes, start, context)
        self.state.index_copy_(0, slots, torch.cat([context[op].reshape(len(slots), -1) for op in self.ops], dim=1))
        self.frames.index_copy_(0, slots, start + codes.shape[1])
        return wav.float()

    def snapshot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of stream `slot`'s state: every op's context, and its frame count."""
        return self.state[slot].clone(), self.frames[slot].clone()

    def restore(self, slots: torch.Tensor, snapshot: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Streams `slots` continue from a `snapshot`'s state."""
        self.state[slots], self.frames[slots] = snapshot

    def prime(self, slots: torch.Tensor, context_codes: torch.Tensor) -> None:
        """Start streams from context frames (an ICL session's reference codes [B, T_ref, 16]):
        reset, decode them to fill the state, discard their audio. Rows share T_ref; prime ragged
        references in separate calls."""
        self.reset(slots)
        self.decode(slots, context_codes)
