"""The CPU backend (kernels/cpu.py) against the reference: paged attention in both forms,
int8 caches, sliding windows and softcaps on steps mixing prefills and decodes; LoRA in its
dense, batched and per-segment forms; and the step's plans (built once, nothing kept)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu, cpu_plan, reference
from tests.kernels.conftest import tolerance
from tests.kernels.test_kv_int8 import _quantized
from tests.kernels.test_paged_attention import HEADS, _batch
from tests.kernels.test_sgmv import QKV, _case
from tests.utils.kernels import guarded, make_segments, slot_weights

STEPS = {  # cached tokens, new tokens per sequence
    "decode": ([30, 12, 50, 0, 7], [1, 1, 1, 1, 1]),
    "mixed": ([0, 37, 16, 5, 70], [20, 9, 1, 1, 1]),
    # a token and its proposals (short queries, batched), decodes and a prefill chunk
    "short": ([30, 12, 50, 0, 7, 3], [5, 1, 3, 12, 1, 2]),
}


@pytest.mark.parametrize("impl", cpu.ATTENTION_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(("window", "softcap", "int8"),
                         [(None, None, False), (8, None, False), (None, 0.5, False),
                          (None, None, True)])  # fmt: skip
def test_paged_attention_matches_the_reference(
    gen, impl, dtype, heads, step, window, softcap, int8
):
    contexts, news = STEPS[step]
    _, clean, q, tables, qsl, lens = _batch("cpu", gen, dtype, heads, 8, contexts, news)
    caches, scales = (_quantized(clean)[:2], _quantized(clean)[2:]) if int8 else (clean, ())
    args = (*caches, tables, qsl, lens, heads[2] ** -0.5, window, softcap, *scales)
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *args)
    got = torch.full_like(q, float("nan"))
    assert cpu.paged_attention(got, q, *args, impl=impl) is got
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    # without an `out`, the result comes back in a tensor of its own, the same values
    own = cpu.paged_attention(None, q, *args, impl=impl)
    assert own.shape == q.shape and own.dtype == q.dtype and torch.equal(own, got)


def _layer_matches_the_reference(q, caches, tables, qsl, lens, scale, window, plan, impl):
    """One layer's attention through the CPU backend with `plan` equals the reference's."""
    out = torch.zeros_like(q)
    cpu.paged_attention(out, q, *caches, tables, qsl, lens, scale, window, plan=plan,
                        impl=impl)  # fmt: skip
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *caches, tables, qsl, lens, scale, window)
    torch.testing.assert_close(out, want)


def test_one_decode_plan_per_step(gen, monkeypatch):
    """A step's plan (plan_attention, built before the forward) serves every layer, windows
    and kv heads included, and no layer builds anything; without a plan a call plans for
    itself and keeps nothing; the module keeps no state."""
    heads = (8, 2, 64)
    _, clean, q, tables, qsl, lens = _batch("cpu", gen, torch.float32, heads, 8,
                                            *STEPS["decode"])  # fmt: skip
    scale = heads[2] ** -0.5
    plan = cpu.plan_attention(tables, qsl, lens, clean[0].shape[1], [None, 8], [heads[1]])
    plans, masks = [], []
    real_plan, real_visible = cpu_plan.decode_group, cpu.visible
    monkeypatch.setattr(cpu_plan, "decode_group",
                        lambda *a, **k: plans.append(1) or real_plan(*a, **k))  # fmt: skip
    monkeypatch.setattr(cpu, "visible", lambda *a, **k: masks.append(1) or real_visible(*a, **k))

    def layer(plan, window=None):
        _layer_matches_the_reference(q, clean, tables, qsl, lens, scale, window, plan, "matmul")

    for window in (None, 8, None, 8):
        layer(plan, window)
    assert plans == [] and masks == []  # everything came from the plan
    layer(None)
    layer(None)
    assert len(plans) == 4  # two groups per call, planned for the call
    for module in (cpu, cpu_plan):
        assert not [k for k, v in vars(module).items()
                    if isinstance(v, dict) and not k.startswith("__")]  # fmt: skip


def test_folded_masks_come_from_the_plan(gen, monkeypatch):
    """A step mixing decodes, short queries and a prefill chunk, planned as the engine plans
    it (the model's query heads): sdpa's layers take their folded and visibility masks from the
    plan and build none."""
    heads = (8, 2, 64)
    _, clean, q, tables, qsl, lens = _batch("cpu", gen, torch.float32, heads, 8,
                                            *STEPS["short"])  # fmt: skip
    scale = heads[2] ** -0.5
    plan = cpu.plan_attention(tables, qsl, lens, clean[0].shape[1], [None, 8], [heads[1]],
                              torch.float32, heads[0])  # fmt: skip
    built = []
    real_fold, real_visible = cpu.fold_mask, cpu.visible
    monkeypatch.setattr(cpu, "fold_mask", lambda *a: built.append("fold") or real_fold(*a))
    monkeypatch.setattr(cpu, "visible", lambda *a: built.append("mask") or real_visible(*a))
    for window in (None, 8, None):
        _layer_matches_the_reference(q, clean, tables, qsl, lens, scale, window, plan, "sdpa")
    # only the prefill chunk's own mask (one sequence of 12 rows, not a planned group)
    assert built == ["mask"] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("window", [None, 8])
def test_attention_forms_agree(gen, dtype, heads, window):
    """The CPU path's two attention forms (torch's fused kernel, batched matmuls) give the
    same result on a step mixing fresh prompts, a chunk after a cached prefix and decodes."""
    _, clean, q, tables, qsl, lens = _batch(
        "cpu", gen, dtype, heads, 8, contexts=[0, 37, 16, 5, 70], news=[20, 9, 1, 1, 1]
    )
    outs = {}
    for impl in cpu.ATTENTION_IMPLS:
        outs[impl] = torch.full_like(q, float("nan"))
        cpu.paged_attention(outs[impl], q, *clean, tables, qsl, lens, heads[2] ** -0.5,
                            window, impl=impl)  # fmt: skip
    assert not outs["matmul"].isnan().any()
    torch.testing.assert_close(outs["matmul"].float(), outs["sdpa"].float(), **tolerance(dtype))


def test_attention_impl_is_chosen_per_engine(tiny_models, caplog):
    from loraplex.engine import LLM
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.step.model_runner import choose_cpu_attention

    model = str(tiny_models["llama"])
    with pytest.raises(ValueError, match="cpu_attention"):
        EngineConfig(model=model, cpu_attention="fast")
    for impl in cpu.ATTENTION_IMPLS:  # forced: no model needed, nothing timed
        assert choose_cpu_attention(EngineConfig(model=model, cpu_attention=impl), None) == impl
    with caplog.at_level("INFO", logger="loraplex.engine"):
        auto = LLM(model, dtype="float32", max_model_len=64, max_lora_rank=8, cpu_attention="auto")
    (line,) = [r.getMessage() for r in caplog.records if "CPU attention" in r.getMessage()]
    chosen = line.split()[2]
    assert auto.engine.runner.backend.cpu_attention == chosen
    assert "sdpa" in line and "matmul" in line
    times = cpu.pick_attention_impl(8, 2, 64, torch.bfloat16, batch=4, context=32)
    assert list(times) == sorted(times, key=times.get) and set(times) == {"sdpa", "matmul"}
    from loraplex.kernels.backend import KernelBackend

    with pytest.raises(ValueError, match="CPU attention"):
        KernelBackend(cpu_attention="flash")


@pytest.mark.parametrize("mode", ["auto", "reference"])
@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_backend_attention_returns_where_it_wrote(gen, mode, step):
    """KernelBackend.paged_attention, as the layers call it: with an `out` it fills and returns
    that tensor; without one it returns a fresh [T, H, d] result, the same values."""
    from loraplex.kernels.backend import KernelBackend

    heads = HEADS[1]  # grouped-query
    _, clean, q, tables, qsl, lens = _batch("cpu", gen, torch.float32, heads, 8, *STEPS[step])
    backend = KernelBackend(mode=mode)
    plan = backend.plan_attention(tables, qsl, lens, clean[0].shape[1], heads[0], heads[1])
    args = (q, *clean, tables, qsl, lens, heads[2] ** -0.5)
    out = torch.full_like(q, float("nan"))
    assert backend.paged_attention(out, *args, plan=plan) is out
    own = backend.paged_attention(None, *args, plan=plan)
    assert own is not out and own.shape == q.shape and torch.equal(own, out)
    want = torch.zeros_like(q)
    reference.paged_attention(want, *args)
    torch.testing.assert_close(own, want)


def test_two_engines_in_one_process_keep_their_own_backends(tiny_models, tiny_adapters):
    """Each engine's kernels are its own: an engine on the reference kernels and one on the
    CPU backend with each attention form, built in any order in one process, each give
    what a lone engine of their kind gives, bitwise."""
    from loraplex.engine import LLM, LoRARequest, SamplingParams

    model = str(tiny_models["llama"])
    adapter = LoRARequest("attn8", 1, str(tiny_adapters["llama"]["attn8"]))
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = [[5, 9, 33, 70], [7, 8, 200]]

    def build(mode: str, impl: str) -> LLM:
        return LLM(model, dtype="float32", max_lora_rank=8, cpu_attention=impl, kernel_mode=mode)

    def run(llm: LLM):
        return [o.outputs[0].logprobs for o in llm.generate(prompts, params, [adapter, None])]

    kinds = [("reference", "sdpa"), ("auto", "sdpa"), ("auto", "matmul")]
    alone = {k: run(build(*k)) for k in kinds}
    together = {k: build(*k) for k in kinds}  # all alive at once, built in one order
    for k in reversed(kinds):  # run in another
        assert run(together[k]) == alone[k], k
        assert together[k].engine.runner.backend.mode == k[0]


@pytest.mark.parametrize("ranks", [[8], [4, 8, 16]], ids=["one-width", "mixed-widths"])
def test_batched_decode_path_equals_per_segment(ranks, monkeypatch):
    """The CPU backend's batched path (many short segments, grouped by width) against its plain
    per-segment shrink/expand; rows past each slot's width and the spare slot hold NaN."""
    monkeypatch.setattr(cpu_plan, "DENSE_MAX_COLUMNS", 0)
    gen = torch.Generator().manual_seed(3)
    a, b, widths, segments, x, _, y = _case(
        "cpu", gen, torch.float32, requests=40, num_adapters=18, ranks=ranks, mix="uniform",
        no_adapter=True, prefill=False,
    )  # fmt: skip
    assert sum(1 for *_, slot in segments if slot >= 0) >= 3 * len(set(ranks))  # batched
    batched, plain = y.clone(), y.clone()
    cpu.lora_apply(batched, x, a, b, segments, widths)
    t = reference.sgmv_shrink(x, a, segments, widths)
    reference.sgmv_expand(plain, t, b, segments, widths)
    assert batched.isfinite().all()
    torch.testing.assert_close(batched, plain)
    assert not torch.equal(batched, y)  # the deltas were added


