"""Grouped matmul for mixture-of-experts: the Triton kernel (under the interpreter on the CPU),
the CPU backend and each backend mode against the reference and torch._grouped_mm, over
drawn shapes: many empty groups, tiny ranks, no rows, strided weights, all three dtypes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loraplex.kernels import cpu, cpu_moe, moe_triton, reference
from loraplex.kernels.backend import KernelBackend
from tests.kernels.conftest import DEVICE, tolerance

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _case(counts, k, n, dtype, layout, tail, seed):
    """x [sum(counts) + tail, k] as a column slice of a NaN-padded tensor (the tail rows past
    offs[-1] are NaN too), and w [G, k, n] in `layout`: "kn" contiguous, "nk" the transposed
    view of [G, n, k] (nn.Linear rows), "slice" a view into a larger NaN-filled tensor. A
    read outside the rows, columns or groups it should use shows up as NaN."""
    gen = torch.Generator().manual_seed(seed)
    g, p = len(counts), sum(counts)
    x = torch.full((p + tail, k + 3), float("nan"))
    x[:p, :k] = torch.randn(p, k, generator=gen)
    x = x.to(dtype)[:, :k]
    values = torch.randn(g, k, n, generator=gen).to(dtype)
    if layout == "nk":
        w = values.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "slice":
        big = torch.full((g + 1, k + 2, n + 5), float("nan"), dtype=dtype)
        big[1:, 1:-1, 2:-3] = values
        w = big[1:, 1:-1, 2:-3]
    else:
        w = values.contiguous()
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x.to(DEVICE), w.to(DEVICE), offs.to(DEVICE)


def _check(got, want, dtype, rows):
    tol = tolerance(dtype)
    torch.testing.assert_close(got[:rows].float(), want[:rows].float(), **tol)


@st.composite
def cases(draw):
    g = draw(st.integers(1, 12))
    # Mostly empty groups, as LoRA over adapter slots x experts has them.
    counts = draw(st.lists(st.one_of(st.just(0), st.integers(0, 20)), min_size=g, max_size=g))
    k = draw(st.sampled_from([1, 8, 16, 24, 70]))
    n = draw(st.sampled_from([1, 8, 16, 33]))
    return dict(
        counts=counts, k=k, n=n, dtype=draw(st.sampled_from(sorted(DTYPES))),
        layout=draw(st.sampled_from(["kn", "nk", "slice"])), tail=draw(st.sampled_from([0, 3])),
        seed=draw(st.integers(0, 2**16)),
        block_m=draw(st.sampled_from([None, 16, 32])), block_k=draw(st.sampled_from([None, 16])),
    )  # fmt: skip


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(cases())
@example(
    dict(
        counts=[0] * 40 + [3] + [0] * 30 + [1, 0, 2] + [0] * 20,
        k=24,
        n=8,
        dtype="fp16",
        layout="nk",
        tail=0,
        seed=1,
        block_m=None,
        block_k=None,
    )
)  # LoRA expand-like
@example(
    dict(
        counts=[0, 0, 0],
        k=16,
        n=8,
        dtype="fp32",
        layout="kn",
        tail=0,
        seed=2,
        block_m=None,
        block_k=None,
    )
)  # no rows at all
@example(
    dict(
        counts=[37, 0, 18],
        k=70,
        n=33,
        dtype="bf16",
        layout="slice",
        tail=0,
        seed=3,
        block_m=16,
        block_k=16,
    )
)  # several row blocks and K steps per group
def test_grouped_mm_matches_reference_and_torch(case):
    dtype = DTYPES[case["dtype"]]
    x, w, offs = _case(case["counts"], case["k"], case["n"], dtype, case["layout"],
                       case["tail"], case["seed"])  # fmt: skip
    rows = sum(case["counts"])
    want = reference.grouped_mm(x, w, offs)
    assert want.shape == (x.shape[0], case["n"]) and want.dtype == dtype
    got = moe_triton.grouped_mm(x, w, offs, block_m=case["block_m"], block_k=case["block_k"])
    assert got.shape == want.shape and got.dtype == dtype
    _check(got, want, dtype, rows)
    if DEVICE.type == "cpu":
        _check(cpu.grouped_mm(x, w, offs), want, dtype, rows)
    aligned = cpu_moe._aligned(x) and cpu_moe._aligned(w)
    if aligned and (DEVICE.type == "cpu" or dtype == torch.bfloat16):
        _check(torch._grouped_mm(x, w, offs=offs), want, dtype, rows)


def test_reference_is_one_matmul_per_group():
    x = torch.arange(12.0).view(4, 3)
    w = torch.stack([torch.eye(3), 2 * torch.eye(3), -torch.eye(3)])  # [3, 3, 3]
    offs = torch.tensor([1, 1, 4], dtype=torch.int32)
    want = torch.cat([x[:1], -x[1:]])
    assert torch.equal(reference.grouped_mm(x, w, offs), want)
    assert torch.equal(moe_triton.grouped_mm(x.to(DEVICE), w.to(DEVICE), offs.to(DEVICE)).cpu(),
                       want)  # fmt: skip


def test_block_map_gives_each_group_its_blocks():
    offs = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int32)  # counts 0, 5, 0, 35, 1
    group, row = moe_triton.block_map(offs, 41, 16)
    assert group.shape == (3 + 5,)  # cdiv(41, 16) + min(G, P)
    assert group.tolist() == [1, 3, 3, 3, 4, -1, -1, -1]
    assert row[:5].tolist() == [0, 5, 21, 37, 40]


@pytest.mark.parametrize("mode", ["auto", "reference", "triton"])
def test_backend_grouped_mm(mode, monkeypatch):
    """Each mode reaches its backend (the CPU one: torch's grouped matmul) and gives the
    reference's result."""
    x, w, offs = _case([3, 0, 5], 16, 8, torch.float32, "nk", 0, 7)
    calls = []
    for name, module in (("cpu", cpu), ("triton", moe_triton)):
        real = module.grouped_mm
        monkeypatch.setattr(module, "grouped_mm",
                            lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))  # fmt: skip
    got = KernelBackend(mode=mode).grouped_mm(x, w, offs)
    auto = "cpu" if DEVICE.type == "cpu" else "triton"
    assert calls == {"auto": [auto], "reference": [], "triton": ["triton"]}[mode]
    torch.testing.assert_close(got, reference.grouped_mm(x, w, offs))


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels import moe_triton
fn = moe_triton._grouped_mm_kernel
for dt, bm, bn, bk in (("bf16", 16, 16, 64), ("bf16", 64, 128, 64), ("fp32", 16, 128, 16)):
    types = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}", offs_ptr="*i32",
                 block_group_ptr="*i32", block_row_ptr="*i32")
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=False)
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
    assert k.asm.get("cubin")
