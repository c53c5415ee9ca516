"""Kernel microbenchmarks on the GPU (CUDA events): SGMV, paged attention, dequant GEMV.

    python -m benchmarks.kernels    # prints a table, writes benchmarks/results/kernels.json + .png

Shapes are Llama-3-8B's (hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336), bf16.
- SGMV: 32 distinct rank-16 adapters at decode batch 64 on all four LoRA modules of a layer,
  x 32 layers = what LoRA adds to one decode step; against a Python loop of per-adapter
  matmuls, the torch reference, and the base model's own linear layers at the same batch.
  Tiles and launch parameters are the engine's (the wrappers' defaults, recorded per row
  under "launch"); "triton" is the engine's call (lora_apply), "triton_graph" its kernels.
- Paged attention: decode at batch 32 (context 2048) -> GB/s and % of HBM peak.
- Dequant: int4 / int8 GEMV (batch 1, the wrappers' defaults) against the bf16 GEMV of the
  same layer.
"""

from __future__ import annotations

import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 32, 8, 128
# (in, out slices) of the four LoRA modules of a Llama layer.
MODULES = {"qkv": (HIDDEN, [4096, 1024, 1024]), "o": (4096, [HIDDEN]),
           "gate_up": (HIDDEN, [FFN, FFN]), "down": (FFN, [HIDDEN])}  # fmt: skip


def cuda_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _sgmv_module(fin: int, outs: list[int], segments, n_ad: int, rank: int) -> tuple[dict, dict]:
    from loraplex.kernels import reference, sgmv

    bf, batch, k, n = torch.bfloat16, segments[-1][1], len(outs), sum(outs)
    a = torch.randn(n_ad, k * rank, fin, device="cuda", dtype=bf) * 0.01
    b = torch.randn(n_ad, k * rank, n, device="cuda", dtype=bf) * 0.01
    widths = [k * rank] * n_ad
    x = torch.randn(batch, fin, device="cuda", dtype=bf)
    y = torch.zeros(batch, n, device="cuda", dtype=bf)
    w = torch.randn(n, fin, device="cuda", dtype=bf)
    # Tiles and launch parameters as the engine's path (dispatch -> sgmv.lora_apply) picks
    # them: build_meta's own block_m, the wrappers' defaults, no slice-skipping.
    meta = sgmv.build_meta(segments, widths, "cuda")
    launch = {
        "block_m": meta.block_m,
        "shrink": sgmv.shrink_params(len(meta.tile_slot), meta.block_m, k * rank, fin),
        "expand": sgmv.expand_params(len(meta.tile_slot), meta.block_m, k * rank, n),
    }

    def loop():
        for s, e, slot in segments:
            y[s:e] += (x[s:e] @ a[slot].T) @ b[slot]

    graph = torch.cuda.CUDAGraph()
    sgmv.lora_apply_meta(y, x, a, b, meta)  # compile outside the capture
    with torch.cuda.graph(graph):
        sgmv.lora_apply_meta(y, x, a, b, meta)
    return launch, {
        "triton": cuda_ms(lambda: sgmv.lora_apply(y, x, a, b, segments, widths)),
        "triton_graph": cuda_ms(graph.replay),
        "loop": cuda_ms(loop),
        "reference": cuda_ms(lambda: reference.lora_apply(y, x, a, b, segments, widths)),
        "base": cuda_ms(lambda: torch.nn.functional.linear(x, w)),
    }


def bench_sgmv(rows: list[dict]) -> None:
    n_ad, rank = 32, 16
    segments = [(2 * i, 2 * i + 2, i) for i in range(n_ad)]  # batch 64: 2 rows per adapter
    total = dict.fromkeys(("triton", "triton_graph", "loop", "reference", "base"), 0.0)
    for name, (fin, outs) in MODULES.items():
        launch, t = _sgmv_module(fin, outs, segments, n_ad, rank)
        for key in total:
            total[key] += t[key] * LAYERS
        rows.append({"bench": "sgmv", "module": name, **{f"{k}_ms": v for k, v in t.items()},
                     "launch": launch})  # fmt: skip
    rows.append({"bench": "sgmv", "module": "per decode step (x32 layers)",
                 **{f"{k}_ms": v for k, v in total.items()},
                 "lora_over_base_linear": total["triton_graph"] / total["base"]})  # fmt: skip