@pytest.mark.parametrize("ranks", [[8], [4, 8]], ids=["one-width", "mixed-widths"])
def test_decode_rows_beside_prefills_run_batched(ranks, monkeypatch):
    """A step with the decode rows of many adapters and a few long prefill chunks: the CPU
    backend batches the decode rows and runs the prefills one by one, with the plain per-segment
    result; NaN past the widths and in the spare slot."""
    monkeypatch.setattr(cpu_plan, "DENSE_MAX_COLUMNS", 0)
    gen = torch.Generator().manual_seed(4)
    num_adapters, dtype, in_features = 30, torch.float32, 64
    a, b, widths = slot_weights(
        [ranks[i % len(ranks)] for i in range(num_adapters)],
        in_features, QKV, num_adapters + 1, max(ranks), dtype, "cpu", gen,
    )  # fmt: skip
    lengths = [1] * 24 + [50, 1, 37, 1, 29, 1]
    segments, rows = make_segments(list(range(num_adapters)), lengths)
    _, x = guarded((rows, in_features), dtype, "cpu", gen)
    _, y = guarded((rows, sum(QKV)), dtype, "cpu", gen)
    plan = cpu.plan_lora(segments, widths, x.device)
    for group in plan.groups:  # the long segments alone, the decode rows batched
        assert all((e - s > 1) == (group.form is None) for s, e, _ in group.segments)
    assert sum(len(group.segments) for group in plan.groups) == num_adapters
    batched, plain = y.clone(), y.clone()
    cpu.lora_apply(batched, x, a, b, segments, widths)
    reference.sgmv_expand(plain, reference.sgmv_shrink(x, a, segments, widths), b, segments,
                          widths)  # fmt: skip
    assert batched.isfinite().all()
    torch.testing.assert_close(batched, plain)