print("compiled")
"""


def test_grouped_mm_kernel_compiles_for_sm90():
    """The GPU compiler rejects what the interpreter accepts (dots under 16): build sm_90
    code for the tile shapes the wrapper picks (tiny ranks give 16-wide tiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
@pytest.mark.parametrize(
    ("rows", "groups", "k", "n", "used"),
    [(256, 128, 2048, 768, 128), (4096, 128, 768, 2048, 128),  # experts: decode, prefill
     (256, 32 * 128, 2048, 16, 256), (256, 32 * 128, 16, 768, 256)],  # LoRA shrink, expand
)  # fmt: skip
def test_grouped_mm_bf16_serving_shapes(rows, groups, k, n, used):
    """Qwen3-30B-A3B-sized experts (top-8 of 128) and rank-16 LoRA over 32 slots x 128
    experts, in bf16 (the dtype the interpreter cannot check) against torch's CUDA form."""
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(0, used, (rows,), generator=gen) * (groups // used)
    offs = torch.bincount(picks, minlength=groups).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(groups, n, k, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    got = moe_triton.grouped_mm(x, w, offs)
    want = torch._grouped_mm(x, w, offs=offs)
    torch.testing.assert_close(got.float(), want.float(), atol=0.5, rtol=2e-2)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU backend")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["kn", "nk", "slice"])
@pytest.mark.parametrize(
    ("counts", "tail", "k", "n", "per_row"),
    [([0] * 20 + [1] + [0] * 9 + [2, 0, 0, 1] + [0] * 30, 0, 24, 8, True),  # LoRA, decode
     ([0] * 7 + [1] * 2, 3, 24, 8, True),  # rows past offs[-1]
     ([1, 2, 0, 1, 2, 1, 1, 0], 0, 24, 8, True),  # LoRA, prefill: most groups have rows
     ([0] * 9 + [3] + [0] * 30, 0, 24, 8, False),  # more rows than the per-row form takes
     ([2, 1, 2, 2, 1, 2, 2, 2], 0, 256, 192, False)],  # experts, decode: large matrices
)  # fmt: skip
def test_cpu_grouped_mm_per_row_form(dtype, layout, counts, tail, k, n, per_row, monkeypatch):
    """Groups of a row or two with small matrices (LoRA over slots x experts): one batched
    matmul over the rows, each with its own group's matrix, and no torch._grouped_mm. More
    rows per group, or matrices the rows would copy many times over, go through
    torch._grouped_mm."""
    x, w, offs = _case(counts, k, n, DTYPES[dtype], layout, tail, seed=len(counts))
    real, calls = torch._grouped_mm, []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = cpu.grouped_mm(x, w, offs)
    assert got.shape == (x.shape[0], n) and got.dtype == x.dtype
    _check(got, reference.grouped_mm(x, w, offs), DTYPES[dtype], sum(counts))
    assert len(calls) == (not per_row)


def test_cpu_grouped_mm_gathers_in_memory_order():
    """A transposed weight view is gathered as the rows it holds (a view of a contiguous
    copy), not copied element by element into a new layout."""
    w = torch.randn(6, 8, 5).transpose(1, 2)  # [G, K=5, N=8], unit stride along K
    index = torch.tensor([4, 1])
    got = cpu_moe._take(w, index)
    assert torch.equal(got, w[index]) and got.transpose(1, 2).is_contiguous()
