"""The compute ceiling of a serving trace on this machine.

How fast could any system serve a trace here? Its requests need a known number of matmul
FLOPs (`request_flops`: the base model's linears, attention's two products, one lm_head row
per output token), and this machine multiplies matrices no faster than the fastest GEMM torch
does on it (`measure_peak`, timed in the same run as the systems, at the model's own shapes
and dtype, or in float32 for a half-precision model where that is faster, with the servers'
thread count). So

    ceiling output tokens/s = peak GFLOP/s / GFLOP per output token

holds for every system, whatever it does about batching or overhead; a system's achieved
GFLOP/s (its output tokens/s × GFLOP per output token) says how close it came. LoRA's
products (rank 8: well under 1 % of these FLOPs) and the elementwise work (norms,
activations, softmax) are not counted, so the ceiling errs high and achieved figures low.

The peak is the fastest GEMM at any of the measured batch sizes, prefill's included; a decode
step multiplies only as many rows as it has sequences, and the fewer the rows, the further
below the peak a GEMM runs (docs/cpu-path.md has figures). How far, per row count:

    python -m benchmarks.roofline --model tiny-llama --dtype bfloat16 --threads 1 --rows 16,64,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from loraplex.engine.models.spec import ModelSpec


def linear_flops_per_token(spec: ModelSpec) -> int:
    """2 × the weights one token multiplies in the decoder layers (q|k|v, o, gate, up, down)."""
    h = spec.hidden_size
    per_layer = (
        h * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h + 3 * h * spec.intermediate_size
    )
    return 2 * spec.num_layers * per_layer


def head_flops(spec: ModelSpec) -> int:
    """One lm_head row: hidden × vocab multiply-adds."""
    return 2 * spec.hidden_size * spec.vocab_size


def _sum_min(lo: int, hi: int, cap: int | None) -> int:
    """sum(min(c, cap) for c in range(lo, hi + 1)); cap None = no cap."""
    if hi < lo:
        return 0
    if cap is None or hi <= cap:
        return (lo + hi) * (hi - lo + 1) // 2
    if lo > cap:
        return (hi - lo + 1) * cap
    return (lo + cap) * (cap - lo + 1) // 2 + (hi - cap) * cap


def attention_flops(spec: ModelSpec, first: int, last: int) -> int:
    """Scores and weighted values of the tokens that see `first`..`last` keys (themselves
    included), one token each, summed over layers: 4 × heads × head_dim per visible key, with
    a sliding window capping what a layer's token sees."""
    per_key = 4 * spec.num_heads * spec.head_dim
    return per_key * sum(_sum_min(first, last, w) for w in spec.windows)


def request_flops(spec: ModelSpec, input_len: int, output_len: int) -> int:
    """Matmul FLOPs of one request: its prompt and every output token but the last pass
    through the layers (the token at position p sees p + 1 keys); each output token takes one
    lm_head row (the first from the prompt's last position)."""
    fed = input_len + max(output_len - 1, 0)
    return (
        linear_flops_per_token(spec) * fed
        + head_flops(spec) * output_len
        + attention_flops(spec, 1, fed)
    )


def flops_per_output_token(spec: ModelSpec, lengths: Iterable[tuple[int, int]]) -> float:
    """FLOPs per output token of a trace, given its requests' (input_len, output_len)."""
    lengths = list(lengths)
    out = sum(o for _, o in lengths)
    if not out:
        raise ValueError("the trace asks for no output tokens")
    return sum(request_flops(spec, i, o) for i, o in lengths) / out


def _forms(w: torch.Tensor) -> dict[str, object]:
    """The ways torch multiplies by `w` here: F.linear, and oneDNN's pre-packed linear where
    this CPU and build pack the dtype (what loraplex runs on such CPUs)."""
    forms: dict[str, object] = {"F.linear": lambda x: F.linear(x, w)}
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            op = torch.ops.mkldnn._linear_pointwise
            op(torch.zeros(2, w.shape[1], dtype=w.dtype), packed, None, "none", [], "")
        except RuntimeError:  # no packed form for this dtype on this CPU
            return forms
        forms["oneDNN packed"] = lambda x: op(x, packed, None, "none", [], "")
    return forms


