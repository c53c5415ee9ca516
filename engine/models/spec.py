"""What the decoder needs to know about an architecture, read from a HF `config.json`.

Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 text and the mixtures of experts (Qwen3-MoE,
Qwen2-MoE, Mixtral, gpt-oss) differ only in the switches below, so one decoder implementation
serves them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
# The one description of every supported family's layer layout: our fused module -> (its
# parent in a decoder layer, the HF projections it fuses, in slice order). q|k|v and gate|up
# are one matmul each. The model, the adapter manager, adapter loading and upload validation
# all derive their names from it.
FUSED = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
# HF projection name -> (our fused module, slice index)
PROJECTIONS = {p: (fused, i) for fused, (_, ps) in FUSED.items() for i, p in enumerate(ps)}
# HF projection name -> its parent module in a decoder layer (`model.layers.N.<parent>.<p>`)
PARENTS = {p: FUSED[fused][0] for p, (fused, _) in PROJECTIONS.items()}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3",
                "qwen3": "qwen3", "phi3": "phi3", "qwen3_moe": "qwen3_moe",
                "qwen2_moe": "qwen2_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss"}  # fmt: skip
# Families whose checkpoints (and so PEFT adapters) hold q|k|v and gate|up as one module each,
# in our slice order; the others name every projection on its own.
FUSED_CHECKPOINT = {"phi3"}
SPLIT_TARGETS = tuple(PROJECTIONS)  # q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, ...
FUSED_TARGETS = tuple(FUSED)  # qkv_proj, o_proj, gate_up_proj, down_proj
# A mixture-of-experts layer (`mlp` = SparseMoE in engine/models/moe.py): the router `gate`
# (a linear layer, a LoRA target like any other) and per-expert gate/up/down projections held
# as 3-D tensors [experts, out, in]; their LoRA weights live in per-slot expert stacks.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"
# Qwen2-MoE's always-on expert beside the routed ones: a dense MLP and a sigmoid gate.
SHARED_EXPERT = "shared_expert"


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # default | linear | llama3 | yarn | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    partial: float = 1.0  # fraction of head_dim that rotates (Phi-4-mini: 0.75)
    # YaRN: the ramp between interpolated and original frequencies, and the factor cos and sin
    # are multiplied by (transformers' `attention_scaling`)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors up to the original context
    short_factor: tuple[float, ...] | None = None

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    activation: str  # silu | gelu_tanh
    query_scale: float
    windows: tuple[int | None, ...]  # per layer sliding window (None = global)
    ropes: tuple[RopeSpec, ...]  # per layer
    gemma: bool = False  # (1 + w) norms in fp32, QK-norm, sandwich norms, scaled embeddings
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3; Gemma has its own)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # mixture of experts (0 experts: every layer is dense)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense MLP
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert's intermediate size (0: none)
    # gpt-oss: the router is `mlp.router` with a bias and takes the softmax of the top-k
    # logits; experts have biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(alpha *
    # gate)); checkpoints interleave gate and up columns; attention has per-head sinks
    router_name: str = ROUTER
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embed_scale(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.gemma else None

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The PEFT target module names (linear layers) this family's checkpoints have; on a
        mixture of experts the router too (the experts are targeted as parameters or per
        expert: engine/adapters/lora.py)."""
        base = FUSED_TARGETS if self.family in FUSED_CHECKPOINT else SPLIT_TARGETS
        return base + (self.router_name,) if self.is_moe else base

    def lora_in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a PEFT target module name such as `q_proj`."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "qkv_proj": (h, self.q_size + 2 * self.kv_size),
            "gate_up_proj": (h, 2 * i),
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            self.router_name: (h, self.num_experts),
        }[module]

    def expert_in_out(self, projection: str) -> tuple[int, int]:
        """(in, out) of one expert's gate_proj, up_proj or down_proj."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (i, h) if projection == "down_proj" else (h, i)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(params: dict | None, theta: float | None, cfg: dict) -> RopeSpec:
    """One RoPE as transformers 5 reads it: `rope_parameters` (or the older `rope_scaling`),
    with `rope_theta`, `partial_rotary_factor` and `original_max_position_embeddings` at the
    config's top level taking their usual places."""
    params = dict(params or {})
    theta = float(params.get("rope_theta", theta if theta is not None else 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise ValueError(
            f"rope type {kind!r} is not supported (default, linear, llama3, yarn, longrope are)"
        )
    max_position = int(cfg.get("max_position_embeddings", 4096))
    # transformers prefers the top-level field (Phi-3 keeps it there), then the scaling's own
    original = cfg.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", max_position
    )
    factor = params.get("factor")
    if factor is None:  # YaRN, LongRoPE without a factor: the ratio of the two lengths
        factor = max_position / original if kind in ("yarn", "longrope") else 1.0
    factor = float(factor)
    attention_factor = 1.0
    short_factor = None
    if kind == "longrope":
        short_factor = tuple(float(f) for f in params["short_factor"])
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            )
    if kind == "yarn":
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        elif attention_factor is None:
            attention_factor = _yarn_mscale(factor)
    return RopeSpec(
        theta=theta,
        kind=kind,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original),
        partial=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
        short_factor=short_factor,
    )


