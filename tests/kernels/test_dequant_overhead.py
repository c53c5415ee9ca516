"""`DequantWeight`, the planned int4 / int8 matmul: the same results as the functions, its
launch planned once per batch size, and on CUDA the compiled kernel launched directly with the
arguments Triton's own launcher would pass (checked here against a stand-in kernel, so the
order is tested without a GPU).

The per-call overhead benchmark (CPU; no GPU needed):

    TRITON_INTERPRET= .venv/bin/python -m tests.kernels.test_dequant_overhead

measures the Python around the kernel two ways at Llama-8B's qkv (6144 x 4096, split-K) and
o_proj (4096 x 4096) int4 shapes at batch 1: with the launch stubbed out (the wrapper alone),
and through Triton's real JIT launch path with a stand-in driver whose C launcher does
nothing (binding, specialisation, cache lookup included; sm_90 code compiled with the wheel's
ptxas). docs/step-overhead-kernels.md has the figures.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from loraplex.kernels import dequant_matmul
from tests.kernels.test_dequant_matmul import _int_weights


def _int4_case(n, k, group, m, dtype, device, gen):
    qweight = _int_weights((n, k // 2), 0, 256, torch.uint8, device, gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.05).to(device)
    zeros = (torch.randn(n, k // group, generator=gen) * 0.05).to(device)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    return qweight, scales, zeros, x


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split_k", [None, 2])
def test_dequant_weight_equals_functions(device, gen, m, split_k):
    """Bit for bit the functions' results (same plan, same kernel), int4 and int8, GEMV
    (m = 1) and dot (m = 3) forms, with and without split-K; the plan is made once."""
    n, k, group = 48, 256, 64
    qweight, scales, zeros, x = _int4_case(n, k, group, m, torch.float16, device, gen)
    w4 = dequant_matmul.DequantWeight(qweight, scales, zeros, group, split_k=split_k)
    want = dequant_matmul.int4_matmul(x, qweight, scales, zeros, group, split_k=split_k)
    for _ in range(2):
        assert torch.equal(w4(x), want)
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=device)
    assert w4(x, out) is out and torch.equal(out, want)
    assert len(w4.plans) == 1

    q8 = _int_weights((n, k), -127, 128, torch.int8, device, gen)
    s8 = (torch.rand(n, generator=gen) / 50).to(device)
    w8 = dequant_matmul.DequantWeight(q8, s8, split_k=split_k)
    assert torch.equal(w8(x), dequant_matmul.int8_matmul(x, q8, s8, split_k=split_k))


def test_dequant_weight_plans_each_batch_shape_once(gen, monkeypatch):
    """launch_params runs at a plan's first call only: rows, dtype, x's row stride and
    alignment each make their own plan."""
    qweight, scales, zeros, x = _int4_case(32, 128, 128, 2, torch.float32, "cpu", gen)
    w = dequant_matmul.DequantWeight(qweight, scales, zeros, 128)
    for name in ("_dequant_gemv_kernel", "_dequant_matmul_kernel"):
        stub = _StubKernel(getattr(dequant_matmul, name).arg_names)
        monkeypatch.setattr(dequant_matmul, name, stub)
    monkeypatch.setattr(dequant_matmul, "_current_stream", lambda index: 0)
    calls = []
    real = dequant_matmul.launch_params
    monkeypatch.setattr(dequant_matmul, "launch_params",
                        lambda *a, **kw: calls.append(a) or real(*a, **kw))  # fmt: skip
    wide = torch.randn(2, 130, generator=gen)
    for xs in (x, x, x[:1], x[:1], x.half(), wide[:, :128], wide[:, 1:129], x):
        w(xs)
    assert len(calls) == len(w.plans) == 5  # 2 rows, 1 row, half, row stride 130, misaligned


class _StubCompiled:
    """Stands in for Triton's CompiledKernel: records the direct launches."""

    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        return None