def gemm_shapes(spec: ModelSpec, rows: Iterable[int] = (32, 64, 256)) -> list[tuple[int, int, int]]:
    """(rows, in, out) of the model's two largest GEMMs (lm_head, gate|up) at batch sizes a
    server runs."""
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    return [(r, h, out) for r in rows for out in (v, 2 * i)]


def measure_peak(
    spec: ModelSpec,
    dtype: torch.dtype,
    threads: int | None = None,
    repeats: int = 5,
    shapes: list[tuple[int, int, int]] | None = None,
) -> dict:
    """The fastest GEMM over the model's shapes and torch's forms of it: median of `repeats`
    timed calls after one warm-up, on `threads` threads (None: torch's current setting)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    found: list[dict] = []
    try:
        with torch.inference_mode():
            for rows, k, n in shapes or gemm_shapes(spec):
                w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
                x = torch.randn(rows, k, generator=gen).to(dtype)
                forms = [(form, fn, x) for form, fn in _forms(w).items()]
                if dtype != torch.float32 and w.device.type == "cpu":
                    # A half-precision model's products in float32 count too: what a server
                    # does on a CPU without native half matmuls (loraplex's
                    # cpu_float32_compute), far faster there than the dtype's own GEMM.
                    forms += [(f"float32 compute, {form}", fn, x.float())
                              for form, fn in _forms(w.float()).items()]  # fmt: skip
                for form, fn, xs in forms:
                    times = []
                    for _ in range(repeats + 1):
                        start = time.perf_counter()
                        fn(xs)
                        times.append(time.perf_counter() - start)
                    seconds = statistics.median(times[1:])
                    found.append(
                        {
                            "shape": [rows, k, n],
                            "form": form,
                            "gflops": 2 * rows * k * n / seconds / 1e9,
                        }
                    )
                del w
    finally:
        torch.set_num_threads(before)
    best = max(found, key=lambda f: f["gflops"])
    return {
        **best,
        "threads": threads or before,
        "dtype": str(dtype).removeprefix("torch."),
        "all": found,
    }


def ceiling(peak_gflops: float, flops_per_token: float) -> float:
    """Output tokens/s no system passes on this machine for the trace."""
    return peak_gflops * 1e9 / flops_per_token


def by_rows(peak: dict) -> dict[int, dict]:
    """The fastest of `measure_peak`'s GEMMs at each row count (a decode step of that many
    sequences multiplies that many rows), in row order."""
    best: dict[int, dict] = {}
    for f in peak["all"]:
        rows = f["shape"][0]
        if rows not in best or f["gflops"] > best[rows]["gflops"]:
            best[rows] = f
    return dict(sorted(best.items()))


def main(argv: list[str] | None = None) -> None:
    from loraplex.engine.models.spec import spec_from_config

    ap = argparse.ArgumentParser(
        description="The fastest GEMM at a model's shapes per batch size, against the peak "
        "that `python -m benchmarks.peers` takes as the compute ceiling."
    )
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama, demo or a model folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="32,64,256", help="batch sizes (rows) to time")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from benchmarks import assets

    folder = assets.prepare(args.model, 0)[0]
    spec = spec_from_config(json.loads((folder / "config.json").read_text()))
    rows = [int(r) for r in args.rows.split(",") if r]
    peak = measure_peak(spec, getattr(torch, args.dtype), args.threads, args.repeats,
                        gemm_shapes(spec, rows))  # fmt: skip
    shape = " x ".join(map(str, peak["shape"]))
    print(f"peak: {peak['gflops']:.1f} GFLOP/s ({peak['dtype']}, {peak['threads']} thread(s), "
          f"{peak['form']}, {shape})")  # fmt: skip
    for n, f in by_rows(peak).items():
        shape = " x ".join(map(str, f["shape"]))
        print(f"{n:6d} rows: {f['gflops']:8.1f} GFLOP/s = {f['gflops'] / peak['gflops']:4.0%} "
              f"of the peak ({f['form']}, {shape})")  # fmt: skip


if __name__ == "__main__":
    main()
