"""Fused GPU kernels where a profile shows the time, each with the plain PyTorch ops as its reference.

- `vocoder`: SnakeBeta, a residual unit's tail (SnakeBeta, 1x1 conv, residual add), and the 12 Hz
  transformer's sliding-window attention (RoPE in), in one kernel each.
- `attention`: QK-norm + RoPE for the prefill; a decode layer's whole attention core (QK-norm, RoPE,
  K/V cache write, causal attention over the row's cache) in one kernel.
- `gemm`: the decode path's skinny GEMMs with the RMSNorm before them and the SwiGLU gate or the
  residual add after them folded in (with the attention kernel, 5 kernels a layer where plain ops
  took ~25); `rms_norm` and `silu_mul` past 16 rows, where the GEMMs are cuBLAS's.
- `sampling`: a codebook's sampling (logits processor, temperature, top-k, the seeded Gumbel-max
  draw, greedy rows) in one kernel.
- `step`: the frame's embedding into a decode step and the rows' state update out of it, one
  kernel each.
- `launch`: what they share: Triton (None on CPU-only installs), programmatic dependent launch along
  the decode step's chain of kernels, and the timing that picks each kernel's launch config on the GPU.

Elsewhere (CPU, no Triton) the PyTorch expressions run; `bench/precision.py` compares the two on GPU.
The tests run the Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""
from .attention import (ATTENTION_CONFIGS, attention_configs, attention_timing_key, decode_attention,
                        decode_attention_supports, kv_read, kv_write, qk_norm_rope, qk_norm_rope_reference)
from .gemm import (GEMV_ROWS, SKINNY_ROWS, linear, linear_configs, linear_timing_key, rms_norm, silu_mul,
                   silu_mul_reference, skinny_linear)
from .launch import triton
from .sampling import SAMPLE_CONFIGS, TalkerProcessing, sample_rows
from .step import RowState, advance_rows, embedding_sum
from .vocoder import (RESIDUAL_TAIL_CONFIGS, SNAKE_CONFIGS, new_samples, residual_tail, residual_tail_configs,
                      residual_tail_reference, residual_tail_triton, snake_beta, snake_beta_reference,
                      snake_beta_triton, window_attention, window_attention_reference,
                      window_attention_triton)

__all__ = ["ATTENTION_CONFIGS", "GEMV_ROWS", "RESIDUAL_TAIL_CONFIGS", "SAMPLE_CONFIGS", "SKINNY_ROWS", "SNAKE_CONFIGS",
           "RowState", "TalkerProcessing", "advance_rows", "attention_configs", "attention_timing_key",
           "decode_attention", "decode_attention_supports", "embedding_sum", "kv_read", "kv_write", "linear",
           "linear_configs", "linear_timing_key", "new_samples", "qk_norm_rope", "qk_norm_rope_reference",
           "residual_tail", "residual_tail_configs", "residual_tail_reference", "residual_tail_triton", "rms_norm",
           "sample_rows", "silu_mul", "silu_mul_reference", "skinny_linear", "snake_beta", "snake_beta_reference",
           "snake_beta_triton", "triton", "window_attention", "window_attention_reference",
           "window_attention_triton"]