class _StubKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` records the binding Triton
    would make (every parameter in order, constexprs included) and returns a compiled stub."""

    def __init__(self, arg_names):
        self.arg_names = list(arg_names)
        self.bound = []
        self.compiled = _StubCompiled()

    def __getitem__(self, grid):
        def launch(*args, num_warps=None, num_stages=None, **kwargs):
            values = list(args) + [kwargs[name] for name in self.arg_names[len(args) :]]
            assert len(values) == len(self.arg_names)
            self.bound.append((grid, values))
            return self.compiled

        return launch


@pytest.mark.parametrize("m,split_k", [(1, None), (1, 1), (5, None)])
def test_direct_launch_passes_what_triton_binds(gen, monkeypatch, m, split_k):
    """After the first launch, the compiled kernel gets the grid, the stream, the kernel
    handle and every argument in the JIT function's parameter order: what Triton's
    JITFunction.run passes its launcher."""
    n, k, group = 64, 256, 128
    qweight, scales, zeros, x = _int4_case(n, k, group, m, torch.float16, "cpu", gen)
    form = "gemv" if m == 1 else "dot"
    name = "_dequant_gemv_kernel" if form == "gemv" else "_dequant_matmul_kernel"
    stub = _StubKernel(getattr(dequant_matmul, name).arg_names)
    monkeypatch.setattr(dequant_matmul, name, stub)
    monkeypatch.setattr(dequant_matmul, "_current_stream", lambda index: 1234)
    w = dequant_matmul.DequantWeight(qweight, scales, zeros, group, split_k=split_k)
    w(x)
    (grid, first), = stub.bound  # fmt: skip
    assert stub.compiled.launches == []
    y2 = w(x)
    (launch,) = stub.compiled.launches
    g0, g1, g2, stream, function, packed, meta, enter, leave, *args = launch
    assert (g0, g1, g2) == grid and stream == 1234 and function == "fn-handle"
    assert packed == "packed" and meta is None
    assert len(args) == len(first)
    for got, want, arg in zip(args, first, stub.arg_names, strict=True):
        if arg == "y_ptr":
            assert got is y2 or got.dtype == torch.float32  # this call's output
        elif isinstance(want, torch.Tensor):
            assert got is want, arg
        else:
            assert got == want, arg
    assert len(stub.bound) == 1  # no second pass through the JIT launcher


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequant_weight_on_gpu_direct_launch_and_graph():
    """On CUDA: the direct launches (second call on) and their CUDA-graph replay equal
    int4_matmul, at Llama-8B's qkv (split-K) and o_proj shapes in bf16; prints per-call
    host-bound times (a tight loop of calls) for the record."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((6144, 4096), (4096, 4096)):
        qweight, scales, zeros, x = _int4_case(n, k, 128, 1, torch.bfloat16, "cuda", gen)
        want = dequant_matmul.int4_matmul(x, qweight, scales, zeros, 128)
        w = dequant_matmul.DequantWeight(qweight, scales, zeros, 128)
        for _ in range(3):
            assert torch.equal(w(x), want)
        (plan,) = w.plans.values()
        assert plan.compiled is not None  # the direct path ran
        out = torch.empty_like(want)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            w(x, out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        times = {}
        for name, fn in (("int4_matmul", lambda: dequant_matmul.int4_matmul(  # noqa: B023
                             x, qweight, scales, zeros, 128)),  # noqa: B023
                         ("DequantWeight", lambda: w(x))):  # noqa: B023  # fmt: skip
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(1000):
                fn()
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - start) * 1e3
        print(f"{n}x{k} per call, us: " + ", ".join(f"{a} {t:.1f}" for a, t in times.items()))


# --- the overhead benchmark -------------------------------------------------------------------


class _NoLaunch:
    """A kernel whose launches (through `[grid]` or compiled) do nothing."""

    function, packed_metadata = 0, None

    def __init__(self, arg_names):
        self.arg_names = list(arg_names)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self

    def run(self, *args):
        pass


def _per_call_us(fn, calls=1000, repeats=15) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)  # the least disturbed run: other processes share this machine


def _module_at(rev: str):
    """kernels/dequant_matmul.py as of git revision `rev`, imported from a temporary file."""
    import importlib.util
    import subprocess
    import tempfile

    source = subprocess.run(["git", "show", f"{rev}:kernels/dequant_matmul.py"], check=True,
                            capture_output=True, text=True).stdout  # fmt: skip
    path = os.path.join(tempfile.mkdtemp(), "dequant_matmul_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("dequant_matmul_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Per-call host time of the int4 wrapper: `--before REV` adds the functions as of that
    git revision (run from the repository root)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision whose int4_matmul to time too")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        sys.exit("run with TRITON_INTERPRET unset (the JIT path compiles real sm_90 code)")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class StandInUtils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}

        @staticmethod
        def load_binary(name, kernel, shared, device):
            return "module", 0, 64, 0, 1024  # module, function, registers, spills, threads

    class StandInDriver:
        """Enough of Triton's driver for its JIT launch path, without a GPU: the launcher it
        makes does nothing."""

        utils = StandInUtils()

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def launcher_cls(self, src, metadata):
            return lambda *args: None

    driver.set_active(StandInDriver())
    modules = {"int4_matmul": dequant_matmul}
    if args.before:
        modules[f"int4_matmul@{args.before}"] = _module_at(args.before)
    dm = dequant_matmul
    dm._current_stream = lambda index: 0
    gen = torch.Generator().manual_seed(0)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one CPU thread; us per call, best of 15 runs", flush=True)
    for label, n, k in (("qkv 6144x4096", 6144, 4096), ("o_proj 4096x4096", 4096, 4096)):
        qweight, scales, zeros, x = _int4_case(n, k, 128, 1, torch.bfloat16, "cpu", gen)
        out = torch.empty(1, n, dtype=x.dtype)
        p = dm.launch_params(1, n, k, True, 128)
        split = f"split-K {p['split_k']}" if p["split_k"] > 1 else "no split"
        for how in ("launch stubbed", "Triton launch path"):
            real = {name: mod._dequant_gemv_kernel for name, mod in modules.items()}
            if how == "launch stubbed":
                for mod in modules.values():
                    mod._dequant_gemv_kernel = _NoLaunch(real["int4_matmul"].arg_names)
            w = dm.DequantWeight(qweight, scales, zeros, 128)
            calls = {name: (lambda m=mod: m.int4_matmul(x, qweight, scales, zeros, 128))  # noqa: B023
                     for name, mod in modules.items()}  # fmt: skip
            calls["DequantWeight"] = lambda w=w: w(x)  # noqa: B023
            calls["DequantWeight, out="] = lambda w=w: w(x, out)  # noqa: B023
            times = ", ".join(f"{name} {_per_call_us(fn):.1f}" for name, fn in calls.items())
            print(f"{label} ({split}), {how}: {times}", flush=True)
            for name, mod in modules.items():
                mod._dequant_gemv_kernel = real[name]


if __name__ == "__main__":
    main()
