"""The vocoder's Triton kernels (engine/model/kernels/) compute what their PyTorch references do.

They run in Triton's interpreter on the CPU here (tests/triton_cpu.py); on the GPU the vocoder uses
them in every residual unit, and `bench/precision.py` reports its waveform error against fp32.
"""
import pytest
import torch

from engine.model.kernels import RESIDUAL_TAIL_CONFIGS, SNAKE_CONFIGS
from engine.model.vocoder import channels_adjacent
from tests.triton_cpu import require_triton


@pytest.fixture(scope="module")
def kernels():
    return require_triton()


SNAKE_CASES = [(layout, config) for layout, adjacent in (("channels_first", False), ("channels_last", True))
               for config in range(len(SNAKE_CONFIGS[adjacent]))]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n_left", [0, 54])
@pytest.mark.parametrize("layout, config", SNAKE_CASES)
def test_snake_beta_matches_the_reference(kernels, with_bias, n_left, layout, config):
    """SnakeBeta (a bias first, a context copied ahead) in every tile config of x's layout."""
    g = torch.Generator().manual_seed(0)
    # T spans several blocks, C two; x a slice along time of a longer tensor (a transposed conv's kept samples)
    x = (torch.randn(2, 40, 306, generator=g) * 2)
    x = (x if layout == "channels_first" else channels_adjacent(x))[..., 3:303]
    log_alpha, log_beta, bias = (torch.randn(40, generator=g) * 0.5 for _ in range(3))
    b = bias if with_bias else None
    # a conv's context, copied ahead: a view into rows of a stream state, as `VocoderStreams.decode` passes it
    left = torch.randn(2, 5 + 40 * n_left, generator=g)[:, 5:].view(2, 40, n_left) if n_left else None
    cfg = SNAKE_CONFIGS[layout == "channels_last"][config]
    out = kernels.snake_beta_triton(x, log_alpha, log_beta, b, left, cfg)
    assert out.shape == (2, 40, n_left + 300)
    assert (out.stride(1) == 1) == (layout == "channels_last")        # the output keeps x's layout
    torch.testing.assert_close(out, kernels.snake_beta_reference(x, log_alpha, log_beta, b, left), atol=1e-5, rtol=1e-5)
    if left is not None:
        assert torch.equal(out[..., :n_left], left)


@pytest.mark.parametrize("channels, samples, layout", [(96, 150, "channels_first"), (40, 64, "channels_first"),
                                                       (8, 7, "channels_first"), (160, 130, "channels_first"),
                                                       (96, 150, "channels_last"), (40, 64, "channels_last")])
@pytest.mark.parametrize("config", range(len(RESIDUAL_TAIL_CONFIGS)))
@pytest.mark.parametrize("with_x_bias", [False, True])
def test_residual_tail_matches_the_reference(kernels, channels, samples, layout, config, with_x_bias):
    """SnakeBeta (with the dilated conv's bias), the 1x1 conv and its bias, the residual add (x with
    a bias of its own or not): one kernel, in tiles of each config's channels by samples (partial ones
    at every edge here), in 32-channel steps; on tensors of either layout (the output in y's)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, channels, samples + 6, generator=g)
    y = torch.randn(2, channels, samples, generator=g)
    if layout == "channels_last":
        x, y = channels_adjacent(x), channels_adjacent(y)
    x = x[..., 3:-3]                                           # a slice along time, read in place
    log_alpha, log_beta, y_bias, bias, x_bias = (torch.randn(channels, generator=g) * 0.5 for _ in range(5))
    x_bias = x_bias if with_x_bias else None
    weight = torch.randn(channels, channels, 1, generator=g) / channels ** 0.5
    cfg = RESIDUAL_TAIL_CONFIGS[config]
    out = kernels.residual_tail_triton(x, y, log_alpha, log_beta, y_bias, weight, bias, cfg, x_bias=x_bias)
    assert (out.stride(1) == 1) == (layout == "channels_last")
    torch.testing.assert_close(out, kernels.residual_tail_reference(x, y, log_alpha, log_beta, y_bias, weight, bias,
                                                                    x_bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t, started, kv_heads", [(8, (0, 3, 200), 4), (2, (1, 0, 71), 4), (40, (0, 90, 5), 2),
                                                  (1, (70, 0, 2), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_attention_matches_the_reference(kernels, t, started, kv_heads, dtype):
    """The 12 Hz transformer's attention (RoPE of q and k, the sliding window, keys before a stream's
    first frame left out) in one kernel: windows of a few frames, one of several query blocks (40 frames,
    key blocks of each), grouped heads; q, k and v views of projections as the layer makes them. In a
    16-bit type RoPE rounds each product as the separate ops do (fp16 here: the interpreter's dot of
    bf16 tiles is wrong, so bf16 is checked on the GPU, `bench.gpu_checks`)."""
    g = torch.Generator().manual_seed(2)
    window, heads, d = 72, 4, 64
    s = window - 1
    start = torch.tensor(started)
    b = len(started)
    q = torch.randn(b, t, heads * d, generator=g).view(b, t, heads, d)
    kv = torch.randn(b, s + t, 2 * kv_heads * d, generator=g)
    k, v = kv[..., :kv_heads * d].view(b, s + t, kv_heads, d), kv[..., kv_heads * d:].view(b, s + t, kv_heads, d)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(s + t).float()[:, None] * inv_freq
    cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
    q, k, v, cos, sin = (x.to(dtype) for x in (q, k, v, cos, sin))
    first_key = (s - start).clamp(min=0)
    out = kernels.window_attention_triton(q, k, v, cos, sin, first_key)
    assert out.shape == (b, t, heads, d) and out.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, kernels.window_attention_reference(q, k, v, cos, sin, first_key),
                               atol=tol, rtol=tol)
