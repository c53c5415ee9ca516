"""Mixture-of-experts bases against transformers + peft (float32): Qwen3-MoE, Qwen2-MoE (shared
expert), Mixtral, with attention adapters, expert adapters in both formats that exist (PEFT's
`target_parameters` on transformers 5's fused experts, and one LoRA per expert `Linear` as
trained on transformers 4) and the router as a target, mixed in one batch; also under chunked
prefill, preemption, prefix-cache hits and fewer slots than adapters.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.adapters.lora import AdapterError, load_adapter
from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.spec import spec_from_config
from loraplex.engine.weights.quantization import QuantizedExperts, QuantizedLoRALinear
from testkit.factories import (
    EXPERT_PARAMETERS,
    MOE_KINDS,
    make_adapter,
    make_tiny_model,
    split_expert_adapter,
)
from tests.engine.test_parity import check_rows, hf_reference, run_rows
from tests.engine.test_quantization import dequantized_folder

EXPERTS = ("gate_up_proj", "down_proj")
# name -> make_adapter arguments. Every target_parameters adapter in one peft model must name
# the same parameters; the router's adapter has a reference of its own.
MOE_ADAPTERS = {
    "qv4": dict(r=4, alpha=8, targets=("q_proj", "v_proj")),
    "exp8": dict(r=8, alpha=16, targets=("q_proj",), target_parameters=EXPERTS),
    "exp4": dict(r=4, alpha=4, targets=("o_proj",), target_parameters=EXPERTS, use_rslora=True),
    # a transformers-4 style config: peft 0.21 turns gate/up/down into target_parameters on
    # the fused experts with gate|up at twice the rank (a `.*\\.gate_up_proj` rank_pattern)
    "mlp16": dict(r=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj", "k_proj")),
}
ROUTER = {"router": dict(r=4, alpha=8, targets=("v_proj",),
                         target_parameters=(*EXPERT_PARAMETERS, "mlp.gate.weight"))}  # fmt: skip
SPLIT = {"exp8split": "exp8"}  # per-expert format -> the fused adapter with its weights
ROWS = ["exp8", None, "qv4", "exp8split", "exp4", "mlp16", "exp8"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """kind -> (base folder, adapters name -> folder)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for i, kind in enumerate(MOE_KINDS):
        base = make_tiny_model(kind, root / kind, seed=40 + i)
        adapters = {
            name: make_adapter(base, root / f"{kind}-{name}", seed=50 + j, **spec)
            for j, (name, spec) in enumerate({**MOE_ADAPTERS, **ROUTER}.items())
        }
        for name, fused in SPLIT.items():
            adapters[name] = split_expert_adapter(base, adapters[fused], root / f"{kind}-{name}")
        out[kind] = (base, adapters)
    return out


_REFS: dict[str, list[dict]] = {}


def _reference(moe, kind):
    if kind not in _REFS:
        base, adapters = moe[kind]
        adapters = {n: p for n, p in adapters.items() if n not in ROUTER}
        _REFS[kind] = hf_reference(base, adapters, ROWS, same_as=SPLIT)
    return _REFS[kind]


def _llm(moe, kind, **kw):
    args = dict(dtype="float32", max_loras=4, max_lora_rank=16) | kw
    return LLM(str(moe[kind][0]), **args)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_mixed_expert_adapters_match_hf_peft(kind, moe):
    llm = _llm(moe, kind)
    rows = run_rows(llm, moe[kind][1], rows=ROWS)
    check_rows(rows, _reference(moe, kind), names=ROWS)
    # the expert adapters act: their rows differ from the same prompt without one
    assert llm.engine.adapters.slot_bytes > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_router_as_a_target(kind, moe):
    """PEFT can adapt the router's weight as a parameter: the top-k choice moves with it."""
    base, adapters = moe[kind]
    rows = ["router", None, "router"]
    ref = hf_reference(base, {"router": adapters["router"]}, rows)
    check_rows(run_rows(_llm(moe, kind), adapters, rows=rows), ref, names=rows)
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    assert "gate" in load_adapter(adapters["router"], spec, 16, torch.float32).targets


