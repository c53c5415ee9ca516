"""How large trained LoRA weights are: the measurement behind the upload bound (issue 62).

    python -m benchmarks.adapter_magnitudes FOLDER...            # adapters already on disk
    python -m benchmarks.adapter_magnitudes --demo --peft-steps 60

For each PEFT adapter folder: the largest |value| of lora_A, of lora_B with lora_alpha / r
(or / sqrt(r) with rsLoRA) folded in, as the engine multiplies by them (`load_adapter`,
float32), its 99.9th percentile, and DoRA's magnitude vectors; then the margin to the upload
bound (`max_adapter_weight`, platform/uploads/validate.py). `--demo` adds the demo adapters
`loraplex serve` trains (platform/demo/adapters.py; trained here first if missing, minutes on
a CPU); `--peft-steps N` also trains a LoRA with peft itself on the demo model (rank 16, alpha
32, every projection of the last 6 layers, AdamW at lr 2e-3 on the demo examples, the high
end of usual LoRA rates) and measures it. Results print as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from benchmarks.assets import import_installed_kernels

CACHE = Path(__file__).resolve().parent / ".cache" / "adapter-magnitudes"


def measure(folder: Path, spec, max_rank: int = 256) -> dict[str, float]:
    from loraplex.engine import load_adapter

    adapter = load_adapter(folder, spec, max_rank, torch.float32)
    a = torch.cat([t.flatten() for t, _ in adapter.weights.values()])
    b = torch.cat([t.flatten() for _, t in adapter.weights.values()])
    m = [t.abs().max() for t in adapter.magnitudes.values()]
    return {
        "modules": len(adapter.weights),
        "max |A|": float(a.abs().max()),
        "max |B s|": float(b.abs().max()),
        "p99.9 |B s|": float(b.abs().float().quantile(0.999)) if b.numel() < 2**24 else -1.0,
        "max |m|": float(max(m)) if m else 0.0,
    }


def train_peft(model_dir: Path, out: Path, steps: int, seed: int = 0) -> Path:
    """A LoRA trained with peft's own modules on the demo examples (answers only)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraplex.engine import Tokenizer
    from loraplex.platform.demo.adapters import _examples
    from loraplex.platform.demo.data import EXAMPLES

    if (out / "adapter_model.safetensors").is_file():
        return out
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n = model.config.num_hidden_layers
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                        target_modules=targets, layers_to_transform=list(range(n - 6, n)),
                        task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, config)
    tokenizer = Tokenizer.from_dir(model_dir)
    data = _examples(tokenizer, [(q, pirate) for q, _, pirate in EXAMPLES])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for _ in range(steps):
        batch = rng.sample(data, min(8, len(data)))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (seq, start) in enumerate(batch):
            ids[r, : len(seq)] = torch.tensor(seq)
            labels[r, start : len(seq)] = torch.tensor(seq[start:])
            mask[r, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path)
    ap.add_argument("--demo", action="store_true", help="the demo model's trained adapters")
    ap.add_argument("--peft-steps", type=int, default=0, help="also train one with peft")
    ap.add_argument("--data-dir", type=Path, default=CACHE, help="where the demo lands")
    args = ap.parse_args()
    import_installed_kernels()  # before peft / transformers, from a checkout's root

    from loraplex.engine import prepare_demo, spec_from_config
    from loraplex.platform.uploads.validate import MAX_ADAPTER_WEIGHT

    folders = list(args.folders)
    demo_model = None
    if args.demo or args.peft_steps:
        demo_model = Path(prepare_demo(args.data_dir))
    if args.demo:
        from loraplex.platform.demo.adapters import prepare_demo_adapters

        folders += list(prepare_demo_adapters(demo_model, args.data_dir / "demo-adapters",
                                              progress=False).values())  # fmt: skip
    if args.peft_steps:
        folders.append(train_peft(demo_model, args.data_dir / "peft-trained", args.peft_steps))
    print(f"| adapter | modules | max abs A | max abs B*s | p99.9 abs B*s | max abs m | "
          f"bound / largest (bound {MAX_ADAPTER_WEIGHT:g}) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for folder in folders:
        cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
        base = cfg.get("base_model_name_or_path") or ""
        model_dir = demo_model if demo_model and "gemma" in base.lower() else None
        model_dir = model_dir or Path(base)
        spec = spec_from_config(json.loads((model_dir / "config.json").read_text()))
        s = measure(Path(folder), spec)
        top = max(s["max |A|"], s["max |B s|"], s["max |m|"])
        print(f"| {Path(folder).name} | {s['modules']} | {s['max |A|']:.3g} | "
              f"{s['max |B s|']:.3g} | {s['p99.9 |B s|']:.3g} | {s['max |m|']:.3g} | "
              f"{MAX_ADAPTER_WEIGHT / top:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
