"""The model runner: how a scheduler step becomes the forward pass's tensors and context, and
that the per-step plans are built once per step for every layer."""

from __future__ import annotations

import pytest

from loraplex.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from loraplex.kernels import cpu


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


def test_per_step_plans_are_built_once_for_all_layers(engine, tiny_adapters, monkeypatch):
    """Decode steps of a mixed batch: the runner builds one decode plan per step (every layer
    shares it) and one LoRA plan per distinct width set (q|k|v, o, gate|up, down differ)
    before the forward; no layer builds one."""
    adapters = tiny_adapters["llama"]
    loras = [LoRARequest("qv4", 1, str(adapters["qv4"])), None,
             LoRARequest("attn8", 2, str(adapters["attn8"]))]  # fmt: skip
    plans, groups, applies = [], [], []
    real_plan, real_groups, real_apply = cpu._DecodePlan, cpu.plan_lora, cpu.lora_apply
    monkeypatch.setattr(cpu, "_DecodePlan", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(cpu, "plan_lora", lambda *a: groups.append(a[1]) or real_groups(*a))

    def lora_apply(*a, **kw):
        applies.append(1)
        assert kw.get("plan") is not None or not any(s >= 0 for *_, s in a[4])  # planned
        return real_apply(*a, **kw)

    monkeypatch.setattr(cpu, "lora_apply", lora_apply)
    steps = _captured_steps(engine, monkeypatch)
    _run(engine, tiny_adapters, [([5, 17, 99], lo) for lo in loras], max_tokens=4)
    layers = len(engine.model.model.layers)
    assert layers > 1 and len(steps) >= 4
    assert len(plans) == 2 * len(steps)  # each step's plan holds both query groups
    # Every LoRA module (4 per layer) of every layer calls lora_apply; a plan is built once
    # per step and width set (module kinds with the same widths share one).
    width_sets = len({tuple(w) for w in groups})
    assert 1 < width_sets <= 4 and len(groups) == len(steps) * width_sets
    assert len(applies) == len(steps) * layers * 4
