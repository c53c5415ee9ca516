"""enable_lora=False: the base model alone. The same tokens and log-probabilities as an engine
with LoRA on gives rows without an adapter, no adapter slots (their memory goes to the KV
cache, and no module holds a LoRA stack), and a request naming an adapter refused before
anything is queued."""

from __future__ import annotations

import pytest

from loraplex.engine import LLM, BadRequestError, LoRARequest, SamplingParams
from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.moe import Experts
from tests.utils.outputs import assert_same_outputs

PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 8], [100, 200, 300, 400, 12, 13, 14]]
BUDGET = 32 << 20  # KV cache and adapter slots together


def _llm(model, **options) -> LLM:
    return LLM(str(model), **{"dtype": "float32", "kv_cache_bytes": BUDGET, "max_model_len": 64,
                              **options})  # fmt: skip


def test_lora_off_serves_the_base_model_alone(tiny_models, tiny_adapters):
    probe = _llm(tiny_models["llama"])
    block = probe.engine.memory.kv_cache_bytes / probe.engine.runner.num_blocks
    # a budget of the slots and 40 blocks: with LoRA off the slots' share becomes blocks too
    budget = int(probe.engine.memory.adapter_slot_bytes + 40 * block)
    probe.engine.adapters.close()
    on = _llm(tiny_models["llama"], kv_cache_bytes=budget)
    off = _llm(tiny_models["llama"], kv_cache_bytes=budget, enable_lora=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        assert_same_outputs(off.generate(PROMPTS, params), on.generate(PROMPTS, params), 1e-5)
        lora_modules = [m for m in off.engine.model.modules() if isinstance(m, LoRALinear)]
        assert lora_modules and all(m.lora_a is None for m in lora_modules)
        assert off.engine.memory.adapter_slot_bytes == 0 < on.engine.memory.adapter_slot_bytes
        assert off.engine.memory.adapter_slots == 0
        assert off.engine.runner.num_blocks > on.engine.runner.num_blocks >= 40

        lora = LoRARequest("qv4", 1, str(tiny_adapters["llama"]["qv4"]))
        with pytest.raises(BadRequestError, match="enable_lora") as e:
            off.engine.add_request("with-adapter", PROMPTS[0], params, lora)
        assert e.value.param == "model"
        assert "with-adapter" not in off.engine.requests and not off.engine.has_unfinished()
        # the engine goes on serving
        assert off.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    finally:
        on.engine.adapters.close()
        off.engine.adapters.close()


def test_lora_off_on_a_mixture_of_experts_keeps_no_expert_stacks(tmp_path):
    from testkit.factories import make_tiny_model

    model = make_tiny_model("qwen3_moe", tmp_path / "moe", num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=16, mlp_only_layers=[])  # fmt: skip
    off = _llm(model, enable_lora=False)
    try:
        experts = [m for m in off.engine.model.modules() if isinstance(m, Experts)]
        assert experts and all(ex.lora_gate_up_a is None for ex in experts)
        assert off.engine.adapters.expert_slot_bytes() == 0
        out = off.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    finally:
        off.engine.adapters.close()
