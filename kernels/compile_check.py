"""Compile every Triton kernel for a GPU target without a GPU (ptxas ships in the wheel).

    TRITON_INTERPRET= python -m loraplex.kernels.compile_check [--arch 90]

Prints one line per kernel variant with its register and shared-memory use and exits non-zero
if any fails. The variants are the launch configurations the wrappers pick for fp16/bf16
(decode and prefill tiles, split-K, GQA/MQA, window, softcap, split-KV decode, attention
sinks, the dequant GEMV form, slice-skipping expand, the MoE grouped matmul, the fused
per-layer ops), so a kernel that only the
interpreter accepts (e.g. a dot with K < 16) fails here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Must hold before the kernel modules decorate their functions.
if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
    sys.exit("compile_check needs TRITON_INTERPRET unset (it builds real GPU code)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loraplex.kernels import (  # noqa: E402
    dequant_matmul,
    fused,
    kv_cache,
    moe_triton,
    paged_attention,
    sgmv,
)


def _variants(dtypes: tuple[str, ...]):
    """(label, kernel, {arg: type} for runtime args, {arg: value} for constexprs)."""
    for dt in dtypes:
        meta = dict(tile_start_ptr="*i32", tile_end_ptr="*i32", tile_slot_ptr="*i32",
                    widths_ptr="*i32")  # fmt: skip
        # Decode tiles with the defaults (split 16-32, block_k 128 / 64, rank block 64 / 16)
        # and prefill tiles.
        for block_m, block_r, block_k, split in ((16, 16, 64, 4), (16, 64, 128, 16),
                                                 (16, 16, 64, 32), (64, 16, 64, 1)):  # fmt: skip
            yield (
                f"sgmv_shrink {dt} M{block_m} R{block_r} K{block_k} split{split}",
                sgmv._shrink_kernel,
                dict(x_ptr=f"*{dt}", a_ptr=f"*{dt}", t_ptr="*fp32", **meta, K="i32",
                     stride_xm="i32", stride_as="i32", stride_ar="i32", stride_tm="i32"),
                dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split),
            )  # fmt: skip
        for block_m, block_r, block_n, slices in ((16, 64, 64, 1), (16, 64, 128, 1),
                                                  (16, 16, 128, 1), (16, 16, 128, 3),
                                                  (16, 16, 256, 3), (64, 64, 64, 1),
                                                  (64, 16, 256, 3)):  # fmt: skip
            yield (
                f"sgmv_expand {dt} M{block_m} R{block_r} N{block_n} slices{slices}",
                sgmv._expand_kernel,
                dict(t_ptr="*fp32", b_ptr=f"*{dt}", y_ptr=f"*{dt}", **meta,
                     slice_ends_ptr="*i32", N="i32", stride_tm="i32", stride_bs="i32",
                     stride_br="i32", stride_ym="i32"),
                dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, NUM_SLICES=slices),
            )  # fmt: skip
        for quant in (False, True):  # the model's dtype, int8 with float16 scales
            cache = "i8" if quant else dt
            yield (
                f"write_kv_cache {dt}{' int8' if quant else ''}",
                kv_cache._write_kv_kernel,
                dict(k_ptr=f"*{dt}", v_ptr=f"*{dt}", k_cache_ptr=f"*{cache}",
                     v_cache_ptr=f"*{cache}", slot_ptr="*i64", k_scale_ptr="*fp16",
                     v_scale_ptr="*fp16", stride_kt="i32", stride_kh="i32", stride_vt="i32",
                     stride_vh="i32", stride_cs="i32", stride_ch="i32", stride_ss="i32"),
                dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, QUANT=quant),
            )  # fmt: skip
        # (label, group, head_dim, BLOCK_Q, window, softcap): Llama-8B GQA decode/prefill,
        # Gemma 3 MQA with head_dim 256 and a sliding window.
        for label, group, hd, bq, win, cap, split, int8 in (
            ("llama decode", 4, 128, 4, False, False, 1, False),
            ("llama decode split-kv", 4, 128, 4, False, False, 8, False),
            ("llama prefill", 4, 128, 16, False, False, 1, False),
            ("gemma decode window", 4, 256, 4, True, False, 1, False),
            ("gemma decode window split-kv", 4, 256, 4, True, False, 4, False),
            ("gemma prefill window softcap", 4, 256, 16, True, True, 1, False),
            ("llama decode int8 kv", 4, 128, 4, False, False, 1, True),
            ("gemma prefill window int8 kv", 4, 256, 16, True, False, 1, True),
        ):
            cache = "i8" if int8 else dt
            yield (
                f"paged_attention {dt} {label}",
                paged_attention._paged_attention_kernel,
                dict(out_ptr=f"*{dt}", q_ptr=f"*{dt}", k_cache_ptr=f"*{cache}",
                     v_cache_ptr=f"*{cache}", block_tables_ptr="*i64", tile_seq_ptr="*i32",
                     tile_row_ptr="*i32", q_end_ptr="*i32", seq_len_ptr="*i32",
                     scale="fp32", softcap="fp32", window="i32", stride_ot="i32",
                     stride_oh="i32", stride_qt="i32", stride_qh="i32", stride_cs="i32",
                     stride_ch="i32", stride_bt="i32", part_ptr="*fp32", ml_ptr="*fp32",
                     stride_ps="i32", stride_ms="i32", num_heads="i32",
                     k_scale_ptr="*fp16", v_scale_ptr="*fp16", stride_ss="i32"),
                dict(PAGE=16, GROUP=group, HEAD_DIM=hd, GP=group, BLOCK_Q=bq,
                     BLOCK_N=32 if hd >= 256 else 64, BLOCK_D=hd, USE_SOFTCAP=cap,
                     USE_WINDOW=win, SPLIT_KV=split, KV_INT8=int8),
            )  # fmt: skip
        # gpt-oss: 64 query heads over 8 KV heads, head_dim 64, a 128-token window on every
        # other layer, a sink logit per head.
        for label, bq, win, split in (("decode window split-kv", 8, True, 8),
                                      ("prefill window", 16, True, 1)):  # fmt: skip
            yield (
                f"paged_attention_sinks {dt} gpt-oss {label}",
                paged_attention._paged_attention_sinks_kernel,
                dict(out_ptr=f"*{dt}", q_ptr=f"*{dt}", k_cache_ptr=f"*{dt}",
                     v_cache_ptr=f"*{dt}", block_tables_ptr="*i64", tile_seq_ptr="*i32",
                     tile_row_ptr="*i32", q_end_ptr="*i32", seq_len_ptr="*i32",
                     scale="fp32", softcap="fp32", window="i32", stride_ot="i32",
                     stride_oh="i32", stride_qt="i32", stride_qh="i32", stride_cs="i32",
                     stride_ch="i32", stride_bt="i32", part_ptr="*fp32", ml_ptr="*fp32",
                     stride_ps="i32", stride_ms="i32", num_heads="i32",
                     k_scale_ptr="*fp16", v_scale_ptr="*fp16", stride_ss="i32",
                     sinks_ptr="*fp32"),
                dict(PAGE=16, GROUP=8, HEAD_DIM=64, GP=8, BLOCK_Q=bq, BLOCK_N=64, BLOCK_D=64,
                     USE_SOFTCAP=False, USE_WINDOW=win, SPLIT_KV=split, KV_INT8=False),
            )  # fmt: skip
        # Mixture-of-experts expert matmuls: decode (few rows per expert) and prefill blocks.
        for block_m in (16, 64):
            yield (
                f"grouped_mm {dt} M{block_m} N128 K64",
                moe_triton._grouped_mm_kernel,
                dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}", offs_ptr="*i32",
                     block_group_ptr="*i32", block_row_ptr="*i32", N="i32", K="i32",
                     stride_xm="i32", stride_xk="i32", stride_wg="i32", stride_wk="i32",
                     stride_wn="i32", stride_ym="i32"),
                dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, UPCAST=False),
            )  # fmt: skip
        yield from _fused_variants(dt)
        for hd, split in ((128, 8), (256, 4)):
            yield (
                f"paged_attention_combine {dt} head_dim{hd} split{split}",
                paged_attention._combine_splits_kernel,
                dict(out_ptr=f"*{dt}", part_ptr="*fp32", ml_ptr="*fp32", rows_ptr="*i32",
                     stride_ot="i32", stride_oh="i32", stride_ms="i32", num_heads="i32"),
                dict(SPLIT_KV=split, BLOCK_S=split, HEAD_DIM=hd, BLOCK_D=hd),
            )  # fmt: skip
        for int4 in (False, True):
            for block_m, block_n, split in ((16, 64, 8), (64, 128, 1)):
                name = "int4" if int4 else "int8"
                yield (
                    f"{name}_matmul {dt} M{block_m} split{split}",
                    dequant_matmul._dequant_matmul_kernel,
                    dict(x_ptr=f"*{dt}", q_ptr="*u8" if int4 else "*i8", s_ptr=f"*{dt}",
                         z_ptr=f"*{dt}", y_ptr="*fp32" if split > 1 else f"*{dt}", M="i32",
                         N="i32", K="i32", stride_xm="i32", stride_qn="i32",
                         stride_sn="i32", stride_ym="i32"),
                    dict(INT4=int4, GROUP=128 if int4 else 1, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split),
                )  # fmt: skip
            # GEMV form at batch 1 (the defaults: block_k 512, block_n 32 / 16, split or
            # not) and 4: K tile inside a group and spanning several groups.
            for block_m, block_n, block_k, split in ((1, 32, 256, 4), (4, 16, 128, 1),
                                                     (1, 32, 512, 1), (1, 16, 512, 4),
                                                     (4, 32, 128, 1)):  # fmt: skip
                name = "int4_gemv" if int4 else "int8_gemv"
                yield (
                    f"{name} {dt} M{block_m} N{block_n} K{block_k} split{split}",
                    dequant_matmul._dequant_gemv_kernel,
                    dict(x_ptr=f"*{dt}", q_ptr="*u8" if int4 else "*i8", s_ptr=f"*{dt}",
                         z_ptr=f"*{dt}", y_ptr="*fp32" if split > 1 else f"*{dt}", M="i32",
                         N="i32", K="i32", stride_xm="i32", stride_qn="i32",
                         stride_sn="i32", stride_ym="i32"),
                    dict(INT4=int4, GROUP=128 if int4 else 1,
                         SUB_K=min(block_k, 128) if int4 else block_k, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split),
                )  # fmt: skip


def _fused_variants(dt: str):
    """The fused per-layer kernels (kernels/fused.py) at the families' shapes."""
    # Llama 8B (4096), gpt-oss (2880) at its first layer (no residual), Gemma 3 27B (5376).
    for hidden, gemma, residual in ((4096, False, True), (2880, False, False),
                                    (5376, True, True)):  # fmt: skip
        yield (
            f"add_rms_norm {dt} hidden{hidden}{' gemma' if gemma else ''}"
            f"{'' if residual else ' first'}",
            fused._add_rms_norm_kernel,
            dict(x_ptr=f"*{dt}", r_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}",
                 stride_x="i32", stride_r="i32", stride_o="i32", eps="fp32"),
            dict(HIDDEN=hidden, BLOCK=1 << (hidden - 1).bit_length(), HAS_RESIDUAL=residual,
                 GEMMA=gemma),
        )  # fmt: skip
    # (label, q heads, kv heads, head_dim, rotary_dim, table or rows): Llama 8B, gpt-oss,
    # Phi-4-mini's partial rotary (0.75 of 128), Gemma 3's head_dim 256.
    for label, hq, hk, hd, rd, gather in (("llama", 32, 8, 128, 128, True),
                                          ("gpt-oss rows", 64, 8, 64, 64, False),
                                          ("phi4 partial", 24, 8, 128, 96, True),
                                          ("gemma", 32, 16, 256, 256, False)):  # fmt: skip
        half = rd // 2
        yield (
            f"rope_and_write_kv {dt} {label}",
            fused._rope_kv_kernel,
            dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}",
                 cs_ptr="*fp32" if gather else f"*{dt}", pos_ptr="*i64",
                 k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}", slot_ptr="*i64",
                 stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32",
                 stride_vt="i32", stride_vh="i32", stride_cs="i32", sin_off="i32",
                 stride_cslot="i32", stride_chead="i32"),
            dict(Q_HEADS=hq, KV_HEADS=hk, HEAD_DIM=hd, HALF=half,
                 BLOCK_QH=1 << (hq - 1).bit_length(), BLOCK_KH=1 << (hk - 1).bit_length(),
                 BLOCK_HALF=1 << (half - 1).bit_length(), BLOCK_D=hd, GATHER=gather),
        )  # fmt: skip
    for label, clamped in (("silu", False), ("gpt-oss clamped", True)):
        yield (
            f"silu_mul {dt} {label}",
            fused._silu_mul_kernel,
            dict(x_ptr=f"*{dt}", out_ptr=f"*{dt}", stride_x="i32", stride_o="i32",
                 limit="fp32", alpha="fp32"),
            dict(INTER=14336, BLOCK=1024, CLAMPED=clamped),
        )  # fmt: skip


def compile_all(arch: int = 90, dtypes: tuple[str, ...] = ("bf16", "fp16")) -> list[str]:
    """Compile every variant; returns the labels that failed (and prints a line each)."""
    target = GPUTarget("cuda", arch, 32)
    failed = []
    for label, fn, types, constexprs in _variants(dtypes):
        signature = {
            name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names
        }
        start = time.perf_counter()
        try:
            k = triton.compile(ASTSource(fn, signature, constexprs), target=target)
            assert k.asm.get("cubin"), "no cubin produced"
            print(
                f"ok    {label:50s} warps={k.metadata.num_warps} "
                f"smem={k.metadata.shared} {time.perf_counter() - start:.1f}s",
                flush=True,
            )
        except Exception as exc:  # report every kernel, not just the first failure
            failed.append(label)
            print(f"FAIL  {label}: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability")
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16")
    args = parser.parse_args()
    failed = compile_all(args.arch, tuple(args.dtypes.split(",")))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
