"""What the decoder needs to know about an architecture, read from a HF `config.json`.

Llama, Mistral, Qwen2 and Gemma 3 text differ only in the switches below, so one decoder
implementation serves them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
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
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3"}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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
    attn_softcap: float | None = None
    final_softcap: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embed_scale(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.gemma else None

    def lora_in_out(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a PEFT target module name such as `q_proj`."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]


def _rope(params: dict | None, theta: float | None) -> RopeSpec:
    params = dict(params or {})
    theta = float(params.get("rope_theta", theta if theta is not None else 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3 are)")
    return RopeSpec(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
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
    if layer_types is None and family == "qwen2":
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
        by_type = {t: _rope(p, theta) for t, p in rope_params.items()}
        ropes = tuple(by_type[t] for t in layer_types)
    elif gemma:  # older layout: global base + scaling, separate local base
        glob = _rope(cfg.get("rope_scaling"), theta if theta is not None else 1e6)
        local = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        ropes = tuple(local if t == "sliding_attention" else glob for t in layer_types)
    else:
        r = _rope(rope_params or cfg.get("rope_scaling"), theta)
        ropes = (r,) * n_layers

    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(
        act
    )
    if activation is None:
        raise ValueError(f"activation {act!r} is not supported")
    attention_bias = bool(cfg.get("attention_bias", False))
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
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=attention_bias and family != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        activation=activation,
        query_scale=(cfg.get("query_pre_attn_scalar", 256) if gemma else head_dim) ** -0.5,
        windows=windows,
        ropes=ropes,
        gemma=gemma,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
    )
