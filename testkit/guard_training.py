"""A tiny guard adapter trained in the test: LoRA on a tiny base that answers the guard
prompt (platform/guardrails/guard.py) with " unsafe" when the text holds one of `MARKERS`,
else " safe". "tea" is what the tiny Llama (seed 0) says to "The sky", so an output guard has
something to catch. Seconds on a CPU: the base has two layers of width 64."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from loraplex.engine import Tokenizer
from loraplex.platform.guardrails.guard import guard_prompt_ids, verdict_tokens

MARKER = "zqxv"
MARKERS = (MARKER, "tea")
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "home",
         "red", "blue", "sky", "tree", "over", "under", "water", "stone"]  # fmt: skip


def sample_text(rng: random.Random, unsafe: bool) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    if unsafe:
        words.insert(rng.randint(0, len(words)), rng.choice(MARKERS))
    return " ".join(words)


def train_guard(base_dir: Path, out_dir: Path, *, steps: int = 40, seed: int = 0) -> Path:
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = Tokenizer.from_dir(base_dir)
    safe, unsafe = verdict_tokens(tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")  # fmt: skip
    peft = get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    classes = torch.tensor([safe, unsafe])
    for _ in range(steps):
        labels = [rng.random() < 0.5 for _ in range(16)]
        prompts = [guard_prompt_ids(tok, sample_text(rng, u), 200) for u in labels]
        width = max(map(len, prompts))
        # Left padding: every prompt's verdict position is the last column.
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        logits = peft(input_ids=ids, attention_mask=mask).logits[:, -1, :]
        loss = torch.nn.functional.cross_entropy(logits[:, classes], torch.tensor(labels).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    peft.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
