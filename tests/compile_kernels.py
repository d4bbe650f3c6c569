"""Compile every Triton kernel of engine/model/kernels/ for Hopper (sm_90) without a GPU.

Run as a script without TRITON_INTERPRET (tests/test_kernels_compile.py does): the interpreter that
runs the kernels on the CPU accepts programs the GPU compiler refuses (a loop-carried value whose
type changes, say), so this compiles each one as the device would, with the real model's shapes.
"""
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile without the interpreter"

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from engine.model import kernels as k  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


# compiles run on the engine's own compile threads, as its autotuned configs do on the GPU
# (`kernels.launch.compile_candidates`)
JOBS = []


def build(fn, types: dict, constants: dict, **options) -> None:
    if "PDL" in fn.arg_names:       # the decode-path kernels: compiled as the GPU launches them (launch.pdl_options)
        constants = dict(constants, PDL=True)
    if "PREFETCH" in fn.arg_names:  # ... with their L2 prefetch before the wait unless told (kernels.launch.PREFETCH)
        constants = dict(dict(PREFETCH=True), **constants)
    signature = {name: ("constexpr" if name in constants else types[name]) for name in fn.arg_names}

    def job():
        compile(ASTSource(fn, signature, constants), target=TARGET, options=options or None)
        print("compiled", fn.__name__, constants, options, flush=True)
    JOBS.append(k.launch._compile_pool().submit(job))


