"""Fused per-layer ops (add + RMSNorm, RoPE + KV write, SiLU·mul): the reference against the
engine's own layers, the CPU form against the reference bit for bit, the Triton kernels (under
the interpreter on the CPU) against the reference, and the CPU form's op count per call
against the unfused sequence (torch.profiler, `count_ops`).

Op counts per call measured by `count_ops` (top-level aten ops; the unfused sequence is what
engine/models/layers.py runs today, its RoPE tables already looked up once per step):

    add_rms_norm        Llama float32 2 vs 9 (add_, rms_norm);  bf16 3 vs 9 (+ mul_);
                        Gemma 6 vs 11
    rope_and_write_kv   q, k views of one qkv row, the step's `rope_rows` and flat caches
                        given: 9 vs 16 (partial rotary: 9 vs 20); from the table with 4-D
                        caches 16; q, k in separate tensors (after a q/k norm) 14
    silu_mul            all ops, nested included: 4 vs 10 (the halves as strided views, one
                        tensor fewer); gpt-oss clamped 25 vs 25 (three tensors fewer)

(`test_cpu_forms_take_fewer_ops` asserts these.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.models.layers import RMSNorm, Rotary
from loraplex.engine.models.spec import RopeSpec
from loraplex.kernels import fused_cpu
from loraplex.kernels import fused_reference as ref
from tests.kernels.conftest import DEVICE, tolerance

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The interpreter's bf16 arithmetic is broken (see kernels/fused.py's GPU test below).
TRITON_DTYPES = ["fp32", "fp16"] + (["bf16"] if torch.cuda.is_available() else [])
# CPU-only property tests: cheap, so many draws.
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _fused():
    from loraplex.kernels import fused  # after conftest set TRITON_INTERPRET

    return fused


def count_ops(fn, *args, **kwargs) -> int:
    """Top-level aten ops one call of fn dispatches (ops nested inside another op's
    implementation, e.g. rms_norm's own arithmetic, are not counted: they cost no Python)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in events if e.cpu_parent is None)


# --- add_rms_norm -----------------------------------------------------------------------------


def _norm_case(rows, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    res = (torch.randn(rows, hidden, generator=gen) * 4).to(dtype)
    w = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    return x, res, w


def _rmsnorm_module(w, eps, gemma):
    m = RMSNorm(w.shape[0], eps, gemma).to(w.dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


@SETTINGS
@given(
    rows=st.integers(1, 9),
    hidden=st.sampled_from([8, 64, 96, 200, 2880]),
    dtype=st.sampled_from(list(DTYPES)),
    gemma=st.booleans(),
    first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_cpu_equals_engine_rmsnorm(rows, hidden, dtype, gemma, first, seed):
    """The CPU form and the reference give the engine's RMSNorm(residual + x), bit for bit."""
    x, res, w = _norm_case(rows, hidden, DTYPES[dtype], seed)
    eps = 1e-6 if seed % 2 else 1e-5
    module = _rmsnorm_module(w, eps, gemma)
    with torch.no_grad():
        total = x if first else res + x
        want = module(total)
        for op in (ref.add_rms_norm, fused_cpu.add_rms_norm):
            r = None if first else res.clone()
            normed, new_res = op(x, r, w, eps, gemma)
            assert normed.dtype == want.dtype and torch.equal(normed, want), op
            assert torch.equal(new_res, total)
            assert first or new_res is r  # updated in place


@SETTINGS
@given(
    rows=st.integers(1, 9),
    hidden=st.sampled_from([8, 64, 200, 2880]),
    gemma=st.booleans(),
    first=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_eps_tensor_form(rows, hidden, gemma, first, scale, seed):
    """eps as a tensor (what the engine's norms pass on the CPU): Llama float32 takes the
    five-op form, within float32 rounding of the engine's RMSNorm (the sum of squares as the
    square of ||x||: a few ulps), the residual exact; Gemma keeps the exact form."""
    x, res, w = _norm_case(rows, hidden, torch.float32, seed)
    x, res = x * scale, res * scale
    eps = 1e-6 if seed % 2 else 1e-5
    module = _rmsnorm_module(w, eps, gemma)
    with torch.no_grad():
        total = x if first else res + x
        want = module(total)
        r = None if first else res.clone()
        normed, new_res = fused_cpu.add_rms_norm(x, r, w, torch.full((1, 1), eps), gemma)
    assert torch.equal(new_res, total) and (first or new_res is r)
    if gemma:
        assert torch.equal(normed, want)
    else:
        torch.testing.assert_close(normed, want, rtol=4e-6, atol=0)
    with torch.no_grad():  # five ops, against torch.rms_norm's composite
        ops = count_all_ops(fused_cpu.add_rms_norm, x, total.clone(), w,
                            torch.full((1, 1), eps), gemma)  # fmt: skip
        exact = count_all_ops(fused_cpu.add_rms_norm, x, total.clone(), w, eps, gemma)
    assert gemma or (ops == 6 and exact > 20), (ops, exact)


def count_all_ops(fn, *args) -> int:
    """Every aten op one call dispatches, nested ones included (what a step's profile counts)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def test_add_rms_norm_float32_weight_on_bf16_activations():
    """A weight in another dtype than x: the product promotes, as the engine's RMSNorm."""
    x, res, w = _norm_case(3, 64, torch.bfloat16, 1)
    w = w.float()
    with torch.no_grad():
        want = _rmsnorm_module(w, 1e-6, False).float()(res + x)
    normed, _ = fused_cpu.add_rms_norm(x, res.clone(), w, 1e-6, False)
    assert normed.dtype == torch.float32 and torch.equal(normed, want)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_add_rms_norm_triton(dtype, gemma, first):
    fused = _fused()
    dt = DTYPES[dtype]
    x, res, w = _norm_case(5, 200, dt, 3)  # hidden not a power of two: masked tail
    x = x.to(DEVICE)
    res, w = res.to(DEVICE), w.to(DEVICE)
    want, want_res = ref.add_rms_norm(x, None if first else res.clone(), w, 1e-6, gemma)
    r = None if first else res.clone()
    got, got_res = fused.add_rms_norm(x, r, w, 1e-6, gemma)
    torch.testing.assert_close(got, want, **tolerance(dt))
    assert torch.equal(got_res, want_res)
    assert first or got_res is r


# --- rope_and_write_kv ------------------------------------------------------------------------


def _rotary(head_dim, partial, max_len=64, kind="default"):
    spec = RopeSpec(theta=10000.0, partial=partial, kind=kind, factor=4.0,
                    attention_factor=1.2 if kind == "yarn" else 1.0)  # fmt: skip
    r = Rotary(spec, head_dim)
    r.build(torch.device("cpu"), max_len, {})
    return r


def _rope_case(tokens, heads, kv_heads, head_dim, dtype, seed, adjacent, pages=6, page=4):
    """q, k, v as views of one qkv row (adjacent) or separate tensors (after a q/k norm);
    NaN-filled caches, so a write outside the slots shows."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(tokens, width + 3, generator=gen) * 3).to(dtype)[:, :width]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
    if not adjacent:
        q, k = q.clone(), k.clone()  # own storages
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(pages * page, generator=gen)[:tokens]
    caches = [torch.full((pages, page, kv_heads, head_dim), float("nan"), dtype=dtype)
              for _ in "kv"]  # fmt: skip
    return q, k, v, positions, slots, caches


def _clone_case(q, k, v, caches):
    """Fresh copies that keep q and k's adjacency (clone the whole qkv storage)."""
    base = q if q.data_ptr() < k.data_ptr() else None
    if base is not None and fused_cpu._adjacent(q, k):
        hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
        width = q.stride(0) if q.shape[0] > 1 else (hq + 2 * hk) * d
        whole = torch.as_strided(q, (q.shape[0], width), (width, 1)).clone()
        q2 = whole[:, : hq * d].unflatten(-1, (hq, d))
        k2 = whole[:, hq * d : (hq + hk) * d].unflatten(-1, (hk, d))
        v2 = whole[:, (hq + hk) * d : (hq + 2 * hk) * d].unflatten(-1, (hk, d))
        return q2, k2, v2, [c.clone() for c in caches]
    return q.clone(), k.clone(), v.clone(), [c.clone() for c in caches]


@SETTINGS
@given(
    tokens=st.integers(1, 6),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1), (2, 2)]),
    head_dim=st.sampled_from([8, 16, 24]),
    partial=st.sampled_from([1.0, 0.5, 0.75]),
    dtype=st.sampled_from(list(DTYPES)),
    adjacent=st.booleans(),
    rows=st.booleans(),
    flat=st.booleans(),
    kind=st.sampled_from(["default", "yarn"]),
    seed=st.integers(0, 2**16),
)
def test_rope_and_write_kv_cpu_equals_engine(
    tokens, heads, head_dim, partial, dtype, adjacent, rows, flat, kind, seed
):
    """The reference equals the engine's Rotary + write_kv_cache; the CPU form equals it bit
    for bit, from the table or from the step's rows, with 4-D or flat caches."""
    rotary = _rotary(head_dim, partial, kind=kind)
    rd = rotary.rotary_dim
    if rd % 2:
        return
    dt = DTYPES[dtype]
    q, k, v, pos, slots, caches = _rope_case(tokens, *heads, head_dim, dt, seed, adjacent)
    want_q, want_k = rotary(q, pos), rotary(k, pos)
    table = rotary.cos_sin
    for op in (ref.rope_and_write_kv, fused_cpu.rope_and_write_kv):
        q2, k2, v2, (kc, vc) = _clone_case(q, k, v, caches)
        assert fused_cpu._adjacent(q2, k2) == adjacent
        cs, p = (ref.rope_rows(table, pos, dt), None) if rows else (table, pos)
        kc_arg, vc_arg = (kc.flatten(0, 1), vc.flatten(0, 1)) if flat else (kc, vc)
        got_q, got_k = op(q2, k2, v2, cs, p, rd, kc_arg, vc_arg, slots)
        assert got_q is q2 and got_k is k2
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), op
        flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
        assert torch.equal(flat_k[slots], want_k) and torch.equal(flat_v[slots], v)
        untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(
    "heads,head_dim,partial,adjacent,rows",
    [((4, 2), 16, 1.0, True, False), ((6, 1), 24, 0.5, False, True),
     ((2, 2), 32, 0.75, True, True)],
    ids=["gqa-table", "mqa-partial-rows", "mha-partial-adjacent-rows"],
)  # fmt: skip
def test_rope_and_write_kv_triton(dtype, heads, head_dim, partial, adjacent, rows):
    fused = _fused()
    dt = DTYPES[dtype]
    rotary = _rotary(head_dim, partial)
    rd = rotary.rotary_dim
    q, k, v, pos, slots, caches = _rope_case(5, *heads, head_dim, dt, 7, adjacent)
    slots[2] = -1  # a padding row: written nowhere
    table = rotary.cos_sin
    cs, p = (ref.rope_rows(table, pos, dt), None) if rows else (table, pos)
    valid = slots >= 0
    wq, wk, wv, (wkc, wvc) = _clone_case(q, k, v, caches)
    ref.rope_and_write_kv(wq, wk, wv, cs, p, rd, wkc, wvc, slots.clamp(min=0))
    wkc.view(-1, *wkc.shape[2:])[0] = float("nan")  # slot 0 came only from the clamped pad
    wvc.view(-1, *wvc.shape[2:])[0] = float("nan")
    wkc.view(-1, *wkc.shape[2:])[slots[valid]] = wk[valid]
    wvc.view(-1, *wvc.shape[2:])[slots[valid]] = wv[valid]
    args = [t.to(DEVICE) for t in (*_clone_case(q, k, v, [])[:3], cs, slots, *caches)]
    gq, gk, gv, gcs, gslots, gkc, gvc = args
    gcs = gcs.clone()
    fused.rope_and_write_kv(gq, gk, gv, gcs, None if p is None else p.to(DEVICE), rd,
                            gkc, gvc, gslots)  # fmt: skip
    tol = tolerance(dt)
    torch.testing.assert_close(gq.cpu(), wq, **tol)
    torch.testing.assert_close(gk.cpu(), wk, **tol)
    torch.testing.assert_close(gkc.cpu(), wkc, equal_nan=True, **tol)
    torch.testing.assert_close(gvc.cpu(), wvc, equal_nan=True, **tol)


# --- silu_mul ---------------------------------------------------------------------------------


def _act(gate_up, limit, alpha):
    """The activations as the engine's MLP and gpt-oss experts compute them today."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@SETTINGS
@given(
    rows=st.integers(0, 7),
    inter=st.sampled_from([1, 8, 40, 96]),
    dtype=st.sampled_from(list(DTYPES)),
    clamped=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_cpu_equals_reference(rows, inter, dtype, clamped, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(DTYPES[dtype])
    limit = 7.0 if clamped else None
    before = gate_up.clone()
    want = _act(gate_up, limit, 1.702)
    for op in (ref.silu_mul, fused_cpu.silu_mul):
        got = op(gate_up, limit, 1.702)
        assert got.dtype == want.dtype and torch.equal(got, want), op
    assert torch.equal(gate_up, before)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("limit", [None, 7.0])
def test_silu_mul_triton(dtype, limit):
    fused = _fused()
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(2)
    big = (torch.randn(4, 2 * 40 + 5, generator=gen) * 6).to(dt)
    gate_up = big[:, 2:-3].to(DEVICE)  # strided rows, a row stride past 2 * I
    want = ref.silu_mul(gate_up.cpu(), limit, 1.702)
    got = fused.silu_mul(gate_up, limit, 1.702)
    torch.testing.assert_close(got.cpu(), want, **tolerance(dt))


# --- op counts --------------------------------------------------------------------------------


def test_cpu_forms_take_fewer_ops():
    """Ops per call of each CPU form against the sequence the engine runs unfused today."""
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    for dtype, gemma, want, want_unfused in ((torch.float32, False, 2, 9),
                                             (torch.bfloat16, False, 3, 9),
                                             (torch.bfloat16, True, 6, 11)):  # fmt: skip
        x, res, w = _norm_case(4, hidden, dtype, 0)
        module = _rmsnorm_module(w, 1e-6, gemma)
        with torch.no_grad():
            unfused = count_ops(lambda: module(res + x))  # noqa: B023
            fused = count_ops(fused_cpu.add_rms_norm, x, res.clone(), w, 1e-6, gemma)
        assert (fused, unfused) == (want, want_unfused), (dtype, gemma)

    for partial, want_unfused in ((1.0, 16), (0.5, 20)):
        rotary = _rotary(head_dim, partial)
        rd = rotary.rotary_dim
        q, k, v, pos, slots, caches = _rope_case(4, heads, kv_heads, head_dim,
                                                 torch.bfloat16, 0, True)  # fmt: skip
        cos, sin = rotary.tables(pos, torch.bfloat16)  # the step's rows, shared by all layers

        def turn(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # noqa: B023

        def rotate(x):
            """Rotary.forward with the step's rows given (engine/models/layers.py)."""
            if rd < head_dim:  # noqa: B023
                rot, rest = x.split([rd, head_dim - rd], dim=-1)  # noqa: B023
                return torch.cat([turn(rot), rest], dim=-1)
            return turn(x)

        def unfused_step():
            from loraplex.kernels import reference

            q2, k2 = rotate(q), rotate(k)  # noqa: B023
            reference.write_kv_cache(*caches, k2, v, slots)  # noqa: B023
            return q2

        assert torch.equal(unfused_step(), rotary(q, pos))
        rows = ref.rope_rows(rotary.cos_sin, pos, torch.bfloat16)
        flat = [c.flatten(0, 1) for c in caches]
        unfused = count_ops(unfused_step)
        fused = count_ops(fused_cpu.rope_and_write_kv, q, k, v, rows, None, rd, *flat, slots)
        assert (fused, unfused) == (9, want_unfused)

    gate_up = torch.randn(4, 2 * 32).to(torch.bfloat16)
    # all ops, nested included (chunk is one top-level op holding seven): the halves as two
    # strided views take 4 where the unfused chunk takes 10; the clamped form keeps chunk
    for limit, want, want_unfused in ((None, 4, 10), (7.0, 25, 25)):
        unfused = count_all_ops(_act, gate_up, limit, 1.702)
        fused = count_all_ops(fused_cpu.silu_mul, gate_up, limit, 1.702)
        assert (fused, unfused) == (want, want_unfused), (limit, fused, unfused)


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_bf16_serving_shapes_on_gpu():
    """bf16 (which the interpreter cannot check) at Llama-8B shapes: batch 64 decode."""
    fused = _fused()
    bf16, dev = torch.bfloat16, "cuda"
    gen = torch.Generator().manual_seed(0)
    x, res, w = (t.to(dev) for t in _norm_case(64, 4096, bf16, 0))
    for gemma in (False, True):
        want, _ = ref.add_rms_norm(x, res.clone(), w, 1e-5, gemma)
        got, _ = fused.add_rms_norm(x, res.clone(), w, 1e-5, gemma)
        torch.testing.assert_close(got, want, **tolerance(bf16))

    rotary = _rotary(128, 1.0, max_len=8192)
    q, k, v, pos, slots, caches = _rope_case(64, 32, 8, 128, bf16, 0, True, pages=64, page=16)
    table = rotary.cos_sin.to(dev)
    pos = torch.randint(0, 8192, (64,), generator=gen)
    wq, wk, wv = (t.to(dev) for t in _clone_case(q, k, v, [])[:3])
    wkc, wvc = (c.to(dev) for c in caches)
    ref.rope_and_write_kv(wq, wk, wv, table, pos.to(dev), 128, wkc, wvc, slots.to(dev))
    gq, gk, gv = (t.to(dev) for t in _clone_case(q, k, v, [])[:3])
    gkc, gvc = (c.to(dev) for c in caches)
    fused.rope_and_write_kv(gq, gk, gv, table, pos.to(dev), 128, gkc, gvc, slots.to(dev))
    for got, want in ((gq, wq), (gk, wk), (gkc, wkc), (gvc, wvc)):
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance(bf16))

    gate_up = (torch.randn(64, 2 * 14336, generator=gen) * 4).to(dev, bf16)
    for limit in (None, 7.0):
        want = ref.silu_mul(gate_up, limit, 1.702)
        torch.testing.assert_close(fused.silu_mul(gate_up, limit), want, **tolerance(bf16))