def test_both_expert_formats_load_the_same_weights(moe):
    """The fused adapter's gate|up shares one A; the per-expert one has gate and up apart:
    the same delta B A for every expert."""
    base, adapters = moe["qwen3_moe"]
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    fused = load_adapter(adapters["exp8"], spec, 16, torch.float32)
    split = load_adapter(adapters["exp8split"], spec, 16, torch.float32)
    layers = {layer for layer, _ in fused.experts}
    assert layers == {0} and {p for _, p in split.experts} == {"gate_proj", "up_proj", "down_proj"}
    for layer in layers:
        a, b = fused.experts[(layer, "gate_up_proj")]
        delta = [split.experts[(layer, p)][1] @ split.experts[(layer, p)][0]
                 for p in ("gate_proj", "up_proj")]  # fmt: skip
        torch.testing.assert_close(b @ a, torch.cat(delta, dim=1))
        a, b = fused.experts[(layer, "down_proj")]
        a2, b2 = split.experts[(layer, "down_proj")]
        torch.testing.assert_close(b @ a, b2 @ a2)
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(fused.targets)
    assert fused.nbytes > 0


@pytest.mark.parametrize(
    "case",
    [
        dict(max_num_batched_tokens=7),  # chunked prefill
        dict(max_model_len=80, num_kv_blocks=10, block_size=8),  # preemption
        dict(max_loras=2),  # five adapters through two slots
    ],
    ids=["chunked", "preempt", "slots"],
)
def test_qwen3_moe_under_pressure(case, moe):
    llm = _llm(moe, "qwen3_moe", **case)
    rows = run_rows(llm, moe["qwen3_moe"][1], rows=ROWS)
    check_rows(rows, _reference(moe, "qwen3_moe"), full_prefill=False, names=ROWS)
    if "num_kv_blocks" in case:
        assert llm.engine.scheduler.num_preemptions > 0
    if case.get("max_loras") == 2:
        manager = llm.engine.adapters  # five adapters went through two slots
        assert len(manager.slots) == 2 and manager.slot_writes >= 5


def test_prefix_cache_hits(moe):
    llm = _llm(moe, "qwen3_moe", block_size=8)
    check_rows(run_rows(llm, moe["qwen3_moe"][1], rows=ROWS), _reference(moe, "qwen3_moe"),
               names=ROWS)  # fmt: skip
    hits = llm.engine.block_manager.prefix_hits
    rows = run_rows(llm, moe["qwen3_moe"][1], rows=ROWS)
    assert llm.engine.block_manager.prefix_hits > hits
    check_rows(rows, _reference(moe, "qwen3_moe"), full_prefill=False, names=ROWS)


def test_expert_slots_count_against_the_budget_and_can_be_turned_off(moe):
    base, adapters = moe["qwen3_moe"]
    on = _llm(moe, "qwen3_moe").engine
    off = _llm(moe, "qwen3_moe", expert_lora=False).engine
    stacks = on.adapters.expert_slot_bytes()
    assert stacks > 0 and on.memory.adapter_slot_bytes == off.memory.adapter_slot_bytes + stacks
    rows = run_rows(LLM(str(base), dtype="float32", max_loras=4, max_lora_rank=16,
                        expert_lora=False), adapters, rows=["qv4", None])  # fmt: skip
    assert len(rows) == 2  # attention adapters still serve
    llm = LLM(str(base), dtype="float32", max_loras=4, max_lora_rank=16, expert_lora=False)
    with pytest.raises(AdapterError, match="expert_lora off"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                     [LoRARequest("exp8", 1, str(adapters["exp8"]))])  # fmt: skip
    assert not llm.engine.has_unfinished()


