"""The model runner: how a scheduler step becomes the forward pass's tensors and context, and
that the per-step plans are built once per step for every layer."""

from __future__ import annotations

import pytest

from loraplex.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams


@pytest.fixture
def engine(tiny_models):
    return LLMEngine(
        EngineConfig(
            str(tiny_models["llama"]), dtype="float32", max_loras=2, max_lora_rank=8,
            block_size=8, max_num_batched_tokens=64,
        )
    )  # fmt: skip


def _captured_steps(engine, monkeypatch) -> list:
    steps = []
    real = engine.runner.prepare

    def prepare(out, slots):
        batch = real(out, slots)
        steps.append((out, dict(slots), batch))
        return batch

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    return steps


def _run(engine, tiny_adapters, prompts_and_loras, max_tokens=5):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(prompts_and_loras):
        engine.add_request(f"r{i}", prompt, params, lora)
    while engine.has_unfinished():
        engine.step()


def test_rows_are_grouped_by_adapter_slot_with_their_kv_slots(engine, tiny_adapters, monkeypatch):
    adapters = tiny_adapters["llama"]
    a = LoRARequest("qv4", 1, str(adapters["qv4"]))
    b = LoRARequest("attn8", 2, str(adapters["attn8"]))
    steps = _captured_steps(engine, monkeypatch)
    prompts = [[5, 17, 99, 3, 42, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44], [7, 7], [60, 61, 62]]
    _run(engine, tiny_adapters, list(zip(prompts, [a, None, b, a, None], strict=True)))
    assert len(steps) >= 5
    bs = engine.config.block_size
    for out, slots, batch in steps:
        seqs, attn = batch.seqs, batch.ctx.attn
        assert sorted(s.seq_no for s in seqs) == sorted(s.seq_no for s in out.seqs)
        order = [slots.get(s.adapter_id, -1) for s in seqs]
        assert order == sorted(order)  # one contiguous run of rows per adapter slot
        qsl = attn.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == batch.input_ids.numel() == batch.positions.numel()
        segments = batch.ctx.lora.segments if batch.ctx.lora else [(0, qsl[-1], -1)]
        assert segments[0][0] == 0 and segments[-1][1] == qsl[-1]
        pairs = zip(segments, segments[1:], strict=False)
        assert all(x[1] == y[0] and x[2] < y[2] for x, y in pairs)
        for i in range(len(seqs)):
            rows = range(qsl[i], qsl[i + 1])
            owner = [slot for s, e, slot in segments if s <= rows[0] < e]
            assert owner == [order[i]]
            positions = batch.positions[qsl[i] : qsl[i + 1]].tolist()
            assert positions == list(range(attn.seq_lens[i] - len(rows), attn.seq_lens[i]))
            table = attn.block_tables[i].tolist()
            want = [table[p // bs] * bs + p % bs for p in positions]
            assert attn.slot_mapping[qsl[i] : qsl[i + 1]].tolist() == want
        # The LM head reads the last row of each sequence that completes its tokens.
        assert batch.sample_rows == [
            qsl[i + 1] - 1 for i in range(len(seqs)) if out.samples(out.seqs.index(seqs[i]))
        ]


@pytest.mark.parametrize("mode", ["auto", "triton"])
def test_per_step_plans_are_built_once_for_all_layers(tiny_models, tiny_adapters, monkeypatch,
                                                      mode):  # fmt: skip
    """Decode steps of a mixed batch, on the CPU backend and on Triton's (the interpreter
    here): the step planner builds one attention plan per step (every layer shares it) and one
    LoRA plan per distinct width set (q|k|v, o, gate|up, down differ) before the forward, each
    a typed dataclass; every layer's op gets the step's plan, and nothing inside the forward
    builds one."""
    from loraplex.kernels import cpu_plan, paged_attention, sgmv
    from loraplex.kernels.backend import KernelBackend
    from loraplex.kernels.plans import SGMVMeta, TritonAttentionPlan

    engine = LLMEngine(
        EngineConfig(
            str(tiny_models["llama"]), dtype="float32", max_loras=2, max_lora_rank=8,
            block_size=8, max_num_batched_tokens=64, kernel_mode=mode,
        )
    )  # fmt: skip
    attn_type, lora_type = {
        "auto": (cpu_plan.CPUAttentionPlan, cpu_plan.CPULoRAPlan),
        "triton": (TritonAttentionPlan, SGMVMeta),
    }[mode]
    adapters = tiny_adapters["llama"]
    loras = [LoRARequest("qv4", 1, str(adapters["qv4"])), None,
             LoRARequest("attn8", 2, str(adapters["attn8"]))]  # fmt: skip
    planning, step_plans, lora_plans, builds, outside, applies = [], [], [], [], [], []

    def planner(name, store):
        real = getattr(KernelBackend, name)

        def plan(self, *a, **k):
            planning.append(1)
            try:
                out = real(self, *a, **k)
            finally:
                planning.pop()
            store.append((a, out))
            return out

        monkeypatch.setattr(KernelBackend, name, plan)

    planner("plan_attention", step_plans)
    planner("plan_lora", lora_plans)
    for module, name in ((cpu_plan, "decode_group"), (cpu_plan, "plan_lora"),
                         (paged_attention, "plan_attention"), (sgmv, "build_meta")):  # fmt: skip
        real = getattr(module, name)

        def build(*a, _real=real, _name=name, **k):
            (builds if planning else outside).append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(module, name, build)
    real_apply, real_attention = KernelBackend.lora_apply, KernelBackend.paged_attention

    def lora_apply(self, *a, plan=None, **k):
        applies.append(1)
        assert isinstance(plan, lora_type) or not any(s >= 0 and a[5][s] for *_, s in a[4])
        return real_apply(self, *a, plan=plan, **k)

    def attention(self, *a, plan=None, **k):
        assert isinstance(plan, attn_type)
        return real_attention(self, *a, plan=plan, **k)

    monkeypatch.setattr(KernelBackend, "lora_apply", lora_apply)
    monkeypatch.setattr(KernelBackend, "paged_attention", attention)
    steps = _captured_steps(engine, monkeypatch)
    _run(engine, tiny_adapters, [([5, 17, 99], lo) for lo in loras], max_tokens=4)
    layers = len(engine.model.model.layers)
    assert layers > 1 and len(steps) >= 4
    assert outside == [] and builds  # every plan was built by the planner, none in a forward
    assert len(step_plans) == len(steps)  # one attention plan per step, for every layer
    assert all(isinstance(p, attn_type) for _, p in step_plans)
    # A LoRA plan once per step and width set (module kinds with the same widths share one).
    width_sets = len({tuple(a[1]) for a, _ in lora_plans})
    assert 1 < width_sets <= 4 and len(lora_plans) == len(steps) * width_sets
    # Every LoRA module (4 per layer) of every layer applies its step's plan.
    assert len(applies) == len(steps) * layers * 4