def main() -> None:
    for dtype in ("bf16", "fp32"):
        p = "*" + dtype
        # every config `decode_attention` may time and pick, for the talker (bf16); the first in fp32,
        # and the code predictor's short caches
        for c in k.ATTENTION_CONFIGS[:None if dtype == "bf16" else 1]:
            split = c["SPLIT"] > 1          # keys cut over programs (`_split_attention_kernel`)
            for t, block_k, page in ((1, c["BLOCK_K"], 64), (2, 16, 16)):
                build(k.attention._split_attention_kernel if split else k.attention._decode_attention_kernel,
                      dict(qkv_ptr=p, out_ptr=p, part_ptr="*fp32", counter_ptr="*i32", anchor_ptr=p, table_ptr="*i64",
                           start_ptr="*i64", q_w_ptr=p, k_w_ptr=p, inv_freq_ptr="*fp32", stride_qkv_b="i32",
                           stride_qkv_t="i32", stride_out_b="i32", stride_out_t="i32", stride_table="i32",
                           k_offset="i32", v_offset="i32", capacity="i32", eps="fp32", scale="fp32"),
                      dict(T=t, G=2, HQ=16, HKV=8, D=128, M=16, PAGE=page, BLOCK_K=block_k, IEEE=dtype == "fp32",
                           PREFETCH=c["PREFETCH"], **(dict(SPLIT=c["SPLIT"]) if split else {})),
                      num_warps=c["num_warps"], num_stages=c["num_stages"])
        # every short-cache config `decode_attention` may time and pick for the code predictor (1 and 2
        # positions), bf16; the first in fp32
        for c in k.attention.SHORT_ATTENTION_CONFIGS[:None if dtype == "bf16" else 1]:
            for t in (1, 2):
                build(k.attention._short_attention_kernel,
                      dict(qkv_ptr=p, out_ptr=p, anchor_ptr=p, table_ptr="*i64", start_ptr="*i64", q_w_ptr=p,
                           k_w_ptr=p, inv_freq_ptr="*fp32", stride_qkv_b="i32", stride_qkv_t="i32",
                           stride_out_b="i32", stride_out_t="i32", stride_table="i32", k_offset="i32",
                           v_offset="i32", capacity="i32", eps="fp32", scale="fp32"),
                      dict(T=t, G=2, HQ=16, HKV=8, D=128, KVH=c["KVH"], M=max(16, 2 * t * c["KVH"]),
                           NEW=max(16, t * c["KVH"]), OLD=16 * c["KVH"], PAGE=16, IEEE=dtype == "fp32",
                           PRELOAD_KV=c["PRELOAD_KV"]),
                      num_warps=c["num_warps"], num_stages=1)
        # the paged cache's reads and writes (prefill), talker shapes
        build(k.attention._kv_write_kernel,
              dict(k_ptr=p, v_ptr=p, anchor_ptr=p, table_ptr="*i64", start_ptr="*i64",
                   rows_ptr="*i64", stride_kb="i32", stride_kt="i32", stride_vb="i32",
                   stride_vt="i32", stride_table="i32", k_offset="i32", v_offset="i32",
                   capacity="i32"), dict(PAGE=64, HD=1024, BLOCK=1024))
        build(k.attention._kv_read_kernel,
              dict(k_ptr=p, v_ptr=p, anchor_ptr=p, table_ptr="*i64", rows_ptr="*i64",
                   stride_b="i32", stride_table="i32", k_offset="i32", v_offset="i32"),
              dict(PAGE=64, HD=1024, BLOCK=1024))
        build(k.gemm._rms_norm_kernel, dict(x_ptr=p, y_ptr=p, w_ptr=p, N="i32", eps="fp32"), dict(BLOCK=1024))
        for plus in (False, True):     # a reference's frames (prompt), a decode step's (with its text)
            build(k.step._embedding_sum_kernel,
                  dict(ids_ptr="*i64", anchor_ptr=p, offsets_ptr="*i64", plus_ptr=p,
                       y_ptr=p, N="i32"), dict(G=16, HAS_PLUS=plus, BLOCK=1024))
        build(k.gemm._silu_mul_kernel, dict(x_ptr=p, y_ptr=p, N="i32"), dict(BLOCK=1024))
        # every config `linear` may time and pick for one row of each decode-layer GEMM of the 0.6B model
        # (its inputs, epilogue), in bf16 (the configs that stream their weights once: they are the same
        # whatever K); the first config of each in fp32 (the CPU tests' dtype)
        streamed = set()
        for kk, norm, gated, residual in ((1024, True, False, False), (1024, True, True, False),
                                          (2048, False, False, True), (3072, False, False, True)):
            configs = k.linear_configs(1, kk, gated, 2 if dtype == "bf16" else 4)
            for c in configs[:None if dtype == "bf16" else 1]:
                dot, preload = c["kernel"] == "dot", c.get("PRELOAD", False)
                epilogue = (norm, gated, residual)
                if not preload and (epilogue, str(c)) in streamed:
                    continue
                streamed.add((epilogue, str(c)))
                build(k.gemm._skinny_linear_kernel,
                      dict(x_ptr=p, w_ptr=p, y_ptr=p, r_ptr=p, norm_w_ptr=p, M="i32", N="i32", K="i32", eps="fp32"),
                      dict(BLOCK_M=16 if dot else k.GEMV_ROWS, BLOCK_N=c["BLOCK_N"],
                           BLOCK_K=1 << (kk - 1).bit_length() if preload else c["BLOCK_K"], DOT=dot,
                           IEEE=dtype == "fp32", NORM=norm, GATED=gated, RESIDUAL=residual, PRELOAD=preload),
                      num_warps=c["num_warps"], num_stages=c["num_stages"])
        # the vocoder's kernels over tensors of either layout: the stride of 1 (samples adjacent, or
        # channels: the CUDA layout) specialized, as Triton specializes it at launch
        i32 = "i32"
        for adjacent in ("t", "c"):
            unit = {f"stride_{x}{adjacent}": 1 for x in "xy"}                 # x's and y's (SnakeBeta)
            unit_out = dict(unit, **{f"stride_o{adjacent}": 1})               # and out's (residual tail)
            for bias in (False, True):
                for left in (False, True):     # every config `snake_beta` may time and pick (bf16); the first in fp32
                    for c in k.SNAKE_CONFIGS[adjacent == "c"][:None if dtype == "bf16" else 1]:
                        build(k.vocoder._snake_beta_kernel,
                              dict(x_ptr=p, y_ptr=p, a_ptr=p, b_ptr=p, bias_ptr=p, left_ptr=p,
                                   C=i32, T=i32, L=i32, stride_xb=i32, stride_xc=i32,
                                   stride_xt=i32, stride_yb=i32, stride_yc=i32, stride_yt=i32,
                                   stride_left=i32),
                              dict(HAS_BIAS=bias, HAS_LEFT=left, BLOCK_C=c["BLOCK_C"], BLOCK_T=c["BLOCK_T"], **unit),
                              num_warps=c["num_warps"])
            # every config `residual_tail` may time and pick (bf16); the first in fp32
            # (with x's own bias: a decoder block's first unit)
            for c in k.RESIDUAL_TAIL_CONFIGS[:None if dtype == "bf16" else 1]:
                for x_bias in (False, True):
                    build(k.vocoder._residual_tail_kernel,
                          dict(x_ptr=p, y_ptr=p, out_ptr=p, a_ptr=p, b_ptr=p, y_bias_ptr=p, w_ptr=p, bias_ptr=p,
                               x_bias_ptr=p, C=i32, T=i32, stride_xb=i32, stride_xc=i32, stride_xt=i32, stride_yb=i32,
                               stride_yc=i32, stride_yt=i32, stride_ob=i32, stride_oc=i32, stride_ot=i32),
                          dict(BLOCK_CO=c["BLOCK_CO"], BLOCK_CI=32, BLOCK_T=c["BLOCK_T"], IEEE=dtype == "fp32",
                               HAS_X_BIAS=x_bias, **unit_out),
                          num_warps=c["num_warps"], num_stages=3)
        # the 12 Hz transformer's windowed attention (16 heads of 64, its one config)
        build(k.vocoder._window_attention_kernel,
              dict(q_ptr=p, k_ptr=p, v_ptr=p, out_ptr=p, cos_ptr=p, sin_ptr=p, first_ptr="*i64", t=i32, S=i32,
                   scale="fp32", stride_qb=i32, stride_qt=i32, stride_kb=i32, stride_kt=i32, stride_vb=i32,
                   stride_vt=i32, stride_ob=i32, stride_ot=i32),
              dict(G=1, D=64, BLOCK_Q=16, BLOCK_K=64, IEEE=dtype == "fp32"), num_warps=4)
        build(k.attention._qk_norm_rope_kernel,
              dict(x_ptr=p, y_ptr=p, w_ptr=p, cos_ptr=p, sin_ptr=p, H="i32",
                   stride_bt="i32", eps="fp32"), dict(D=128, HALF=64))
    # fp32 logits (the talker's, with its logits processor folded in or not) and bf16 (the code predictor's
    # head, its picks' embeddings written or not: its last step)
    for block, logits, process, embed in ((2048, "*fp32", False, False), (4096, "*fp32", False, False),
                                          (4096, "*fp32", True, False), (2048, "*bf16", False, False),
                                          (2048, "*bf16", False, True)):
        for config in k.SAMPLE_CONFIGS:
            build(k.sampling._sample_rows_kernel,
                  dict(logits_ptr=logits, out_ptr="*i64", greedy_ptr="*i1",
                       temperature_ptr="*fp32", top_k_ptr="*i64", seed_ptr="*i64",
                       frame_ptr="*i64", seen_ptr="*i1", penalty_ptr="*fp32",
                       min_new_ptr="*i64", table_ptr=logits, embed_ptr=logits, codebook="i32",
                       V="i32", stride_logits="i32", stride_seen="i32", eos="i32",
                       suppress_from="i32", D="i32", stride_embed="i32"),
                  dict(BLOCK=block, RADIX_BITS=config["RADIX_BITS"], PROCESS=process, EMBED=embed,
                       BLOCK_D=1024 if embed else 1, BITS=16 if logits == "*bf16" else 32), num_warps=config["num_warps"])
    for p in ("*bf16", "*fp32"):     # the end of a decode step: the talker's hidden state in the model's dtype
        build(k.step._advance_rows_kernel,
              dict(act_ptr="*i1", new_c0_ptr="*i64", hidden_ptr=p, frames_ptr="*i64",
                   alive_ptr="*i1", h_ptr=p, c0_ptr="*i64", seen_ptr="*i1", generated_ptr="*i64",
                   length_ptr="*i64", limit_ptr="*i64", packed_ptr="*i64", D="i32",
                   stride_hidden="i32", stride_h="i32", stride_seen="i32", eos_id="i32",
                   capacity="i32"),
              dict(CODES=16, BLOCK_CODES=16, BLOCK_D=1024, RUNNING=0, EOS=1, LIMIT=2))
    for job in JOBS:
        job.result()          # a compile error fails the run


if __name__ == "__main__":
    sys.exit(main())
