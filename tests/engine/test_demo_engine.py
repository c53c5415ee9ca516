"""The real demo model (Gemma 3 270M): our engine's greedy text equals transformers'."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def test_greedy_continuation_equals_transformers(demo_model_dir):
    from transformers import Gemma3ForCausalLM

    llm = LLM(str(demo_model_dir), dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)
    del llm
    hf = Gemma3ForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        ref_ids = ref[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == ref_ids, (out.outputs[0].text, tok.decode(ref_ids))
        assert out.outputs[0].text == tok.decode(ref_ids)
    assert "Paris" in ours[0].outputs[0].text or "France" in ours[0].outputs[0].text
