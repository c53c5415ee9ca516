"""Launch-configuration sweep of the Triton kernels on the GPU (Llama-3-8B shapes, bf16).

    python -m benchmarks.kernel_sweep [--budget-s 170] [--ops dequant,sgmv,attention]
    python -m benchmarks.kernel_sweep --dry-run   # CPU: every config once, tiny shapes, interpreter

Per op and shape it times a bounded list of launch configurations (triton.testing.do_bench,
L2 flushed between runs, median) after checking each one's output against the torch
reference; configs that fail to compile or give wrong results are reported, not timed.
Ops, in order of how far they are from their goals:

- dequant: int4 / int8 weight-only linear at M = 1 (the dot form and the GEMV form) and
  M = 16, shapes 4096x4096, 28672x4096 (gate_up), 4096x14336 (down); bf16 cuBLAS baseline.
- sgmv: shrink and expand separately per LoRA module (qkv, o, gate_up, down), 32 distinct
  rank-16 adapters at decode batch 64 (2 rows each) and one adapter at batch 1; the base
  layer's bf16 linear at the same batch as the baseline. "slices" = expand told that B is
  block-diagonal over the fused slices (q|k|v, gate|up) so it skips the zero rank rows.
- attention: paged decode, batch 32, context 2048, 32/8 heads, head_dim 128, page 16.

GB/s counts the bytes an op must read at least (quantized weights + scales; the used adapters'
A, the non-zero blocks of their B; K and V), so configs that read less look faster per byte.
It prints a table per op sorted by time, the best config per op as a Python dict literal and
an estimate of LoRA's share of a decode step, and writes benchmarks/results/kernel-sweep.json.
It starts no new config after --budget-s seconds (from the start), so partial results come
out when the GPU time is short.
"""

from __future__ import annotations

import argparse
import json
import os
import pprint
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.kernels import FFN, HBM, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, MODULES

RESULTS = Path(__file__).resolve().parent / "results" / "kernel-sweep.json"
PEAK_DEFAULT = HBM["H200"]


@dataclass(frozen=True)
class Shapes:
    modules: dict[str, tuple[int, list[int]]]
    dequant: tuple[tuple[int, int], ...]  # (N, K)
    adapters: int
    rank: int
    batch: int
    attention: tuple[int, int, int, int, int, int]  # batch, context, heads, kv heads, dim, page


FULL = Shapes(MODULES, ((4096, 4096), (2 * FFN, HIDDEN), (HIDDEN, FFN)), 32, 16, 64,
              (32, 2048, HEADS, KV_HEADS, HEAD_DIM, 16))  # fmt: skip
# Dry run under the interpreter: same structure (fused slices, split K, GQA), tiny sizes.
TINY = Shapes({"qkv": (256, [256, 64, 64]), "o": (256, [256]), "gate_up": (256, [512, 512]),
               "down": (512, [256])}, ((256, 256), (1024, 256), (256, 512)), 4, 16, 8,
              (2, 160, HEADS, KV_HEADS, HEAD_DIM, 16))  # fmt: skip

# ---- configurations (keyword arguments of the kernel wrappers; {} = the built-in choice) ----
SHRINK_B64 = [
    {},
    {"block_k": 64, "split_k": 16},
    {"block_k": 128, "split_k": 16},
    {"block_k": 128, "split_k": 32},
    {"block_k": 256, "split_k": 16, "num_warps": 8},
]
EXPAND_B64 = [
    {},
    {"block_n": 128},
    {"block_n": 256, "num_warps": 8},
]
EXPAND_SLICED = [  # only for modules with fused slices
    {"block_n": 64, "slices": True},
    {"block_n": 128, "slices": True},
    {"block_n": 256, "slices": True, "num_warps": 8},
]
SHRINK_B1 = [{}, {"block_k": 128, "split_k": 32}]
EXPAND_B1 = [{}, {"block_n": 256, "num_warps": 8}]
EXPAND_B1_SLICED = [{"block_n": 256, "slices": True, "num_warps": 8}]
DEQUANT_M1 = [
    {},
    {"form": "gemv"},
    {"form": "gemv", "block_n": 16, "block_k": 512},
    {"form": "gemv", "block_n": 64, "block_k": 256, "num_warps": 8},
    {"form": "gemv", "block_n": 32, "block_k": 512, "split_k": 1},
]
DEQUANT_M16 = [
    {},
    {"form": "gemv", "block_m": 4, "block_n": 32, "block_k": 128},
]
ATTENTION = [
    {},
    {"block_n": 32},
    {"split_kv": 4},
    {"split_kv": 8},
    {"split_kv": 8, "block_n": 32},
    {"split_kv": 16},
    {"split_kv": 8, "num_warps": 8},
]


