"""Factories the tests and the lab share: a tiny tokenizer, tiny random-weight models, PEFT
adapters, bad adapters.

Everything is built offline in well under a second or two. Shapes (the engine's parity tests
rely on them):

    kind      hidden heads kv head_dim inter  tied  rope theta          extras
    llama       64    4    2     16     128   no    10_000
    mistral     64    4    2     16     128   no    1_000_000           sliding_window None
    qwen2       64    4    2     16     128   no    1_000_000           q/k/v bias (random)
    gemma3      64    4    2     32     128   yes   1e6 full / 1e4 sw   sliding_window 8,
                                                                        layers sw,full,sw,full..
                                                                        query_pre_attn_scalar 24
    qwen3       64    4    2     32     128   no    1_000_000           per-head q/k RMSNorm,
                                                                        q width 128 != hidden
    qwen3_yarn  as qwen3                          1e4, YaRN x4 from 32
    phi3        64    4    2     16     128   no    10_000              fused qkv / gate_up,
                                                                        partial rotary 0.75
    phi3_longrope  as phi3                        LongRoPE from 128     serve <= 128 tokens
    llama3      as llama                    yes   500_000, llama3 x8    Llama 3.2: rope type
                                                  from 32               llama3, tied embeddings

FAMILY_KINDS (the last five) are built on demand by the engine tests; KINDS by every suite.

All float32, max_position_embeddings 512, rms_norm_eps 1e-6, vocab 512 by default.

Tokenizer special tokens (ids fixed): <pad>=0, <s>=1 (BOS, added by the post-processor),
</s>=2 (EOS), <|im_start|>=3, <|im_end|>=4. Models write generation_config eos [2, 4].
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
SPM_SPACE = "\u2581"  # SentencePiece's visible space
KINDS = ("llama", "mistral", "qwen2", "gemma3")
FAMILY_KINDS = ("qwen3", "qwen3_yarn", "phi3", "phi3_longrope", "llama3")
# Mixture-of-experts kinds, built on demand by the engine's MoE tests
MOE_KINDS = ("qwen3_moe", "qwen2_moe", "mixtral")
# Families whose checkpoints fuse projections: a split PEFT target name -> the module it is in.
_FUSED_TARGETS = {
    "phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
             "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"},
}  # fmt: skip

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the gate.
A small engine serves many adapters on one base model, and every tenant gets a fair share.
The capital of France is Paris, the capital of Italy is Rome, and Madrid is in Spain.
Once upon a time there was a little robot who wanted to learn how to write poems.
She said that the weather would be warm and sunny for the rest of the week.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text about dates and prices.
Please answer the question in one short sentence and then stop writing.
What is the best way to cook rice? Rinse it, add water, boil, and let it rest.
The library opens at nine in the morning and closes at six in the evening.
Students read books, write essays, and ask their teachers many questions.
Trains leave the station every hour, and the journey to the coast takes two hours.
He walked along the river, listening to the birds singing in the tall trees.
Memory is split into blocks so that many requests can share the same cache.
The model predicts the next token, one step at a time, until it sees the end.
Good software is tested, documented, and easy to read for the next engineer.
Cafe, naive, resume: some words borrow accents, like caf\u00e9 and na\u00efve.
"""

