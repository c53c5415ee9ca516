"""Benchmark models and adapters, built once and cached under benchmarks/.cache/ (in the
checkout, never in an installed package), and the folder results go to.

    benchmarks/.cache/
        tiny-llama/                    random Llama (docs/peers.md), bf16 + tokenizer.json
        adapters/<model>/a00 .. aNN/   PEFT LoRA adapters, r=8 on q/k/v/o, random non-zero A and B

Adapters are written as peft's `save_pretrained` writes them (`adapter_config.json` from
`peft.LoraConfig`, `adapter_model.safetensors` with `base_model.model.` keys) without loading
the base model, so making 16 adapters for the 270M demo takes a second, not minutes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file

from testkit.hf_kernels import import_installed_kernels  # the lab's modules import it from here

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_DIR = BENCH_DIR / "results"

# The peer comparisons' tiny Llama: hidden 512, 4 layers, 8 heads / 2 KV heads, vocab 32k, bf16;
# no FFN width was set for it: 1376 is Llama's 8/3 * hidden rounded up to a multiple of 32.
TINY_LLAMA = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_DONE = ".complete"


def factories() -> ModuleType:
    """testkit/factories (the tiny random models and tokenizers): the lab runs from the
    checkout, whose root is on sys.path as it is for `benchmarks` itself; HF's `kernels` is
    imported first, so our kernels/ folder never stands in for it."""
    import_installed_kernels()
    from testkit import factories as module

    return module


def tiny_llama(cache: Path = CACHE_DIR) -> Path:
    """The tiny random Llama folder, built on first use (~10 s)."""
    out = cache / "tiny-llama"
    if (out / _DONE).is_file():
        return out
    import transformers

    make_tokenizer = factories().make_tokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformers.LlamaConfig(
        **TINY_LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    model.save_pretrained(tmp, safe_serialization=True)
    make_tokenizer(tmp, vocab_size=TINY_LLAMA["vocab_size"])
    (tmp / _DONE).write_text("random weights, seed 0\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def demo_model() -> Path:
    """The engine's Gemma 3 270M demo folder (converted on first use by the engine)."""
    from loraplex.engine.models.demo import prepare_demo

    return Path(prepare_demo())


def _lora_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """target -> (in_features, out_features) from an HF config.json."""
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }


def make_adapters(
    model_dir: Path,
    name: str,
    count: int,
    *,
    rank: int = 8,
    alpha: float = 16,
    init_std: float = 0.05,
    cache: Path = CACHE_DIR,
) -> list[Path]:
    """`count` PEFT adapters for `model_dir` (cached per model name and settings).

    A ~ N(0, init_std / sqrt(rank)) and B ~ N(0, init_std): the delta stays a small fraction
    of the base projection, so outputs change but the model does not fall apart.
    """
    import_installed_kernels()  # peft imports transformers, which imports HF's `kernels`
    from peft import LoraConfig

    config = json.loads((model_dir / "config.json").read_text())
    shapes = _lora_shapes(config)
    root = cache / "adapters" / f"{name}-r{rank}-std{init_std:g}"
    paths = []
    for i in range(count):
        out = root / f"a{i:02d}"
        paths.append(out)
        if (out / _DONE).is_file():
            continue
        shutil.rmtree(out, ignore_errors=True)
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=list(LORA_TARGETS),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=str(model_dir),
        ).save_pretrained(out)
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target in LORA_TARGETS:
                fin, fout = shapes[target]
                key = f"base_model.model.model.layers.{layer}.self_attn.{target}"
                a = torch.randn(rank, fin, generator=gen) * (init_std / rank**0.5)
                b = torch.randn(fout, rank, generator=gen) * init_std
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, out / "adapter_model.safetensors")
        (out / _DONE).write_text("random LoRA\n")
    return paths


def prepare(
    model: str, num_adapters: int, *, rank: int = 8, init_std: float | None = None
) -> tuple[Path, list[Path]]:
    """(model folder, adapter folders) for `--model tiny-llama|demo|<folder>`."""
    if model == "tiny-llama":
        folder = tiny_llama()
    elif model == "demo":
        folder = demo_model()
    else:
        folder = Path(model).resolve()
        if not (folder / "config.json").is_file():
            raise SystemExit(f"--model {model!r}: expected tiny-llama, demo or a model folder")
    name = model if model in ("tiny-llama", "demo") else folder.name
    std = 0.05 if init_std is None else init_std
    return folder, make_adapters(folder, name, num_adapters, rank=rank, init_std=std)
