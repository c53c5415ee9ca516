"""The transformers + peft reference the engine is compared against, in float32.

One `PeftModel` per (base, adapter set), built once per process: every adapter is loaded into
it under its name and a row picks one with `active_adapter` (None: the base model alone).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

_MODELS: dict[tuple, PeftModel] = {}


def peft_reference(base: Path, adapters: dict[str, Path]) -> PeftModel:
    """`base` with every adapter of `adapters` (name -> folder) loaded, in eval mode."""
    key = (str(base), tuple((name, str(path)) for name, path in adapters.items()))
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        names = list(adapters)
        peft = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            peft.load_adapter(adapters[name], adapter_name=name)
        _MODELS[key] = peft.eval()
    return _MODELS[key]


@contextmanager
def active_adapter(peft: PeftModel, name: str | None) -> Iterator[PeftModel]:
    """Run the block with adapter `name` active, or with no adapter at all for None."""
    if name is None:
        with peft.disable_adapter():
            yield peft
    else:
        peft.set_adapter(name)
        yield peft


@torch.no_grad()
def greedy_decode(peft: PeftModel, prompt: list[int], name: str | None, steps: int) -> dict:
    """Greedy decoding with HF's KV cache: the prompt's logits, `steps` logits and tokens.

    Returns {"prefill": [len(prompt), vocab], "logits": steps x [vocab], "tokens": steps ids};
    logits[i] is the distribution tokens[i] was taken from.
    """
    with active_adapter(peft, name):
        out = peft(input_ids=torch.tensor([prompt]), use_cache=True)
        prefill = out.logits[0]
        past, logits, tokens = out.past_key_values, [prefill[-1]], []
        for _ in range(steps):
            tok = int(logits[-1].argmax())
            tokens.append(tok)
            out = peft(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
    return {"prefill": prefill, "logits": logits[:steps], "tokens": tokens}


@torch.no_grad()
def teacher_forced_logprobs(
    peft: PeftModel, prompt: list[int], output: list[int], name: str | None
) -> torch.Tensor:
    """Log-probabilities of each output position given the prompt and the output before it.

    One forward pass over prompt + output: row i is the distribution output[i] was drawn
    from. Shape [len(output), vocab]. If every output[i] is its row's argmax, `output` is
    exactly the greedy continuation of `prompt`.
    """
    ids = list(prompt) + list(output)
    with active_adapter(peft, name):
        logits = peft(input_ids=torch.tensor([ids])).logits[0]  # [len(ids), vocab]
    return torch.log_softmax(logits[len(prompt) - 1 : len(ids) - 1].float(), dim=-1)


@torch.no_grad()
def prompt_log_softmax(peft: PeftModel, prompt: list[int], name: str | None) -> torch.Tensor:
    """The float32 log-softmax of the prompt's own rows: row i is the distribution of
    prompt[i + 1] given prompt[: i + 1]. Shape [len(prompt) - 1, vocab]."""
    with active_adapter(peft, name):
        logits = peft(input_ids=torch.tensor([prompt])).logits[0]  # [len(prompt), vocab]
    return torch.log_softmax(logits[:-1].float(), dim=-1)