_MODEL_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def make_tokenizer(path: Path, vocab_size: int = 512, *, byte_fallback: bool = False) -> None:
    """Train a BPE tokenizer in which every byte is encodable and write it into `path`.

    Default: GPT-2 style byte-level BPE. `byte_fallback=True`: SentencePiece style as in
    Llama 2 / Gemma ("▁" for spaces, <0xNN> byte tokens, a decoder that strips the
    leading space). Special-token ids are the same in both.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size <= min_size:
        raise ValueError(f"vocab_size must exceed {min_size} (256 bytes + special tokens)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_byte_fallback(vocab_size) if byte_fallback else _train_byte_level(vocab_size)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for this tokenizer style")
    # The corpus runs out of merges near 600 tokens; fill up with placeholders as Gemma does.
    tok.add_tokens([f"<unused{i}>" for i in range(vocab_size - tok.get_vocab_size())])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", BOS_ID)]
    )
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _train_byte_level(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def _train_byte_fallback(vocab_size: int) -> Tokenizer:
    space = normalizers.Sequence(
        [normalizers.Prepend(SPM_SPACE), normalizers.Replace(" ", SPM_SPACE)]
    )
    trained = Tokenizer(models.BPE())
    trained.normalizer = space
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    trained.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    # The trainer cannot add <0xNN> tokens to the model vocabulary, so rebuild the model with them.
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.normalizer = space
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


def _config(kind: str, vocab_size: int, num_layers: int, tie: bool | None, overrides: dict):
    import transformers

    kw: dict[str, Any] = dict(_MODEL_BASE, vocab_size=vocab_size, num_hidden_layers=num_layers)
    if kind == "llama":
        cls = transformers.LlamaConfig
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0}
    elif kind == "mistral":
        cls = transformers.MistralConfig
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
        kw["sliding_window"] = None
    elif kind == "qwen2":
        cls = transformers.Qwen2Config
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    elif kind == "gemma3":
        cls = transformers.Gemma3TextConfig
        kw.update(
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=[
                "full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)
            ],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    elif kind in ("qwen3", "qwen3_yarn"):
        cls = transformers.Qwen3Config
        kw["head_dim"] = 32  # q is 128 wide on a 64 hidden: head_dim is not hidden / heads
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if kind == "qwen3_yarn":
            # A short original context so that the ramp between interpolated and kept
            # frequencies falls inside a 16-wide head and the attention factor is 1.14.
            kw["head_dim"] = 16
            kw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 32}  # fmt: skip
    elif kind in ("phi3", "phi3_longrope"):
        cls = transformers.Phi3Config
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0,
                                 "partial_rotary_factor": 0.75}  # fmt: skip
        if kind == "phi3_longrope":  # Phi-4-mini's layout: one factor per rotating pair
            kw["original_max_position_embeddings"] = 128
            kw["rope_parameters"] = {**kw["rope_parameters"], "rope_type": "longrope",
                                     "short_factor": [1.0, 1.1, 1.5, 2.0, 3.5, 6.0],
                                     "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}  # fmt: skip
    elif kind == "llama3":
        cls = transformers.LlamaConfig
        kw["tie_word_embeddings"] = True
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}  # fmt: skip
    elif kind == "qwen3_moe":
        # Layer 1 is dense (mlp_only_layers), the others routed: 8 experts, top 2, renormalised
        cls = transformers.Qwen3MoeConfig
        kw.update(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[1] if num_layers >= 2 else [])  # fmt: skip
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    elif kind == "qwen2_moe":  # a shared expert beside the routed ones; top-k not renormalised
        cls = transformers.Qwen2MoeConfig
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, norm_topk_prob=False)  # fmt: skip
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    elif kind == "mixtral":
        cls = transformers.MixtralConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0}
    elif kind == "gpt_oss":
        # sliding and full layers alternate (window 8); YaRN without truncation; a SwiGLU
        # limit low enough that the clamps act on these small activations
        cls = transformers.GptOssConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                  sliding_window=8, swiglu_limit=0.05, attention_bias=True,
                  rms_norm_eps=1e-5)  # fmt: skip
        kw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 32}  # fmt: skip
    else:
        kinds = KINDS + FAMILY_KINDS + MOE_KINDS + ("gpt_oss",)
        raise ValueError(f"unknown model kind {kind!r}; expected one of {kinds}")
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    kw.update(overrides)
    config = cls(**kw)
    config.dtype = torch.float32
    return config


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    # Set every parameter ourselves so weights depend on `seed` only, not on transformers' init.
    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if "norm" in name:
            # Gemma stores w and applies (1 + w); others apply w. Off-centre values expose mixups.
            param.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
        elif name.endswith("bias"):
            param.copy_(0.1 * noise)
        elif name.endswith("sinks"):  # gpt-oss: logits on the scale of the attention scores
            param.copy_(noise)
        else:
            param.copy_(std * noise)


def make_tiny_model(
    kind: str,
    path: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    num_layers: int = 2,
    shard: bool = False,
    tie: bool | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight float32 model of `kind` (see module doc) plus tokenizer to `path`.

    A `vocab_size` too small for a tokenizer (statistical tests want a handful of tokens)
    keeps a 512-id tokenizer, of which the model produces only the first `vocab_size`."""
    import transformers

    path = Path(path)
    config = _config(kind, vocab_size, num_layers, tie, config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, config.initializer_range)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID
    )
    # 150 KB shards: the default 2-layer llama (~0.6 MB) splits into several files + index.
    model.save_pretrained(path, safe_serialization=True, max_shard_size="150KB" if shard else "5GB")
    make_tokenizer(path, vocab_size=vocab_size if vocab_size > 256 + len(SPECIAL_TOKENS) else 512)
    return path