def _rewrite(src, dst, tensors=None, cfg=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, dst / "adapter_model.safetensors")
    if cfg is not None:
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_expert_adapters_are_refused(moe, tmp_path):
    base, adapters = moe["qwen3_moe"]
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    fused = load_file(adapters["exp8"] / "adapter_model.safetensors")
    split = load_file(adapters["exp8split"] / "adapter_model.safetensors")
    cfg = json.loads((adapters["exp8"] / "adapter_config.json").read_text())

    key = next(k for k in split if ".experts.3.gate_proj.lora_A" in k)
    bad_expert = {**split, key.replace(".experts.3.", ".experts.99."): split[key].clone()}
    nan = {k: (v * float("nan") if ".experts.lora_A" in k else v) for k, v in fused.items()}
    wrong = {k: (v[:, :-1].contiguous() if ".experts.lora_A" in k else v) for k, v in fused.items()}
    cases = {
        "expert 99 but the base model has 8": _rewrite(
            adapters["exp8split"], tmp_path / "e99", bad_expert
        ),  # fmt: skip
        "NaN or Inf": _rewrite(adapters["exp8"], tmp_path / "nan", nan),
        "fit neither gate_up_proj nor down_proj": _rewrite(
            adapters["exp8"], tmp_path / "shape", wrong
        ),  # fmt: skip
        "target_parameters does not declare": _rewrite(
            adapters["exp8"], tmp_path / "undeclared", cfg={**cfg, "target_parameters": None}
        ),
    }
    for message, folder in cases.items():
        with pytest.raises(AdapterError, match=message):
            load_adapter(folder, spec, 16, torch.float32)
    # a dense adapter's MLP weights on a routed layer name a module that does not exist
    dense = make_tiny_model("qwen3", tmp_path / "dense")
    mlp = make_adapter(dense, tmp_path / "dense-mlp", targets=("gate_proj",))
    with pytest.raises(AdapterError, match="mixture of experts"):
        load_adapter(mlp, spec, 16, torch.float32)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_expert_adapters_on_a_quantized_moe_base(method, moe, tmp_path, reference_mode):
    """Experts are quantized too (the router is not): the engine's answers equal transformers +
    peft on the dequantized weights, expert adapters included."""
    base, adapters = moe["qwen3_moe"]
    llm = _llm(moe, "qwen3_moe", quantization=method)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.gate_up_proj is None
    assert isinstance(llm.engine.model.model.layers[0].mlp.gate, LoRALinear)
    assert not isinstance(llm.engine.model.model.layers[0].mlp.gate, QuantizedLoRALinear)
    folder = dequantized_folder(llm, base, tmp_path / "dequantized")
    rows = ROWS[:5]
    ref_adapters = {n: p for n, p in adapters.items() if n not in ROUTER}
    ref = hf_reference(folder, ref_adapters, rows, same_as=SPLIT)
    check_rows(run_rows(llm, adapters, rows=rows), ref, names=rows)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    base = make_tiny_model("gpt_oss", root / "base", seed=60, num_layers=3)
    specs = {
        "qv4": MOE_ADAPTERS["qv4"],
        "exp8": dict(
            r=8, alpha=16, targets=("o_proj",), target_parameters=(*EXPERTS, "mlp.router.weight")
        ),  # fmt: skip
        "exp4": dict(
            r=4,
            alpha=8,
            targets=("q_proj", "k_proj"),
            target_parameters=(*EXPERTS, "mlp.router.weight"),
        ),  # fmt: skip
    }
    adapters = {n: make_adapter(base, root / n, seed=70 + j, **spec)
                for j, (n, spec) in enumerate(specs.items())}  # fmt: skip
    return base, adapters


GPT_OSS_ROWS = ["exp8", None, "qv4", "exp4", "exp8"]