def test_plan_follows_the_widths_of_the_same_segments():
    """A step plans once per width set (the runner's LoRABatch.plans): the same segments with
    a slot at another width (another module kind) get their own plan, and each kind's plan
    serves every module of that kind."""
    gen = torch.Generator().manual_seed(5)
    a, b, widths, segments, x, _, y = _case(
        "cpu", gen, torch.float32, requests=30, num_adapters=10, ranks=[8], mix="uniform",
        no_adapter=False, prefill=False,
    )  # fmt: skip
    halved = [w // 2 if i % 2 else w for i, w in enumerate(widths)]
    plans = {tuple(ws): cpu.plan_lora(segments, ws, x.device) for ws in (widths, halved)}
    assert len(plans) == 2
    for ws in (widths, halved, widths, halved):
        batched, plain = y.clone(), y.clone()
        cpu.lora_apply(batched, x, a, b, segments, ws, plan=plans[tuple(ws)])
        reference.sgmv_expand(plain, reference.sgmv_shrink(x, a, segments, ws), b, segments, ws)
        torch.testing.assert_close(batched, plain)


def _plain(y, x, a, b, segments, widths):
    out = y.clone()
    reference.sgmv_expand(out, reference.sgmv_shrink(x, a, segments, widths), b, segments, widths)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [[8], [2, 8]], ids=["one-width", "mixed-widths"])