_BASE_CACHE: dict[tuple[str, float], torch.nn.Module] = {}


def _load_base(base_dir: Path) -> torch.nn.Module:
    import transformers

    key = (str(base_dir.resolve()), (base_dir / "config.json").stat().st_mtime)
    if key not in _BASE_CACHE:
        _BASE_CACHE[key] = transformers.AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32
        )
    # get_peft_model rewrites modules in place; the cached copy must stay a plain base model.
    return copy.deepcopy(_BASE_CACHE[key])


@torch.no_grad()
def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    init_std: float = 0.1,
    target_parameters: tuple[str, ...] = (),
) -> Path:
    """Save a PEFT LoRA adapter for `base_dir` with random (non-zero) A and B into `out_dir`.

    On a base whose checkpoint fuses projections (phi3) split names stand for the fused module
    that holds them (`q_proj` -> `qkv_proj`), as a user's PEFT config for it would say."""
    from peft import LoraConfig, get_peft_model

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    model_type = json.loads((base_dir / "config.json").read_text()).get("model_type")
    fused = _FUSED_TARGETS.get(model_type, {})
    targets = tuple(dict.fromkeys(fused.get(t, t) for t in targets))
    lora_config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets) or None,
        target_parameters=list(target_parameters) or None,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(_load_base(base_dir), lora_config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            param.copy_(init_std * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# PEFT target_parameters on transformers 5's fused experts -> transformers 4's per-expert names
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def split_expert_adapter(base_dir: Path, fused_dir: Path, out_dir: Path) -> Path:
    """The adapter in `fused_dir` (made with `target_parameters` on the fused experts) as a
    transformers 4.x user trained it: one LoRA per expert `Linear` (`mlp.experts.<e>.gate_proj`
    ... with their own A; gate and up here share the fused adapter's A, which is the same math),
    so transformers + peft on `fused_dir` is the reference for it."""
    base_dir, fused_dir, out_dir = Path(base_dir), Path(fused_dir), Path(out_dir)
    base_cfg = json.loads((base_dir / "config.json").read_text())
    n = base_cfg.get("num_experts") or base_cfg["num_local_experts"]
    inter = base_cfg.get("moe_intermediate_size") or base_cfg["intermediate_size"]
    cfg = json.loads((fused_dir / "adapter_config.json").read_text())
    params = cfg.get("target_parameters") or []
    tensors = load_file(fused_dir / "adapter_model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if ".mlp.experts." not in key or ".lora_A." not in key:
            if ".mlp.experts." not in key:
                out[key] = t
            continue
        prefix, _, _ = key.partition(".mlp.experts.")
        # which parameter from the shapes: gate|up reads the hidden state, down the expert's
        param = "gate_up_proj" if t.shape[1] == base_cfg["hidden_size"] else "down_proj"
        a = t
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        r = a.shape[0] // n
        a3 = a.reshape(n, r, a.shape[1])
        b3 = b.reshape(b.shape[0], r, n).permute(2, 0, 1)  # [experts, out, r]
        for e in range(n):
            if param.endswith("down_proj"):
                parts = {"down_proj": b3[e]}
            else:
                parts = {"gate_proj": b3[e, :inter], "up_proj": b3[e, inter:]}
            for proj, rows in parts.items():
                name = f"{prefix}.mlp.experts.{e}.{proj}"
                out[f"{name}.lora_A.weight"] = a3[e].clone()
                out[f"{name}.lora_B.weight"] = rows.clone()
    modules = list(cfg.get("target_modules") or [])
    cfg["target_modules"] = modules + [
        p for p in ("gate_proj", "up_proj", "down_proj") if p not in modules
    ]
    cfg["target_parameters"] = [p for p in params if p not in EXPERT_PARAMETERS] or None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(out, out_dir / "adapter_model.safetensors")
    return out_dir


BAD_ADAPTER_KINDS = (
    "pickle_only",
    "wrong_shape",
    "unknown_target",
    "nan",
    "inf",
    "missing_config",
    "missing_weights",
    "truncated",
    "bad_json",
    "huge_rank",
    "config_unknown_target",
    "undeclared_weights",
    "regex_targets",
)
HUGE_RANK = 128


def make_bad_adapters(good_dir: Path, root: Path) -> dict[str, Path]:
    """Broken variants of the adapter in `good_dir`, one folder each under `root`.

    `pickle_only` holds only `adapter_model.bin` (torch.save): loaders must refuse it unread.
    `unknown_target` adds tensors and a target for `foo_proj`, a module no model has.
    `huge_rank` is internally consistent with r=HUGE_RANK: callers set max_lora_rank below it.
    """
    good_dir, root = Path(good_dir), Path(root)
    cfg_name, st_name = "adapter_config.json", "adapter_model.safetensors"
    config = json.loads((good_dir / cfg_name).read_text())
    tensors = load_file(good_dir / st_name)
    gen = torch.Generator().manual_seed(1234)
    first_a = next(k for k in sorted(tensors) if "lora_A" in k)
    out: dict[str, Path] = {}

    def write(name: str, cfg: dict | None, weights: dict[str, torch.Tensor] | None) -> Path:
        d = root / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        if cfg is not None:
            (d / cfg_name).write_text(json.dumps(cfg, indent=2))
        if weights is not None:
            save_file({k: v.contiguous() for k, v in weights.items()}, d / st_name)
        out[name] = d
        return d

    d = write("pickle_only", config, None)
    torch.save(tensors, d / "adapter_model.bin")

    bad = dict(tensors)
    r, in_dim = bad[first_a].shape
    bad[first_a] = torch.randn(r, in_dim + 3, generator=gen)
    write("wrong_shape", config, bad)

    bad = dict(tensors)
    out_dim = tensors[first_a.replace("lora_A", "lora_B")].shape[0]
    foo = first_a.rsplit(".", 3)[0] + ".foo_proj"  # beside the first target, e.g. in self_attn
    bad[f"{foo}.lora_A.weight"] = torch.randn(r, in_dim, generator=gen)
    bad[f"{foo}.lora_B.weight"] = torch.randn(out_dim, r, generator=gen)
    targets = [*config["target_modules"], "foo_proj"]
    write("unknown_target", {**config, "target_modules": targets}, bad)

    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        bad = dict(tensors)
        bad[first_a] = bad[first_a].clone()
        bad[first_a][0, 0] = value
        write(name, config, bad)

    write("missing_config", None, tensors)
    write("missing_weights", config, None)

    d = write("truncated", config, tensors)
    data = (d / st_name).read_bytes()
    (d / st_name).write_bytes(data[: len(data) // 2])

    d = write("bad_json", None, tensors)
    (d / cfg_name).write_text('{"r": 8, "lora_alpha": 16,,')

    huge = {}
    for k, v in tensors.items():
        shape = (HUGE_RANK, v.shape[1]) if "lora_A" in k else (v.shape[0], HUGE_RANK)
        huge[k] = 0.01 * torch.randn(shape, generator=gen)
    write("huge_rank", {**config, "r": HUGE_RANK, "lora_alpha": 2 * HUGE_RANK}, huge)

    # The config and the tensors must agree with each other and with the base model.
    targets = [*config["target_modules"], "not_a_module"]
    write("config_unknown_target", {**config, "target_modules": targets}, tensors)
    present = sorted({k.split(".lora_")[0].rsplit(".", 1)[1] for k in tensors})
    write("undeclared_weights", {**config, "target_modules": present[:1]}, tensors)
    write("regex_targets", {**config, "target_modules": r"(.*)*(q|v)_proj"}, tensors)
    return out
