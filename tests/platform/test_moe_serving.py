"""`loraplex serve --model <a Qwen3-MoE folder>` end to end (issue 35): the console script in
its own process, a tenant's expert adapter (PEFT `target_parameters` on the fused experts) and
attention-only adapter uploaded through `POST /v1/adapters`, then completions for both (and
the base) sent at once through the `openai` client. Every answer's tokens are transformers +
peft's greedy tokens on the same weights, each logprob within 1e-4 of theirs (float32 on both
sides); `/v1/models` lists the base and the adapters and names the base's family and its
experts."""

from __future__ import annotations

import asyncio
import json
import math
import signal

import httpx
import openai
import pytest
import torch

from loraplex.engine.models.spec import spec_from_config
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.platform.openai.logprobs import token_text
from loraplex.platform.uploads.validate import validate_adapter
from testkit.factories import make_adapter, make_tiny_model
from tests.platform.test_quickstart import Serve
from tests.utils.hf_reference import greedy_decode, peft_reference
from tests.utils.server import upload_adapter

STEPS = 6
TOL = 1e-4
# Token-id prompts, sent exactly as they are; each goes to every model.
PROMPTS = [[5, 88, 301, 17, 42, 260, 9], [400, 12, 77, 150], [33, 33, 210, 64, 480, 3, 91, 7]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A Qwen3-MoE base (8 experts, top 2, one dense layer) and two adapters for it."""
    root = tmp_path_factory.mktemp("moe-serving")
    base = make_tiny_model("qwen3_moe", root / "qwen3-moe-tiny", seed=81)
    adapters = {
        # experts (gate|up and down of every expert) and the query projection
        "experts": make_adapter(base, root / "experts", r=8, alpha=16, targets=("q_proj",),
                                target_parameters=("gate_up_proj", "down_proj"), seed=82),
        "attn": make_adapter(base, root / "attn", r=4, alpha=8, targets=("q_proj", "v_proj"),
                             seed=83),
    }  # fmt: skip
    return base, adapters


@pytest.fixture(scope="module")
def served(moe, tmp_path_factory):
    base, _ = moe
    data = tmp_path_factory.mktemp("moe-serve-data")
    # Rank 64 = the expert adapter's rank 8 x 8 experts: what upload validation takes for its
    # rank today (see test_upload_reads_an_expert_adapters_rank_per_expert below).
    env = {"LORAPLEX_DTYPE": "float32", "LORAPLEX_ENGINE_THREADS": "1",
           "LORAPLEX_MAX_LORA_RANK": "64", "LORAPLEX_MAX_LORAS": "2"}  # fmt: skip
    serve = Serve(data, "--model", str(base), "--max-model-len", "64", env=env)
    try:
        serve.wait_ready()
        yield serve
        serve.stop(signal.SIGTERM)
    finally:
        serve.close()


async def _complete_all(url: str, key: str, jobs: list[tuple[str, list[int]]]):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(
            client.completions.create(model=model, prompt=prompt, max_tokens=STEPS,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
            for model, prompt in jobs
        ))  # fmt: skip
    finally:
        await client.close()


def test_expert_and_attention_adapters_served_beside_each_other(moe, served):
    base, adapters = moe
    key = served.key()
    for name, folder in adapters.items():
        r = upload_adapter(served.url, key, name, folder)
        assert r.status_code == 201, r.text

    cards = httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    cards = {c["id"]: c for c in cards.json()["data"]}
    (base_id,) = [i for i, c in cards.items() if c["parent"] is None]
    assert set(cards) == {base_id, "experts", "attn"}
    assert cards["experts"]["parent"] == cards["attn"]["parent"] == base_id
    moe_arch = {"family": "qwen3_moe",
                "mixture_of_experts": {"num_experts": 8, "experts_per_token": 2}}  # fmt: skip
    assert all(c["architecture"] == moe_arch for c in cards.values())

    # Both adapters and the base in the same batches: every request sent at once.
    jobs = [(model, p) for p in PROMPTS for model in ("experts", "attn", base_id)]
    answers = asyncio.run(_complete_all(served.url, key, jobs))

    peft = peft_reference(base, adapters)
    tok = Tokenizer.from_dir(base)
    outputs = {}
    for (model, prompt), answer in zip(jobs, answers, strict=True):
        where = f"{model} on prompt {prompt}"
        ref = greedy_decode(peft, prompt, None if model == base_id else model, STEPS)
        (choice,) = answer.choices
        assert choice.finish_reason == "length", where
        assert answer.usage.completion_tokens == STEPS, where
        lp = choice.logprobs
        assert lp.tokens == [token_text(tok, t) for t in ref["tokens"]], where
        for step, (t, got) in enumerate(zip(ref["tokens"], lp.token_logprobs, strict=True)):
            want = float(torch.log_softmax(ref["logits"][step].float(), dim=-1)[t])
            assert math.isclose(got, want, abs_tol=TOL), f"{where} step {step}: {got} vs {want}"
        outputs[(model, tuple(prompt))] = ref["tokens"]
    # The adapters act: neither answers as the base does on every prompt.
    for model in ("experts", "attn"):
        assert any(outputs[(model, tuple(p))] != outputs[(base_id, tuple(p))] for p in PROMPTS)


def test_upload_reads_an_expert_adapters_rank_per_expert(moe):
    """An expert adapter of rank 8 on 8 experts is within a rank limit of 16."""
    base, adapters = moe
    spec = spec_from_config(json.loads((base / "config.json").read_text()))
    v = validate_adapter(adapters["experts"], spec, max_rank=16, base_model_name=base.name,
                         max_bytes=2**30)  # fmt: skip
    assert v.rank == 8