def test_few_adapters_run_dense(dtype, ranks):
    """Few adapters (the stacked columns within DENSE_MAX_COLUMNS) run as two matmuls over
    all of them: decode rows and prefill chunks, rows without an adapter, one slot in several
    segments; NaN past the widths and in the spare slot, which nobody may read."""
    gen = torch.Generator().manual_seed(6)
    num_adapters = 3
    a, b, widths = slot_weights(
        [ranks[i % len(ranks)] for i in range(num_adapters)],
        64, QKV, num_adapters + 1, max(ranks), dtype, "cpu", gen,
    )  # fmt: skip
    # Not sorted by slot: slot 0 and 1 come back after others (as in any order of rows).
    segments = [(0, 1, 0), (1, 2, 1), (2, 3, -1), (3, 20, 2), (20, 21, 0), (21, 30, 1),
                (30, 31, -1), (31, 33, 2)]  # fmt: skip
    rows = 33
    _, x = guarded((rows, 64), dtype, "cpu", gen)
    _, y = guarded((rows, sum(QKV)), dtype, "cpu", gen)
    plan = cpu.plan_lora(segments, widths, x.device)
    assert plan.groups and all(isinstance(g.form, cpu_plan.Dense) for g in plan.groups)
    dense = y.clone()
    cpu.lora_apply(dense, x, a, b, segments, widths)
    assert dense.isfinite().all()
    torch.testing.assert_close(dense, _plain(y, x, a, b, segments, widths), **tolerance(dtype))
    for s, e, slot in segments:
        if slot < 0:
            assert torch.equal(dense[s:e], y[s:e])  # untouched, bit for bit
        else:
            assert not torch.equal(dense[s:e], y[s:e])


def test_dense_run_uses_the_slots_in_place_when_they_are_all_of_them():
    """Every slot of the maximum width in use, from slot 0: no gather, same result."""
    gen = torch.Generator().manual_seed(7)
    a, b, widths = slot_weights([8, 8], 64, QKV, 2, 8, torch.float32, "cpu", gen)
    segments, rows = make_segments([1, 0, 1], [1, 1, 5])
    x, y = torch.randn(rows, 64, generator=gen), torch.randn(rows, sum(QKV), generator=gen)
    [group] = cpu.plan_lora(segments, widths, x.device).groups
    width, index = group.width, group.form
    assert index.run is not None and index.run[0] == 0 and width == a.shape[1]
    assert cpu._stacked(a, index, width).data_ptr() == a.data_ptr()  # a view
    dense = y.clone()
    cpu.lora_apply(dense, x, a, b, segments, widths)
    torch.testing.assert_close(dense, _plain(y, x, a, b, segments, widths))