def bench_attention(rows: list[dict], peak: float | None) -> None:
    from loraplex.kernels import paged_attention

    bf, batch, ctx, page = torch.bfloat16, 32, 2048, 16
    blocks = batch * ctx // page
    k_cache = torch.randn(blocks, page, KV_HEADS, HEAD_DIM, device="cuda", dtype=bf)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device="cuda").view(batch, ctx // page)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=bf)
    out = torch.empty_like(q)
    qsl, lens = list(range(batch + 1)), [ctx] * batch
    ms = cuda_ms(lambda: paged_attention.paged_attention(
        out, q, k_cache, v_cache, tables, qsl, lens, HEAD_DIM**-0.5))  # fmt: skip
    gbps = 2 * k_cache.numel() * 2 / (ms * 1e-3) / 1e9
    rows.append({"bench": "paged_attention decode", "batch": batch, "context": ctx, "ms": ms,
                 "GB_per_s": gbps,
                 "hbm_fraction": gbps * 1e9 / peak if peak else None})  # fmt: skip


def _gemv(n: int, k: int, peak: float | None) -> dict:
    from loraplex.kernels import dequant_matmul

    bf = torch.bfloat16
    launch = {  # the wrappers' defaults at M = 1 (no overrides below)
        "int8": dequant_matmul.launch_params(1, n, k, False, 1),
        "int4": dequant_matmul.launch_params(1, n, k, True, 128),
    }
    x = torch.randn(1, k, device="cuda", dtype=bf)
    w = torch.randn(n, k, device="cuda", dtype=bf)
    q8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    s8 = torch.rand(n, device="cuda", dtype=bf)
    q4 = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
    s4 = torch.rand(n, k // 128, device="cuda", dtype=bf)
    z4 = torch.rand(n, k // 128, device="cuda", dtype=bf)
    t_bf = cuda_ms(lambda: torch.nn.functional.linear(x, w))
    t_8 = cuda_ms(lambda: dequant_matmul.int8_matmul(x, q8, s8))
    t_4 = cuda_ms(lambda: dequant_matmul.int4_matmul(x, q4, s4, z4, 128))
    int4_bytes = n * k // 2 + 2 * s4.numel() * 2
    return {
        "bench": "gemv batch 1", "shape": f"{n}x{k}",
        "bf16_ms": t_bf, "int8_ms": t_8, "int4_ms": t_4,
        "int4_speedup": t_bf / t_4, "int8_speedup": t_bf / t_8,
        "int4_hbm_fraction": int4_bytes / (t_4 * 1e-3) / peak if peak else None,
        "launch": launch,
    }  # fmt: skip


def bench_dequant(rows: list[dict], peak: float | None) -> None:
    for n, k in ((4096, 4096), (2 * FFN, HIDDEN), (HIDDEN, FFN)):
        rows.append(_gemv(n, k, peak))


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    step = next(r for r in rows if r.get("module", "").startswith("per decode"))
    keys = ["base", "triton_graph", "triton", "reference", "loop"]
    ax1.bar(keys, [step[f"{k}_ms"] for k in keys])
    ax1.set_ylabel("ms per decode step (32 layers)")
    ax1.set_title("LoRA at batch 64, 32 adapters r16 vs base linears")
    gemv = [r for r in rows if r["bench"] == "gemv batch 1"]
    xs = range(len(gemv))
    for off, key in ((-0.25, "bf16_ms"), (0.0, "int8_ms"), (0.25, "int4_ms")):
        ax2.bar([i + off for i in xs], [r[key] for r in gemv], width=0.25, label=key[:-3])
    ax2.set_xticks(list(xs), [r["shape"] for r in gemv])
    ax2.set_ylabel("ms")
    ax2.set_title("GEMV batch 1")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/kernels.py measures GPU kernels and needs CUDA; none is available here"
        )
    name = torch.cuda.get_device_name()
    peak = next((bw for k, bw in HBM.items() if k in name), None)
    rows: list[dict] = []
    print(f"# kernels on {name}")
    failed = []
    # One failing bench must not hide the others' figures: a GPU lease is short.
    for bench in (bench_sgmv, lambda r: bench_attention(r, peak), lambda r: bench_dequant(r, peak)):
        done = len(rows)
        try:
            bench(rows)
        except Exception:
            traceback.print_exc()
            failed.append(bench)
        for r in rows[done:]:
            print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in r.items()))  # fmt: skip
    out = BENCH_DIR / "results" / "kernels.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    if not failed:
        chart(rows, out.with_suffix(".png"))
    print(f"wrote {out}" + ("" if failed else f" and {out.with_suffix('.png')}"))
    if failed:
        sys.exit(f"{len(failed)} of the benchmarks failed")


if __name__ == "__main__":
    main()
