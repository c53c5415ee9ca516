"""The transformers+peft baseline server decodes what transformers' own generate decodes."""

from __future__ import annotations

import asyncio

import torch
import transformers
from peft import PeftModel

from benchmarks.peers.hf_server import Generator, Job


def reference(model_dir, adapter_dir, prompt: list[int], n: int) -> list[int]:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_left_padded_batch_matches_generate_per_prompt(tiny_models, tiny_adapters):
    model_dir, adapter_dir = tiny_models["llama"], tiny_adapters["llama"]["attn8"]
    gen = Generator(model_dir, {"attn8": adapter_dir}, "float32", max_batch=4)
    loop = asyncio.new_event_loop()
    prompts = [[11, 42, 7, 99, 5, 300, 17], [250, 3, 64]]  # different lengths: left padding
    jobs = [Job(p, n, "attn8", loop) for p, n in zip(prompts, (6, 4), strict=True)]
    gen._run(jobs)  # one batch, as the worker would run it

    async def drain(job: Job) -> list[int]:
        out = []
        while (t := await job.out.get()) is not None:
            out.append(t)
        return out

    got = [loop.run_until_complete(drain(j)) for j in jobs]
    loop.close()
    assert [len(g) for g in got] == [6, 4]  # each stops at its own max_tokens
    for p, g in zip(prompts, got, strict=True):
        assert g == reference(model_dir, adapter_dir, p, len(g))