@pytest.mark.parametrize("width", [8, 4], ids=["full-width", "narrower"])
def test_one_adapter_on_every_row_multiplies_its_own_weights(width):
    """A group whose rows all use one slot (a batch of one, or rows all on one adapter) runs
    that slot's A and B directly, with no select; rows of no adapter between two segments of
    the slot keep the select (they must stay untouched). NaN past the width and in the spare
    slot, which nobody may read."""
    gen = torch.Generator().manual_seed(9)
    a, b, widths = slot_weights([8, width], 64, QKV, 3, 8, torch.float32, "cpu", gen)
    x = torch.randn(7, 64, generator=gen)
    y = torch.randn(7, sum(QKV), generator=gen)
    for segments, only in (([(0, 7, 1)], 1), ([(0, 1, -1), (1, 7, 1)], 1),
                           ([(0, 3, 1), (3, 4, -1), (4, 7, 1)], None)):  # fmt: skip
        [group] = cpu.plan_lora(segments, widths, x.device).groups
        assert isinstance(group.form, cpu_plan.Dense) and group.form.only == only
        # as the engine's modules call it: A^T's view, and both stacks' views slot by slot
        for a_t, views in ((None, None), (a.mT, None), (a.mT, (a.mT.unbind(0), b.unbind(0)))):
            out = y.clone()
            cpu.lora_apply(out, x, a, b, segments, widths, lora_a_t=a_t, slot_views=views)
            assert out.isfinite().all()
            torch.testing.assert_close(out, _plain(y, x, a, b, segments, widths))
            for s, e, slot in segments:
                assert torch.equal(out[s:e], y[s:e]) == (slot < 0)


def test_dense_run_keeps_rows_apart_when_another_adapter_overflows():
    """In float16, row 0's input times adapter 1's A overflows to inf. Row 0 uses adapter 0
    and row 1 adapter 1: the dense run selects (not multiplies) each row's own columns, so
    row 0 stays finite and equal to the per-segment result."""
    gen = torch.Generator().manual_seed(8)
    a, b, widths = slot_weights([8, 8], 64, QKV, 2, 8, torch.float32, "cpu", gen)
    a[1] = 1e3  # finite, as loading checks, but large
    x = torch.randn(2, 64, generator=gen)
    x[0], x[1] = 100.0, x[1] * 1e-3  # x[0] @ a[1]^T = 6.4e6: beyond float16
    a, b, x = a.half(), b.half(), x.half()
    y = torch.zeros(2, sum(QKV), dtype=torch.float16)
    segments = [(0, 1, 0), (1, 2, 1)]
    assert isinstance(cpu.plan_lora(segments, widths, x.device).groups[0].form, cpu_plan.Dense)
    assert not torch.isfinite(x[:1] @ a[1].t()).all()
    dense = y.clone()
    cpu.lora_apply(dense, x, a, b, segments, widths)
    assert dense.isfinite().all()
    torch.testing.assert_close(dense, _plain(y, x, a, b, segments, widths))


