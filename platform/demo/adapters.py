"""The demo adapters `loraplex serve` registers for the demo tenant, trained here once.

There is no model hub to download adapters from, so we make two small real ones: LoRA rank 8
on the attention and MLP projections of the last layers of the demo model, trained with
transformers on `data.EXAMPLES` for a few dozen steps (about a minute each on a laptop-class
CPU), and written as `peft` writes them. The result is cached in the data dir.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from loraplex.platform.demo.data import EXAMPLES

# name -> the answer it learns, from (plain answer, pirate answer)
RECIPES: dict[str, Callable[[str, str], str]] = {
    "pirate": lambda plain, pirate: pirate,
    "shout": lambda plain, pirate: plain.upper(),
}
RANK, ALPHA = 8, 16
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def prepare_demo_adapters(
    model_dir: Path,
    out_dir: Path,
    *,
    steps: int = 40,
    last_layers: int = 6,
    progress: bool = True,
) -> dict[str, Path]:
    """PEFT folders of the demo adapters under `out_dir`, training the missing ones."""
    out_dir = Path(out_dir)
    folders = {name: out_dir / name for name in RECIPES}
    missing = [n for n, f in folders.items() if not (f / WEIGHTS).is_file()]
    if not missing:
        return folders
    model, tokenizer = _load(Path(model_dir))
    for i, name in enumerate(missing):
        pairs = [(q, RECIPES[name](plain, pirate)) for q, plain, pirate in EXAMPLES]
        tensors = train_lora(
            model,
            tokenizer,
            pairs,
            steps=steps,
            last_layers=last_layers,
            seed=i,
            desc=f"training demo adapter '{name}'" if progress else None,
        )
        _write_atomically(folders[name], tensors, Path(model_dir).name, last_layers, model)
    return folders


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex.engine import Tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    model.eval()  # no dropout: the LoRA is the only thing that changes
    return model, Tokenizer.from_dir(model_dir)


def _examples(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) in the server's plain chat format."""
    from loraplex.platform.serving import fallback_chat_prompt

    eos = min(tokenizer.eos_token_ids)
    out = []
    for question, answer in pairs:
        prompt = tokenizer.encode(fallback_chat_prompt([{"role": "user", "content": question}]))
        reply = tokenizer.encode(" " + answer, add_special_tokens=False) + [eos]
        out.append((prompt + reply, len(prompt)))
    return out


def train_lora(
    model,
    tokenizer,
    pairs: list[tuple[str, str]],
    *,
    steps: int,
    last_layers: int,
    seed: int = 0,
    batch_size: int = 8,
    lr: float = 2e-3,
    desc: str | None = None,
) -> dict[str, object]:
    """Train a fresh LoRA on the answers only; its PEFT-named tensors (A [r, in], B [out, r])."""
    import torch
    from tqdm import tqdm

    from loraplex.engine import PROJECTIONS  # every projection is a target

    torch.manual_seed(seed)
    rng = random.Random(seed)
    layers = model.model.layers
    first = len(layers) - last_layers
    scale = ALPHA / RANK
    params: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    hooks = []
    for i in range(first, len(layers)):
        for path, module in layers[i].named_modules():
            if path.rsplit(".", 1)[-1] not in PROJECTIONS:
                continue
            a = torch.nn.Parameter(
                torch.randn(RANK, module.in_features) / math.sqrt(module.in_features)
            )
            b = torch.nn.Parameter(torch.zeros(module.out_features, RANK))
            params[f"base_model.model.model.layers.{i}.{path}"] = (a, b)

            def hook(mod, inputs, output, a=a, b=b):
                return output + (inputs[0] @ a.T) @ b.T * scale

            hooks.append(module.register_forward_hook(hook))
    opt = torch.optim.AdamW([p for ab in params.values() for p in ab], lr=lr, weight_decay=0.0)
    data = _examples(tokenizer, pairs)
    inputs = _hidden_before(model, first, [seq for seq, _ in data])
    head = model.get_output_embeddings()
    top = model.model
    all_layers = top.layers
    top.layers = all_layers[first:]  # the frozen layers below ran once, in _hidden_before
    bar = tqdm(range(steps), desc=desc, unit="step", disable=desc is None)
    try:
        for _ in bar:
            batch = rng.sample(range(len(data)), min(batch_size, len(data)))
            width = max(len(data[j][0]) for j in batch)
            embeds = torch.zeros(len(batch), width, inputs[0].shape[-1])
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            rows, cols, targets = [], [], []
            for r, j in enumerate(batch):
                seq, start = data[j]
                embeds[r, : len(seq)] = inputs[j]
                mask[r, : len(seq)] = 1
                for c in range(start - 1, len(seq) - 1):  # position c predicts token c + 1
                    rows.append(r)
                    cols.append(c)
                    targets.append(seq[c + 1])
            hidden = top(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
            # The LM head only where the loss is: it is the biggest matmul of this model.
            logits = head(hidden[rows, cols])
            loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets))
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    finally:
        top.layers = all_layers
        for h in hooks:
            h.remove()
    out = {}
    for name, (a, b) in params.items():
        out[f"{name}.lora_A.weight"] = a.detach().to(torch.bfloat16).contiguous()
        out[f"{name}.lora_B.weight"] = b.detach().to(torch.bfloat16).contiguous()
    return out


def _hidden_before(model, layer: int, seqs: list[list[int]]) -> list[object]:
    """Each sequence's hidden states entering `layer` (frozen below it, so computed once)."""
    import torch

    captured = []

    def grab(mod, args, kwargs):
        captured.append((args[0] if args else kwargs["hidden_states"]).detach())
        raise _Stop

    handle = model.model.layers[layer].register_forward_pre_hook(grab, with_kwargs=True)
    out = []
    try:
        with torch.no_grad():
            for seq in seqs:  # one at a time: no padding to get wrong
                with contextlib.suppress(_Stop):
                    model.model(input_ids=torch.tensor([seq]))
                out.append(captured.pop()[0])
    finally:
        handle.remove()
    return out


class _Stop(Exception):
    """Ends a forward pass once the hidden states we need are captured."""


def _write_atomically(folder: Path, tensors, base_name: str, last_layers: int, model) -> None:
    from safetensors.torch import save_file

    from loraplex.engine import PROJECTIONS

    n = len(model.model.layers)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(PROJECTIONS),
        "layers_to_transform": list(range(n - last_layers, n)),
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