def test_gpt_oss_matches_hf_peft(gpt_oss):
    """Attention sinks, alternating sliding windows, biased router with softmax over the top-k,
    biased experts with the clamped SwiGLU, interleaved gate|up — and expert + router LoRA."""
    base, adapters = gpt_oss
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    assert spec.attention_sinks and spec.windows[0] == 8 and spec.windows[1] is None
    llm = LLM(str(base), dtype="float32", max_loras=4, max_lora_rank=16)
    ref = hf_reference(base, adapters, GPT_OSS_ROWS)
    check_rows(run_rows(llm, adapters, rows=GPT_OSS_ROWS), ref, names=GPT_OSS_ROWS)


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., k] float -> MXFP4 blocks [..., k / 32, 16] uint8 and scales [..., k / 32] uint8:
    a power-of-two scale per 32 values, each value the nearest FP4 (e2m1) code."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    g = w.float().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - values).abs().argmin(-1) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(gpt_oss, tmp_path):
    """gpt-oss as published: MXFP4 expert blocks and scales, dequantized at load; the reference
    is a float checkpoint holding transformers' own dequantization of the same blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    base, adapters = gpt_oss
    mx, ref = tmp_path / "mxfp4", tmp_path / "float"
    shutil.copytree(base, mx)
    shutil.copytree(base, ref)
    tensors = load_file(base / "model.safetensors")
    mx_tensors, ref_tensors = {}, dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mx_tensors[name] = t
            continue
        blocks, scales = _to_mxfp4(t.transpose(1, 2))  # stored [experts, out, in]
        mx_tensors[name + "_blocks"], mx_tensors[name + "_scales"] = blocks, scales
        ref_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert (ref_tensors[name] - t).abs().max() < t.abs().max()  # a fair copy of t
    save_file(mx_tensors, mx / "model.safetensors")
    save_file(ref_tensors, ref / "model.safetensors")
    cfg = json.loads((mx / "config.json").read_text())
    keep = ["self_attn", "router", "lm_head"]
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": keep}
    (mx / "config.json").write_text(json.dumps(cfg))
    rows = GPT_OSS_ROWS[:3]
    llm = LLM(str(mx), dtype="float32", max_loras=4, max_lora_rank=16)
    check_rows(run_rows(llm, adapters, rows=rows), hf_reference(ref, adapters, rows), names=rows)
    # and into our int4 layers
    int4 = LLM(str(mx), dtype="float32", quantization="int4", max_loras=2, max_lora_rank=16)
    assert isinstance(int4.engine.model.model.layers[0].mlp.experts, QuantizedExperts)


def test_experts_only_adapter_with_empty_target_modules(moe, tmp_path):
    """peft 0.21 writes `target_modules: []` for an adapter on the experts only."""
    base, _ = moe["qwen3_moe"]
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    folder = make_adapter(base, tmp_path / "experts-only", targets=(), target_parameters=EXPERTS)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": []}))
    adapter = load_adapter(folder, spec, 16, torch.float32)
    assert adapter.experts and not adapter.weights


def _experts_layer(gen: torch.Generator):
    """A tiny routed layer with expert LoRA stacks of 3 slots: slot 0 with one shared A for
    gate|up (PEFT's fused form: half its gate|up width), slot 1 with gate and up apart (the
    full width), slot 2 without an expert adapter."""
    from types import SimpleNamespace

    from loraplex.engine.models.moe import Experts

    spec = SimpleNamespace(num_experts=8, hidden_size=16, moe_intermediate_size=8,
                           expert_bias=False, swiglu_limit=None, swiglu_alpha=None)  # fmt: skip
    ex = Experts(spec)
    e, h, i, r, s = 8, 16, 8, 4, 3
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=gen) / 4)
        ex.down_proj.copy_(torch.randn(e, h, i, generator=gen) / 3)
    shapes = dict(a=(s, e, 2 * r, h), b=(s, e, 2 * r, 2 * i), da=(s, e, r, i), db=(s, e, r, h))
    t = {k: torch.randn(*shape, generator=gen) / 3 for k, shape in shapes.items()}
    for k in t:
        t[k][2] = 0  # slot 2: none
    t["a"][0, :, r:] = 0  # slot 0: gate|up width r
    t["b"][0, :, r:] = 0
    ex.lora_gate_up_a, ex.lora_gate_up_b = t["a"], t["b"]
    ex.lora_down_a, ex.lora_down_b = t["da"], t["db"]
    ex.lora_gate_up_widths, ex.lora_down_widths = [r, 2 * r, 0], [r, r, 0]
    ex.lora_widths = [2 * r, 3 * r, 0]
    return ex, t


def _experts_by_hand(ex, t, x, experts, weights, slots):
    out = torch.zeros_like(x, dtype=torch.float64)
    for tok in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e, s, xt = int(experts[tok, k]), int(slots[tok]), x[tok].double()
            h = ex.gate_up_proj[e].double() @ xt
            if s >= 0:
                h += t["b"][s, e].double().T @ (t["a"][s, e].double() @ xt)
            g, u = h.chunk(2)
            a = torch.nn.functional.silu(g) * u
            y = ex.down_proj[e].double() @ a
            if s >= 0:
                y += t["db"][s, e].double().T @ (t["da"][s, e].double() @ a)
            out[tok] += weights[tok, k].double() * y
    return out


@pytest.mark.parametrize(
    "tokens, order",
    [(6, [0, 1, -1, 2, 0, 1]), (6, [1, 0, 0, 1, 1, 0]), (40, [0, 1, -1, 2, 0, 1])],
    ids=["decode", "decode-all-adapted", "prefill"],
)
def test_expert_lora_per_row_and_grouped_forms_agree(tokens, order, monkeypatch):
    """The CPU's two forms of expert LoRA (engine/models/moe.py: each row reading its own A
    and B, or rows sorted by virtual expert through grouped matmuls) and the reference
    kernels give the same layer output as the sums by hand, rows without an adapter too."""
    from loraplex.engine.forward_context import LoRABatch
    from loraplex.engine.models import moe as moe_mod
    from loraplex.engine.step.step_plan import row_slots
    from loraplex.kernels import cpu_moe
    from loraplex.kernels.backend import KernelBackend

    gen = torch.Generator().manual_seed(7)
    ex, t = _experts_layer(gen)
    x = torch.randn(tokens, 16, generator=gen)
    experts = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
    per = tokens // 6 + 1
    segments = [(j * per, min(tokens, (j + 1) * per), slot)
                for j, slot in enumerate(order) if j * per < tokens]  # fmt: skip
    slots = row_slots(segments, tokens, "cpu")
    # as the step planner plans it: each row's slot, and the slots with expert adapters
    has = torch.tensor([w > 0 for w in ex.lora_widths])
    lora = LoRABatch(segments, row_slots=slots, expert_slots={tuple(ex.lora_widths): has})
    want = _experts_by_hand(ex, t, x, experts, weights, slots)
    calls, rows_form = [], cpu_moe.grouped_lora_rows
    monkeypatch.setattr(cpu_moe, "grouped_lora_rows", lambda *a: calls.append(1) or rows_form(*a))
    got = {"auto": ex(x, experts, weights, lora)}
    per_row = bool(calls)
    monkeypatch.setattr(moe_mod, "_ROWS_PER_VIRTUAL", 0)  # grouped whatever the rows
    got["grouped"] = ex(x, experts, weights, lora)
    ex.backend = KernelBackend(mode="reference")
    got["reference"] = ex(x, experts, weights, lora)
    # a decode step's rows are about one per virtual expert: the per-row form; a prompt's
    # rows share their virtual experts: the grouped one
    assert per_row == (tokens == 6)
    for name, y in got.items():
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wa, width", [(16, 8), (8, 8), (12, 8), (4, 2), (6, 4), (32, 16)])
def test_grouped_lora_rows(dtype, wa, width):
    """kernels/cpu_moe.grouped_lora_rows against each row's own matmuls: A^T read in place or
    copied per row (narrow), split at the width or whole (a width that does not divide it)."""
    from loraplex.kernels import cpu_moe

    gen = torch.Generator().manual_seed(3)
    g, p, k, n = 12, 9, 16, 24
    a_t = torch.randn(g, k, wa, generator=gen)
    b = torch.randn(g, wa, n, generator=gen)
    a_t[:, :, width:], b[:, width:] = 0, 0
    x = torch.randn(p, k, generator=gen)
    group = torch.randint(0, g, (p,), generator=gen)
    want = torch.stack([x[i].double() @ a_t[j].double() @ b[j].double()
                        for i, j in enumerate(group.tolist())])  # fmt: skip
    got = cpu_moe.grouped_lora_rows(x.to(dtype), a_t.to(dtype), b.to(dtype), group, width)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)