@pytest.mark.parametrize("impl", cpu.ATTENTION_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("window", [None, 8])
def test_whole_decode_step_takes_the_lean_path(gen, monkeypatch, impl, dtype, heads, window):
    """A step in which every sequence decodes one token, planned as the engine plans it
    (windows and kv heads): the lean form (q and out used in place, the plan's additive masks)
    equals the reference; float32 takes it in both forms, bf16 in sdpa's."""
    _, clean, q, tables, qsl, lens = _batch("cpu", gen, dtype, heads, 8, *STEPS["decode"])
    plan = cpu.plan_attention(tables, qsl, lens, clean[0].shape[1], [None, 8], [heads[1]])
    assert plan.decode.whole
    lean = []
    real = cpu._decode_lean
    monkeypatch.setattr(cpu, "_decode_lean", lambda *a, **k: lean.append(1) or real(*a, **k))
    scale = heads[2] ** -0.5
    # q as the engine passes it: a strided view of a wider projection row
    wide = torch.randn(q.shape[0], q.shape[1] + 3, q.shape[2], generator=gen).to(dtype)
    wide[:, : q.shape[1]] = q
    view = wide[:, : q.shape[1]]
    got = torch.full_like(q, float("nan"))
    cpu.paged_attention(got, view, *clean, tables, qsl, lens, scale, window, plan=plan,
                        impl=impl)  # fmt: skip
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *clean, tables, qsl, lens, scale, window)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    assert lean == ([1] if impl == "sdpa" or dtype == torch.float32 else [])
    # as the engine's layers call it (no `out`): the kernel's own output, [B, H, d] and
    # contiguous (the o projection views it as rows), equal to the result copied into `out`
    before = wide.clone()
    own = cpu.paged_attention(None, view, *clean, tables, qsl, lens, scale, window, plan=plan,
                              impl=impl)  # fmt: skip
    assert own.shape == q.shape and own.is_contiguous() and torch.equal(own, got)
    assert torch.equal(wide, before)  # q is read, not written
    assert lean == ([1, 1] if impl == "sdpa" or dtype == torch.float32 else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("step", ["mixed", "short"])
def test_decode_rows_beside_prefills_fold_their_heads(gen, monkeypatch, dtype, heads, window,
                                                      step):  # fmt: skip
    """Decode rows in a step that also prefills, planned as the engine plans it (the queries'
    dtype and heads): sdpa gets them with their grouped-query heads folded into query rows and
    the plan's masks (additive for one-token rows, folded for several rows a sequence), and
    the step equals the reference."""
    _, clean, q, tables, qsl, lens = _batch("cpu", gen, dtype, heads, 8, *STEPS[step])
    plan = cpu.plan_attention(tables, qsl, lens, clean[0].shape[1], [None, 8], [heads[1]],
                              dtype, heads[0])  # fmt: skip
    assert not plan.decode.whole and plan.decode.seqs
    masks = []
    real = cpu._sdpa_folded
    monkeypatch.setattr(cpu, "_sdpa_folded", lambda q, k, v, m, s, f=None: masks.append(
        (q.shape[-3], m.dtype, m if f is None else f)) or real(q, k, v, m, s, f))  # fmt: skip
    scale = heads[2] ** -0.5
    got = torch.full_like(q, float("nan"))
    cpu.paged_attention(got, q, *clean, tables, qsl, lens, scale, window, plan=plan,
                        impl="sdpa")  # fmt: skip
    want = torch.zeros_like(q)
    reference.paged_attention(want, q, *clean, tables, qsl, lens, scale, window)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
    assert any(n == 1 and m == dtype for n, m, _ in masks)  # additive, in q's dtype
    if step == "short":  # 2..SHORT_QUERY_ROWS rows: folded too, with the plan's mask
        g = heads[0] // heads[1]
        want_mask = plan.short.folded[(window, g)] if g > 1 else plan.short.mask(window)
        assert any(n > 1 and t is want_mask for n, _, t in masks)


@pytest.mark.parametrize("slots", [(0, 12), (3, 9)], ids=["all-slots", "a-run-of-slots"])
@pytest.mark.parametrize("uniform", [True, False], ids=["equal-segments", "ragged"])
def test_consecutive_slots_are_read_in_place(slots, uniform, monkeypatch):
    """Segments over consecutive slots (the decode rows of many adapters, in slot order) read
    the slot stacks as views, and equal segments back to back view x and y too: no gather of
    weights or rows, no scatter; the result is the per-segment one."""
    monkeypatch.setattr(cpu_plan, "DENSE_MAX_COLUMNS", 0)  # the batched form, not the dense one
    gen = torch.Generator().manual_seed(5)
    lo, hi = slots
    num_slots, rank, in_features = 12, 8, 64
    a, b, widths = slot_weights([rank] * num_slots, in_features, QKV, num_slots, rank,
                                torch.float32, "cpu", gen)  # fmt: skip
    lengths = [2] * (hi - lo) if uniform else [1 + i % 3 for i in range(hi - lo)]
    segments, rows = make_segments(list(range(lo, hi)), lengths)
    _, x = guarded((rows, in_features), torch.float32, "cpu", gen)
    _, y = guarded((rows, sum(QKV)), torch.float32, "cpu", gen)
    plan = cpu.plan_lora(segments, widths, x.device)
    [group] = plan.groups
    index = group.form
    assert isinstance(index, cpu_plan.Batched) and index.slots == (lo, hi)
    assert (index.rows is not None) == uniform
    got, want = y.clone(), y.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cpu.lora_apply(got, x, a, b, segments, widths, plan=plan, lora_a_t=a.mT)
    names = {e.name for e in prof.events()}
    assert "aten::index_select" not in names
    assert uniform == ("aten::index_add_" not in names and "aten::index" not in names)
    reference.sgmv_expand(want, reference.sgmv_shrink(x, a, segments, widths), b, segments,
                          widths)  # fmt: skip
    torch.testing.assert_close(got, want)