def spec_from_config(cfg: dict) -> ModelSpec:
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    family = family or _MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')}; "
            f"supported: {sorted(SUPPORTED)}"
        )
    gemma = family == "gemma3"
    n_layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    window = cfg.get("sliding_window")

    layer_types = cfg.get("layer_types")
    if layer_types is None and gemma:
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    if layer_types is None and family == "gpt_oss":  # as GptOssConfig fills it in
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                       for i in range(n_layers)]  # fmt: skip
    if layer_types is None and family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        use = cfg.get("use_sliding_window", False)
        first = cfg.get("max_window_layers", n_layers)
        layer_types = [
            "sliding_attention" if use and i >= first else "full_attention" for i in range(n_layers)
        ]
    if layer_types is None:
        layer_types = ["sliding_attention" if window else "full_attention"] * n_layers
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)

    rope_params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    if rope_params and "full_attention" in rope_params:  # per layer type (Gemma 3, tf 5.x)
        by_type = {t: _rope(p, theta, cfg) for t, p in rope_params.items()}
        ropes = tuple(by_type[t] for t in layer_types)
    elif gemma:  # older layout: global base + scaling, separate local base
        glob = _rope(cfg.get("rope_scaling"), theta if theta is not None else 1e6, cfg)
        local = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        ropes = tuple(local if t == "sliding_attention" else glob for t in layer_types)
    else:
        params = dict(rope_params or cfg.get("rope_scaling") or {})
        if family == "gpt_oss" and not params:  # GptOssConfig's default
            params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
        if family == "phi3" and params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params["rope_type"] = "longrope"  # as Phi3Config reads its older names
        r = _rope(params, theta, cfg)
        ropes = (r,) * n_layers

    for r in ropes:
        if r.short_factor is not None and len(r.short_factor) != r.rotary_dim(head_dim) // 2:
            raise ValueError(
                f"rope short_factor has {len(r.short_factor)} entries; the rotary width "
                f"{r.rotary_dim(head_dim)} needs {r.rotary_dim(head_dim) // 2}"
            )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(
        act
    )
    if activation is None:
        raise ValueError(f"activation {act!r} is not supported")
    attention_bias = bool(cfg.get("attention_bias", False))
    moe = _moe_fields(family, cfg, n_layers)
    return ModelSpec(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=family == "qwen2" or attention_bias or bool(cfg.get("qkv_bias", False)),
        o_bias=attention_bias and family != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        activation=activation,
        query_scale=(cfg.get("query_pre_attn_scalar", 256) if gemma else head_dim) ** -0.5,
        windows=windows,
        ropes=ropes,
        gemma=gemma,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        **moe,
    )


def _moe_fields(family: str, cfg: dict, n_layers: int) -> dict:
    """The mixture-of-experts switches of a config, as transformers reads them."""
    if family not in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        return {}
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if family == "gpt_oss":
        return dict(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]),
                    sparse_layers=(True,) * n_layers, router_name="router", router_bias=True,
                    softmax_after_topk=True, expert_bias=True,
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    attention_sinks=True)  # fmt: skip
    if family == "mixtral":  # every layer routed; softmax, top-k, renormalised
        sparse = (experts > 0,) * n_layers
        return dict(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    sparse_layers=sparse)  # fmt: skip
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    return dict(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 1)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
