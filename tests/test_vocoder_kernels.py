"""The vocoder's Triton kernels (engine/model/kernels.py) compute what their PyTorch references do.

They run in Triton's interpreter on the CPU here (tests/triton_cpu.py); on the GPU the vocoder uses
them in every residual unit, and `bench/precision.py` reports its waveform error against fp32.
"""
import pytest
import torch

from tests.triton_cpu import require_triton


@pytest.fixture(scope="module")
def kernels():
    return require_triton()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n_left", [0, 54])
def test_snake_beta_matches_the_reference(kernels, with_bias, n_left):
    g = torch.Generator().manual_seed(0)
    # T spans two blocks; x a slice along time of a longer tensor (a transposed conv's kept samples)
    x = (torch.randn(2, 3, 1506, generator=g) * 2)[..., 3:1503]
    log_alpha, log_beta, bias = (torch.randn(3, generator=g) * 0.5 for _ in range(3))
    b = bias if with_bias else None
    # a conv's context, copied ahead: a view into rows of a stream state, as `VocoderStreams.decode` passes it
    left = torch.randn(2, 5 + 3 * n_left, generator=g)[:, 5:].view(2, 3, n_left) if n_left else None
    out = kernels.snake_beta_triton(x, log_alpha, log_beta, b, left)
    assert out.shape == (2, 3, n_left + 1500)
    torch.testing.assert_close(out, kernels.snake_beta_reference(x, log_alpha, log_beta, b, left), atol=1e-5, rtol=1e-5)
    if left is not None:
        assert torch.equal(out[..., :n_left], left)


@pytest.mark.parametrize("channels, samples", [(96, 150), (40, 64), (8, 7), (160, 130)])
@pytest.mark.parametrize("config", range(4))
def test_residual_tail_matches_the_reference(kernels, channels, samples, config):
    """SnakeBeta (with the dilated conv's bias), the 1x1 conv and its bias, the residual add: one
    kernel, in tiles of each config's channels by samples (partial ones at every edge here), in
    32-channel steps."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, channels, samples + 6, generator=g)[..., 3:-3]   # a slice along time, read in place
    y = torch.randn(2, channels, samples, generator=g)
    log_alpha, log_beta, y_bias, bias = (torch.randn(channels, generator=g) * 0.5 for _ in range(4))
    weight = torch.randn(channels, channels, 1, generator=g) / channels ** 0.5
    cfg = kernels.RESIDUAL_TAIL_CONFIGS[config]
    torch.testing.assert_close(kernels.residual_tail_triton(x, y, log_alpha, log_beta, y_bias, weight, bias, cfg),
                               kernels.residual_tail_reference(x, y, log_alpha, log_beta, y_bias, weight, bias),
                               atol=1e-5, rtol=1e-5)