def count_configs(shapes: Shapes = FULL) -> int:
    sliced = sum(len(outs) > 1 for _, outs in shapes.modules.values())
    n_mod = len(shapes.modules)
    sgmv = n_mod * (len(SHRINK_B64) + len(EXPAND_B64) + len(SHRINK_B1) + len(EXPAND_B1))
    sgmv += sliced * (len(EXPAND_SLICED) + len(EXPAND_B1_SLICED))
    dequant = 2 * len(shapes.dequant) * (len(DEQUANT_M1) + len(DEQUANT_M16))
    return sgmv + dequant + len(ATTENTION)


class Sweep:
    """Runs configs against a deadline, records rows, prints progress."""

    def __init__(self, dry: bool, budget_s: float, peak: float):
        self.dry, self.peak = dry, peak
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.rows: list[dict] = []
        self.baselines: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def time_ms(self, fn: Callable[[], object]) -> float | None:
        if self.dry:
            return None
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5, rep=20, return_mode="median"))

    def baseline(self, group: str, fn: Callable[[], object], nbytes: int) -> None:
        if self.out_of_time():
            return
        try:
            ms = self.time_ms(fn)
        except Exception as exc:  # a baseline failing must not stop the sweep
            print(f"  baseline {group}: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
            return
        if ms is not None:
            self.baselines[group] = ms
            print(f"[{self.elapsed():6.1f}s] {group:34s} bf16 baseline {ms * 1e3:9.2f} us  "
                  f"{self._bw(nbytes, ms)}", flush=True)  # fmt: skip

    def _bw(self, nbytes: int, ms: float | None) -> str:
        if ms is None:
            return ""
        gbps = nbytes / (ms * 1e-3) / 1e9
        return f"{gbps:7.0f} GB/s {100 * gbps * 1e9 / self.peak:5.1f}% HBM"

    def run(
        self,
        group: str,
        cfg: dict,
        make: Callable[[dict], Callable[[], object]],
        check: Callable[[Callable[[], object]], float],
        tol: float,
        nbytes: int,
    ) -> None:
        """make(cfg) -> fn running the op; check(fn) runs it once, returns the relative error."""
        row: dict = {"group": group, "config": cfg, "bytes": nbytes}
        self.rows.append(row)
        if self.out_of_time():
            row["status"] = "skipped (budget)"
            return
        t0 = time.monotonic()
        try:
            fn = make(cfg)
            err = float(check(fn))
            row["rel_err"] = err
            if not err <= tol:  # NaN fails too
                row["status"] = f"wrong (rel err {err:.3g} > {tol})"
            else:
                row["ms"] = self.time_ms(fn)
                row["status"] = "ok"
                if row["ms"] is not None:
                    row["GB_per_s"] = nbytes / (row["ms"] * 1e-3) / 1e9
                    row["hbm_fraction"] = row["GB_per_s"] * 1e9 / self.peak
        except Exception as exc:
            row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            if self.dry:
                traceback.print_exc()
        row["wall_s"] = time.monotonic() - t0
        ms = row.get("ms")
        timing = f"{ms * 1e3:9.2f} us  {self._bw(nbytes, ms)}" if ms is not None else ""
        print(f"[{self.elapsed():6.1f}s] {group:34s} {_cfg(cfg):52s} {row['status'][:60]:8s} "
              f"{timing}", flush=True)  # fmt: skip


def _cfg(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


# ---------------------------------------------------------------------------------- dequant
def sweep_dequant(sw: Sweep, shapes: Shapes, dev, dtype, tol: float, ms_list) -> None:
    from loraplex.kernels import dequant_matmul, reference

    for m, configs in ms_list:
        for n, k in shapes.dequant:
            if sw.out_of_time():
                return
            x = torch.randn(m, k, device=dev, dtype=dtype)
            w = torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5
            sw.baseline(f"dequant M{m} {n}x{k}", lambda x=x, w=w: torch.nn.functional.linear(x, w),
                        n * k * 2)  # fmt: skip
            del w
            q8 = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8)
            s8 = (torch.rand(n, device=dev) * 0.01 + 0.001).to(dtype)
            q4 = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
            s4 = (torch.rand(n, k // 128, device=dev) * 0.01 + 0.001).to(dtype)
            z4 = (torch.randn(n, k // 128, device=dev) * 0.01).to(dtype)
            ref8 = reference.int8_matmul(x.float(), q8, s8)
            ref4 = reference.int4_matmul(x.float(), q4, s4, z4, 128)

            def int4(c, x=x, q=q4, s=s4, z=z4):
                return lambda: dequant_matmul.int4_matmul(x, q, s, z, 128, **c)

            def int8(c, x=x, q=q8, s=s8):
                return lambda: dequant_matmul.int8_matmul(x, q, s, **c)

            cases = (
                ("int4", int4, ref4, n * k // 2 + 2 * s4.numel() * s4.element_size()),
                ("int8", int8, ref8, n * k + s8.numel() * s8.element_size()),
            )
            for name, make, ref, nbytes in cases:
                group = f"dequant {name} M{m} {n}x{k}"
                for cfg in configs:
                    sw.run(group, cfg, make, lambda fn, ref=ref: _rel_err(fn(), ref), tol, nbytes)
            del q8, q4, s8, s4, z4, cases, int4, int8


# ------------------------------------------------------------------------------------- sgmv
def _lora(shapes: Shapes, fin: int, outs: list[int], batch: int, dev, dtype):
    from loraplex.kernels import sgmv

    r, k, n = shapes.rank, len(outs), sum(outs)
    n_ad = min(shapes.adapters, batch)
    per = batch // n_ad
    w = k * r
    a = torch.randn(n_ad, w, fin, device=dev, dtype=dtype) * fin**-0.5
    b = torch.zeros(n_ad, w, n, device=dev, dtype=dtype)
    off = 0
    for i, o in enumerate(outs):  # block-diagonal, as the engine lays out fused slices
        b[:, i * r : (i + 1) * r, off : off + o] = torch.randn(n_ad, r, o, device=dev).to(dtype)
        off += o
    segments = [(i * per, (i + 1) * per, i) for i in range(n_ad)]
    meta = sgmv.build_meta(segments, [w] * n_ad, dev, block_m=16)
    x = torch.randn(batch, fin, device=dev, dtype=dtype)
    t_ref = torch.zeros(batch, w, device=dev)
    d_ref = torch.zeros(batch, n, device=dev)
    for s, e, slot in segments:
        t_ref[s:e] = x[s:e].float() @ a[slot].float().T
        d_ref[s:e] = t_ref[s:e] @ b[slot].float()
    ends = torch.tensor([sum(outs[: i + 1]) for i in range(k)], dtype=torch.int32, device=dev)
    a_bytes = n_ad * w * fin * a.element_size()
    b_bytes = n_ad * r * n * b.element_size()  # the non-zero blocks only
    return a, b, x, meta, ends, t_ref, d_ref, a_bytes, b_bytes


def sweep_sgmv(sw: Sweep, shapes: Shapes, dev, dtype, tol: float, batch: int, plan) -> None:
    from loraplex.kernels import sgmv

    shrink_cfgs, expand_cfgs, sliced_cfgs = plan
    for mod, (fin, outs) in shapes.modules.items():
        if sw.out_of_time():
            return
        a, b, x, meta, ends, t_ref, d_ref, a_bytes, b_bytes = _lora(
            shapes, fin, outs, batch, dev, dtype
        )
        n = sum(outs)
        w_base = torch.randn(n, fin, device=dev, dtype=dtype)
        sw.baseline(
            f"sgmv b{batch} {mod} base linear",
            lambda x=x, w=w_base: torch.nn.functional.linear(x, w),
            n * fin * 2,
        )
        del w_base
        t = torch.zeros_like(t_ref)
        y = torch.zeros(batch, n, device=dev, dtype=dtype)

        def make_shrink(cfg, t=t, x=x, a=a, meta=meta):
            split = cfg.get("split_k")
            zero = split is None or split > 1  # the splits add into t (auto splits at decode)

            def fn():
                if zero:
                    t.zero_()
                sgmv.sgmv_shrink(t, x, a, meta, **cfg)
                return t

            return fn

        def make_expand(cfg, y=y, t_in=t_ref, b=b, meta=meta, ends=ends, r=shapes.rank):
            kw = dict(cfg)
            if kw.pop("slices", False):
                kw.update(slice_ends=ends, block_r=max(16, r))

            def fn():
                sgmv.sgmv_expand(y, t_in, b, meta, **kw)
                return y

            return fn

        def check_expand(fn, y=y, d_ref=d_ref):
            y.zero_()
            return _rel_err(fn(), d_ref)

        for cfg in shrink_cfgs:
            sw.run(f"sgmv shrink b{batch} {mod}", cfg, make_shrink,
                   lambda fn, t_ref=t_ref: _rel_err(fn(), t_ref), tol, a_bytes)  # fmt: skip
        more = sliced_cfgs if len(outs) > 1 else []
        for cfg in expand_cfgs + more:
            sw.run(f"sgmv expand b{batch} {mod}", cfg, make_expand, check_expand, tol,
                   b_bytes)  # fmt: skip
        del a, b


# -------------------------------------------------------------------------------- attention
def sweep_attention(sw: Sweep, shapes: Shapes, dev, dtype, tol: float) -> None:
    from loraplex.kernels import paged_attention, reference

    batch, ctx, heads, kvh, hd, page = shapes.attention
    blocks = batch * ctx // page
    k_cache = torch.randn(blocks, page, kvh, hd, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=dev).view(batch, ctx // page)
    q = torch.randn(batch, heads, hd, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    qsl, lens, scale = list(range(batch + 1)), [ctx] * batch, hd**-0.5
    expected = torch.zeros_like(q, dtype=torch.float32)
    reference.paged_attention(expected, q.float(), k_cache.float(), v_cache.float(), tables,
                              qsl, lens, scale)  # fmt: skip

    def make(cfg):
        return paged_attention.paged_attention_plan(
            out, q, k_cache, v_cache, tables, qsl, lens, scale, **cfg
        )

    def check(fn):
        out.fill_(float("nan"))
        fn()
        return _rel_err(out, expected)

    group = f"attention decode b{batch} ctx{ctx}"
    for cfg in ATTENTION:
        sw.run(group, cfg, make, check, tol, 2 * k_cache.numel() * k_cache.element_size())


# ---------------------------------------------------------------------------------- summary
def best_per_group(rows: list[dict]) -> dict[str, dict]:
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("ms") is None:
            continue
        if r["group"] not in best or r["ms"] < best[r["group"]]["ms"]:
            best[r["group"]] = r
    return best


def report(sw: Sweep, shapes: Shapes) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in sw.rows:
        groups.setdefault(r["group"], []).append(r)
    print("\n# per op, fastest first")
    for group, rows in groups.items():
        base_key = _baseline_key(group)
        base = sw.baselines.get(base_key)
        print(f"\n## {group}" + (f"   (bf16 baseline {base * 1e3:.2f} us)" if base else ""))
        timed = sorted((r for r in rows if r.get("ms") is not None), key=lambda r: r["ms"])
        default = next((r["ms"] for r in timed if not r["config"]), None)
        for r in timed:
            vs = f"  x{base / r['ms']:.2f} vs bf16" if base else ""
            vs += f"  x{default / r['ms']:.2f} vs default" if default else ""
            print(f"  {r['ms'] * 1e3:9.2f} us  {r['GB_per_s']:7.0f} GB/s "
                  f"{100 * r['hbm_fraction']:5.1f}% HBM  {_cfg(r['config']):50s}{vs}")  # fmt: skip
        for r in rows:
            if r.get("ms") is None:
                status = (
                    r["status"]
                    if r["status"] != "ok"
                    else f"ok, untimed (rel err {r['rel_err']:.2g})"
                )
                print(f"  {'-':>9s}     {status[:90]}  [{_cfg(r['config'])}]")
    best = best_per_group(sw.rows)
    best_cfgs = {g: r["config"] for g, r in best.items()}
    print("\n# best config per op\nBEST = " + pprint.pformat(best_cfgs, width=100))
    summary = _summary(sw, shapes, best)
    for line in summary["lines"]:
        print(line)
    return {"best": best_cfgs, "summary": summary}


def _baseline_key(group: str) -> str:
    parts = group.split()
    if parts[0] == "dequant":  # dequant int4 M1 NxK -> dequant M1 NxK
        return f"dequant {parts[2]} {parts[3]}"
    if parts[0] == "sgmv":  # sgmv shrink b64 qkv -> sgmv b64 qkv base linear
        return f"sgmv {parts[2]} {parts[3]} base linear"
    return ""


def _summary(sw: Sweep, shapes: Shapes, best: dict[str, dict]) -> dict:
    lines, out = ["\n# summary"], {}
    for batch in (shapes.batch, 1):
        tot = {"default": 0.0, "best": 0.0, "base": 0.0}
        complete = True
        for mod in shapes.modules:
            for op in ("shrink", "expand"):
                g = f"sgmv {op} b{batch} {mod}"
                d = next((r["ms"] for r in sw.rows if r["group"] == g and not r["config"]
                          and r.get("ms") is not None), None)  # fmt: skip
                if d is None or g not in best:
                    complete = False
                    continue
                tot["default"] += d * LAYERS
                tot["best"] += best[g]["ms"] * LAYERS
            base = sw.baselines.get(f"sgmv b{batch} {mod} base linear")
            complete = complete and base is not None
            tot["base"] += (base or 0.0) * LAYERS
        if complete and tot["base"]:
            out[f"sgmv_b{batch}_ms_per_step"] = tot
            lines.append(
                f"LoRA b{batch} per decode step ({LAYERS} layers, shrink (with zeroing t when "
                f"split) + expand, L2 flushed): default {tot['default']:.3f} ms = "
                f"{100 * tot['default'] / tot['base']:.0f}% of the base linears "
                f"({tot['base']:.3f} ms); best configs {tot['best']:.3f} ms = "
                f"{100 * tot['best'] / tot['base']:.0f}%"
            )
    for g, r in best.items():
        if g.startswith("dequant") and " M1 " in g:
            base = sw.baselines.get(_baseline_key(g))
            if base:
                lines.append(f"{g}: best x{base / r['ms']:.2f} vs bf16 ({_cfg(r['config'])})")
                out[g] = base / r["ms"]
    return {"lines": lines, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="start no new config after this many seconds")  # fmt: skip
    parser.add_argument("--ops", default="dequant,sgmv,attention",
                        help="comma list of dequant, sgmv, attention")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, TRITON_INTERPRET=1, tiny shapes, fp32: check every config "
                        "against the reference once, time nothing")  # fmt: skip
    parser.add_argument("--shapes", choices=("tiny", "full"), default=None,
                        help="tiny (dry-run default) or full, Llama-8B (GPU default)")  # fmt: skip
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                        help="fp32 (dry-run default) or bf16 (GPU default)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON path (default {RESULTS}; none in a dry run)")  # fmt: skip
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the kernel modules)
        dev, dtype, tol, shapes, name, peak = "cpu", torch.float32, 1e-3, TINY, "cpu", 1.0
    else:
        if not torch.cuda.is_available():
            sys.exit("kernel_sweep times GPU kernels and needs CUDA (use --dry-run on a CPU)")
        if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
            sys.exit("TRITON_INTERPRET is set: the sweep would time the interpreter")
        dev, dtype, tol, shapes = "cuda", torch.bfloat16, 3e-2, FULL
        name = torch.cuda.get_device_name()
        peak = next((bw for key, bw in HBM.items() if key in name), PEAK_DEFAULT)
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references
    shapes = {"tiny": TINY, "full": FULL}.get(args.shapes, shapes)
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    dtype = dtypes.get(args.dtype, dtype)
    tol = max(tol, {torch.float32: 1e-3, torch.float16: 1e-2}.get(dtype, 3e-2))
    import triton

    torch.manual_seed(0)
    ops = set(args.ops.split(","))
    print(
        f"# kernel sweep on {name}, triton {triton.__version__}, torch {torch.__version__}, "
        f"{count_configs(shapes)} configs in all, budget {args.budget_s:.0f} s",
        flush=True,
    )
    sw = Sweep(args.dry_run, args.budget_s, peak)
    steps: list[tuple[str, Callable[[], None]]] = [
        ("dequant", lambda: sweep_dequant(sw, shapes, dev, dtype, tol, [(1, DEQUANT_M1)])),
        ("sgmv", lambda: sweep_sgmv(sw, shapes, dev, dtype, tol, shapes.batch,
                                    (SHRINK_B64, EXPAND_B64, EXPAND_SLICED))),
        ("attention", lambda: sweep_attention(sw, shapes, dev, dtype, tol)),
        ("sgmv", lambda: sweep_sgmv(sw, shapes, dev, dtype, tol, 1,
                                    (SHRINK_B1, EXPAND_B1, EXPAND_B1_SLICED))),
        ("dequant", lambda: sweep_dequant(sw, shapes, dev, dtype, tol, [(16, DEQUANT_M16)])),
    ]  # fmt: skip
    for op, step in steps:
        if op not in ops:
            continue
        try:  # one op's setup failing must not hide the others
            step()
        except Exception:
            traceback.print_exc()
        if not args.dry_run:
            torch.cuda.empty_cache()
    result = report(sw, shapes)
    bad = [r for r in sw.rows if r.get("status") not in ("ok", "skipped (budget)")]
    skipped = sum(r.get("status") == "skipped (budget)" for r in sw.rows) + max(
        0, count_configs(shapes) - len(sw.rows)
    )
    print(
        f"\n{count_configs(shapes)} configs: {sum(r.get('status') == 'ok' for r in sw.rows)} ok, "
        f"{len(bad)} wrong "
        f"or failed, {skipped} skipped or not run (budget, --ops); {sw.elapsed():.0f} s",
        flush=True,
    )
    out = args.out or (None if args.dry_run else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "device": name, "triton": triton.__version__, "torch": torch.__version__,
            "peak_bytes_per_s": peak, "baselines_ms": sw.baselines, "rows": sw.rows, **result,
        }, indent=1, default=str))  # fmt: skip
        print(f"wrote {out}")
    if args.dry_run and bad:
        sys.exit(f"{len(bad)} configs failed the dry run")


if __name__ == "__main__":
    main()
