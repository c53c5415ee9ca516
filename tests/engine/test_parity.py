"""The engine against transformers + peft on the same weights (float32).

One batch mixes four adapters (different ranks, target sets, rslora) with rows that have no
adapter. Prefill logits, 16 decode steps of logits and 32 greedy tokens must match per row,
also under chunked prefill, preemption, prefix-cache hits and fewer adapter slots than
adapters in flight; and DoRA adapters beside a plain LoRA one and rows without an adapter.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from testkit.dora import make_dora_adapter
from tests.utils.hf_reference import greedy_decode, peft_reference

STEPS, LOGIT_STEPS = 32, 16
ROW_ADAPTERS = ["qv4", None, "attn8", "mlp16", None, "all2", "attn8"]
TOL = dict(rtol=1e-4, atol=1e-4)


def _prompts(n: int = len(ROW_ADAPTERS)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(5, 500, (20,), generator=g).tolist()  # shared across adapters
    return [prefix + torch.randint(5, 500, (1 + 2 * i,), generator=g).tolist() for i in range(n)]


def hf_reference(base, adapters, rows=ROW_ADAPTERS, same_as=None) -> list[dict]:
    """transformers + peft greedy runs for `rows` (adapter names); `same_as` maps an adapter
    peft cannot load to one it can that holds the same weights."""
    same_as = same_as or {}
    peft = peft_reference(base, {n: p for n, p in adapters.items() if n not in same_as})
    return [
        greedy_decode(peft, prompt, same_as.get(name, name), STEPS)
        for prompt, name in zip(_prompts(len(rows)), rows, strict=True)
    ]


_REF_CACHE: dict[str, list[dict]] = {}


@pytest.fixture
def reference(parity_models, parity_adapters):
    def get(kind: str) -> list[dict]:
        if kind not in _REF_CACHE:
            _REF_CACHE[kind] = hf_reference(parity_models[kind], parity_adapters[kind])
        return _REF_CACHE[kind]

    return get


def run_rows(llm: LLM, adapters: dict, prompts=None, rows=ROW_ADAPTERS):
    """Generate greedily; return per row (tokens, sampled logits per step, full prefill logits)."""
    runner = llm.engine.runner
    model = runner.model
    sampled: dict[str, list[torch.Tensor]] = {}
    prefill: dict[str, torch.Tensor] = {}
    state = {}
    orig_prepare, orig_logits, orig_forward = runner.prepare, model.compute_logits, model.forward

    def prepare(out, slots):
        state["batch"] = orig_prepare(out, slots)
        return state["batch"]

    def forward(input_ids, positions, ctx):
        hidden = orig_forward(input_ids, positions, ctx)
        qsl = ctx.attn.query_start_loc
        for j, seq in enumerate(state["batch"].seqs):
            n = qsl[j + 1] - qsl[j]
            if positions[qsl[j]] == 0 and n == seq.num_prompt_tokens:
                prefill[seq.request_id] = orig_logits(hidden[qsl[j] : qsl[j + 1]])
        return hidden

    def compute_logits(hidden):
        logits = orig_logits(hidden)
        for seq, row in zip(state["batch"].sample_seqs, logits, strict=True):
            sampled.setdefault(seq.request_id, []).append(row.clone())
        return logits

    runner.prepare, model.forward, model.compute_logits = prepare, forward, compute_logits
    try:
        loras = [
            None if a is None else LoRARequest(a, list(adapters).index(a) + 1, str(adapters[a]))
            for a in rows
        ]
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
        outs = llm.generate(prompts or _prompts(len(rows)), params, loras)
    finally:
        del runner.prepare, model.forward, model.compute_logits
    return [
        (o.outputs[0].token_ids, sampled[o.request_id], prefill.get(o.request_id)) for o in outs
    ]


def check_rows(rows, ref, full_prefill: bool = True, names=ROW_ADAPTERS):
    for i, ((tokens, logits, pre), r) in enumerate(zip(rows, ref, strict=True)):
        assert tokens == r["tokens"], f"row {i} ({names[i]}): greedy tokens differ"
        assert len(logits) == STEPS
        for step in range(LOGIT_STEPS):
            torch.testing.assert_close(
                logits[step],
                r["logits"][step],
                **TOL,
                msg=lambda m, i=i, step=step: f"row {i} step {step}: {m}",
            )
        if full_prefill:
            assert pre is not None
            torch.testing.assert_close(pre, r["prefill"], **TOL)


# qwen3 (q/k norms), qwen3_yarn, phi3 (fused checkpoint and adapter modules, partial rotary),
# phi3_longrope and llama3 (Llama 3.2: llama3 RoPE, tied embeddings): testkit/factories.py
FAMILIES = ["llama", "qwen2", "gemma3", "mistral",
            "qwen3", "qwen3_yarn", "phi3", "phi3_longrope", "llama3"]  # fmt: skip
# LongRoPE is served up to its original context (engine/weights/loader.py)
LLM_ARGS = {"phi3_longrope": {"max_model_len": 128}}


@pytest.mark.parametrize("kind", FAMILIES)
def test_mixed_adapter_batch_matches_hf_peft(kind, parity_models, parity_adapters, reference):
    llm = LLM(str(parity_models[kind]), dtype="float32", max_loras=4, max_lora_rank=16,
              **LLM_ARGS.get(kind, {}))  # fmt: skip
    check_rows(run_rows(llm, parity_adapters[kind]), reference(kind))
    # Every block is free again or only held by the prefix cache (ref count 0).
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_chunked_prefill_same_outputs(kind, tiny_models, tiny_adapters, reference):
    llm = LLM(
        str(tiny_models[kind]),
        dtype="float32",
        max_loras=4,
        max_lora_rank=16,
        max_num_batched_tokens=7,
    )
    check_rows(run_rows(llm, tiny_adapters[kind]), reference(kind), full_prefill=False)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_preemption_same_outputs(kind, tiny_models, tiny_adapters, reference):
    llm = LLM(
        str(tiny_models[kind]),
        dtype="float32",
        max_loras=4,
        max_lora_rank=16,
        max_model_len=80,
        num_kv_blocks=10,
        block_size=8,
    )
    rows = run_rows(llm, tiny_adapters[kind])
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool should force preemption"
    check_rows(rows, reference(kind), full_prefill=False)
    assert llm.engine.block_manager.num_free_blocks == 10


@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_prefix_cache_hits_same_outputs(kind, tiny_models, tiny_adapters, reference):
    llm = LLM(str(tiny_models[kind]), dtype="float32", max_loras=4, max_lora_rank=16, block_size=8)
    check_rows(run_rows(llm, tiny_adapters[kind]), reference(kind))
    queries = llm.engine.block_manager.prefix_hits
    rows = run_rows(llm, tiny_adapters[kind])  # same prompts again: served from the cache
    assert llm.engine.block_manager.prefix_hits > queries
    check_rows(rows, reference(kind), full_prefill=False)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_fewer_slots_than_adapters(kind, tiny_models, tiny_adapters, reference):
    llm = LLM(str(tiny_models[kind]), dtype="float32", max_loras=2, max_lora_rank=16)
    check_rows(run_rows(llm, tiny_adapters[kind]), reference(kind))
    # Four adapters went through two slots, so slots were reused.
    assert len(llm.engine.adapters.slots) == 2 and llm.engine.adapters.slot_writes == 4


def test_sharded_checkpoint_loads(tiny_models):
    files = list(tiny_models["qwen2"].glob("*.safetensors"))
    assert len(files) > 1 and (tiny_models["qwen2"] / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_rows_without_adapter_are_exact_when_all_slots_are_taken(
    attention, tiny_models, tiny_adapters
):
    """LoRA must not leak into rows without an adapter: bitwise, not approximately. Both CPU
    attention forms (`auto` picks one by timing, and on some CPUs they time alike); prefix
    caching off: the plain run would find row 0's first block cached by the mixed run and
    compute only the rest of its prompt, which sdpa rounds differently (not LoRA's doing)."""
    adapters = tiny_adapters["llama"]
    prompts = _prompts()[:5]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    loras = [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_loras=4, max_lora_rank=16,
              cpu_attention=attention, enable_prefix_caching=False)  # fmt: skip
    # The adapter-less row goes first in both runs: a GEMM may round a row differently
    # depending on its position in the batch, which is not what this test is about.
    mixed = llm.generate(prompts, params, [None] + loras)
    assert all(s is not None for s in llm.engine.adapters.slots)  # every slot is taken
    plain = llm.generate(prompts, params, [None] * 5)
    assert mixed[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert mixed[0].outputs[0].logprobs == plain[0].outputs[0].logprobs  # bitwise equal
    assert mixed[1].outputs[0].logprobs != plain[1].outputs[0].logprobs  # adapters do act


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32(dtype, tiny_models, tiny_adapters):
    adapters = tiny_adapters["llama"]
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    lora = [LoRARequest("attn8", 2, str(adapters["attn8"])), None]
    ref = LLM(str(tiny_models["llama"]), dtype="float32").generate(prompts, params, lora)
    half_llm = LLM(str(tiny_models["llama"]), dtype=dtype, cpu_float32_compute=False)
    assert half_llm.engine.model.lm_head.weight.dtype != torch.float32
    half = half_llm.generate(prompts, params, lora)
    assert half[0].outputs[0].token_ids  # ran end to end in half precision
    for r, h in zip(ref, half, strict=True):
        top_r, top_h = r.outputs[0].logprobs[0], h.outputs[0].logprobs[0]
        common = set(top_r) & set(top_h)
        assert len(common) >= 15
        for t in common:
            assert abs(top_r[t] - top_h[t]) < 0.1


DORA_ROWS = ["dqv", "qv4", None, "dall", "dqv"]
DORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def dora_adapters(parity_models, parity_adapters, tmp_path_factory):
    """kind -> two DoRA adapters (q/v rank 4 rsLoRA; every module rank 2) and plain qv4."""
    root = tmp_path_factory.mktemp("dora-parity")

    def get(kind: str) -> dict:
        base = parity_models[kind]
        return {
            "dqv": make_dora_adapter(base, root / kind / "dqv", seed=1, use_rslora=True),
            "dall": make_dora_adapter(
                base, root / kind / "dall", r=2, alpha=4, seed=2, targets=DORA_TARGETS
            ),  # fmt: skip
            "qv4": parity_adapters[kind]["qv4"],
        }

    return get


# llama; qwen2 (biased q|k|v: the bias stays unscaled); phi3 (DoRA on fused qkv_proj and
# gate_up_proj: each magnitude vector split over our slices)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "phi3"])
def test_dora_beside_lora_matches_hf_peft(kind, parity_models, dora_adapters):
    adapters = dora_adapters(kind)
    llm = LLM(str(parity_models[kind]), dtype="float32", max_loras=4, max_lora_rank=16)
    rows = run_rows(llm, adapters, rows=DORA_ROWS)
    check_rows(rows, hf_reference(parity_models[kind], adapters, DORA_ROWS), names=DORA_ROWS)
    assert llm.engine.adapters.dora_slots.count(True) == 2
