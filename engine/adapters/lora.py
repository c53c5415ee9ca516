"""PEFT LoRA adapters: read, validate against the base model, and hold in memory.

Only `adapter_config.json` + `adapter_model.safetensors` are read; pickle files (`.bin`,
`.pt`) are refused, never opened. Every check happens before anything is kept, so a bad
adapter loads nothing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraplex.engine.errors import AdapterError
from loraplex.engine.models.spec import (
    EXPERT_PROJECTIONS,
    FUSED,
    PARENTS,
    PROJECTIONS,
    ROUTER,
    SHARED_EXPERT,
    ModelSpec,
)

GROUPS = PROJECTIONS  # PEFT target -> (fused module of ours, slice index within it)
TARGETS = tuple(GROUPS)  # the split names; a family's own: ModelSpec.lora_targets
# lora_A / lora_B weights, and DoRA's per-output-row magnitude (peft saves it without ".weight")
_KEY = re.compile(r"layers\.(\d+)\.([\w.]+)\.(?:lora_([AB])\.weight|lora_(magnitude)_vector)$")
_FLOAT = {torch.float32, torch.float16, torch.bfloat16}
# Mixtral's (transformers 4) names for its sparse block and expert projections
_MIXTRAL = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
GPT_OSS_ROUTER = "router"
# PEFT `target_parameters` on transformers 5's fused experts
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass
class LoRAAdapter:
    name: str
    rank: int  # largest module rank
    targets: tuple[str, ...]
    # (layer, target) -> (A [r, in], B [out, r] with the scale folded in); keyed by the split
    # names (q_proj, ...) also when the adapter targets a fused module (Phi-3's qkv_proj),
    # whose slices then share one A
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # (layer, gate_proj | up_proj | gate_up_proj | down_proj) -> (A [experts, r, in],
    # B [experts, out, r] with the scale folded in): LoRA on a mixture-of-experts layer's
    # experts; gate_up_proj (PEFT's target_parameters) is gate and up with one shared A
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # DoRA (use_dora): (layer, target) -> its magnitude vector m, float32 [out of the split
    # target], for every module the adapter targets (fused targets split as `weights`)
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # DoRA: (layer, target) -> m / ||W + B A||_row [out] in the serving dtype, against the
    # base weights the engine multiplies by (`dora_scales`; empty until the engine computes it)
    dora: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        pairs = [*self.weights.values(), *self.experts.values()]
        pairs += [(m,) for m in (*self.magnitudes.values(), *self.dora.values())]
        tensors = {id(t): t for ab in pairs for t in ab}
        return sum(t.nbytes for t in tensors.values())

    @property
    def use_dora(self) -> bool:
        return bool(self.magnitudes)


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.]{1,200}$")


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule: a key matches a module name that ends with it at a dot boundary.

    peft treats keys as regexes; we accept only plain dotted names (checked on load), so an
    uploaded config cannot make matching run for ever, and the one regex form peft writes
    itself, `.*\\.<name>` (for experts it fused on transformers 5), which says the same.
    """
    for key, value in patterns.items():
        key = _plain_suffix(key)
        if module == key or module.endswith("." + key):
            return value
    return default


def _plain_suffix(key: str) -> str:
    return key[len(_ANY_PREFIX) :] if key.startswith(_ANY_PREFIX) else key


_ANY_PREFIX = ".*\\."


def _check_patterns(cfg: dict, path: Path) -> None:
    for key_name, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pat = cfg.get(key_name) or {}
        if not isinstance(pat, dict):
            raise AdapterError(f"{path}: {key_name} must be an object of module name -> value")
        for key, value in pat.items():
            if not _PLAIN_NAME.match(_plain_suffix(key)):
                raise AdapterError(
                    f"{path}: {key_name} key {key[:60]!r}: only plain module names are supported"
                )
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                raise AdapterError(f"{path}: {key_name}[{key!r}] must be a positive number")


# A peft config is about a kilobyte; the limit leaves room for long rank/alpha patterns.
MAX_CONFIG_BYTES = 1024**2


def read_adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"{folder}: adapter_config.json is missing")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a peft config")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # arrays/objects nested thousands deep
        raise AdapterError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora") is not None and not isinstance(cfg["use_dora"], bool):
        raise AdapterError(f"{path}: use_dora must be true or false")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{path}: adapters with trained biases are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save (full-weight modules) are not supported")
    alpha = cfg.get("lora_alpha", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise AdapterError(f"{path}: 'lora_alpha' must be a positive number, got {alpha!r}")
    _check_patterns(cfg, path)
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 65536:
        raise AdapterError(f"{path}: 'r' must be a positive integer, got {r!r}")
    return cfg


# Modules every supported model has besides the LoRA targets: a config may name them (and we
# say they are not supported) but a name outside both sets is a module the model does not have.
_OTHER_MODULES = ("embed_tokens", "lm_head", "self_attn", "mlp", "input_layernorm",
                  "post_attention_layernorm", "norm")  # fmt: skip


def _other_modules(spec: ModelSpec) -> tuple[str, ...]:
    """The modules of `spec`'s layers that are no LoRA target (norms are never one)."""
    extra = ("q_norm", "k_norm") if spec.qk_norm or spec.gemma else ()
    if spec.gemma:
        extra += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return _OTHER_MODULES + extra


def _matches(entry: str, module: str) -> bool:
    """peft's rule for a listed target: the module's full name is it or ends with `.` + it."""
    return module == entry or module.endswith("." + entry)


def _parent(target: str) -> str:
    """The decoder-layer module (self_attn | mlp) that holds a PEFT target, split or fused."""
    if target in (ROUTER, GPT_OSS_ROUTER) or target.startswith(SHARED_EXPERT + "."):
        return "mlp"
    return PARENTS[target] if target in PARENTS else FUSED[target][0]


def _layer_modules(spec: ModelSpec, layer: int) -> list[str]:
    """The LoRA-targetable linear modules of one decoder layer, by full name: a dense layer's
    projections; a routed layer's router, each expert's projections as transformers 4 named
    them (`mlp.experts.<e>.gate_proj`) and the shared expert's."""
    pre = f"model.layers.{layer}"
    dense_mlp = {p for p, parent in PARENTS.items() if parent == "mlp"} | {"gate_up_proj"}
    skip = {spec.router_name} | (dense_mlp if spec.is_sparse(layer) else set())
    names = [f"{pre}.{_parent(m)}.{m}" for m in spec.lora_targets if m not in skip]
    if spec.is_sparse(layer):
        names.append(f"{pre}.mlp.{spec.router_name}")
        names += [f"{pre}.mlp.experts.{e}.{p}" for e in range(spec.num_experts)
                  for p in EXPERT_PROJECTIONS]  # fmt: skip
        if spec.shared_expert_size:
            names += [f"{pre}.mlp.{SHARED_EXPERT}.{p}" for p in EXPERT_PROJECTIONS]
    return names


def check_adapter_layers(cfg: dict, spec: ModelSpec) -> frozenset[int] | None:
    """peft's `layers_to_transform` (an index or a list of them) and `layers_pattern` (the name
    of the model's list of layers) against the base model: the layers the adapter may hold
    weights for, None for all. Raises AdapterError for an index the model does not have
    (negative, or past its last layer) or a layer list it does not have."""
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        layers_set = None
    else:
        items = layers if isinstance(layers, list) else [layers]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise AdapterError("layers_to_transform must be a layer index or a list of them")
        wrong = [i for i in items if not 0 <= i < spec.num_layers]
        if wrong:
            raise AdapterError(
                f"layers_to_transform {wrong[:8]}: the base model ({spec.family}) has layers "
                f"0 to {spec.num_layers - 1}"
            )
        layers_set = frozenset(items)
    pattern = cfg.get("layers_pattern")
    if pattern is not None and pattern != []:
        names = pattern if isinstance(pattern, list) else [pattern]
        if not all(isinstance(n, str) for n in names):
            raise AdapterError("layers_pattern must be a name or a list of names")
        if "layers" not in names:
            raise AdapterError(
                f"layers_pattern {names[:4]}: the base model's layers are model.layers, "
                "so the only pattern it has is 'layers'"
            )
    return layers_set


def declared_targets(cfg: dict, path: Path, spec: ModelSpec) -> list[str] | None:
    """`target_modules` checked against the base model's layout; None means every target
    (absent, or peft's "all-linear"). Each entry must name a module the model has and that we
    serve. peft also takes a regular expression here; we refuse one rather than run an
    uploaded regex (and say how to write the list instead)."""
    targets = cfg.get("target_modules")
    if targets is None or targets == "all-linear":
        return None
    if isinstance(targets, str):
        if not _PLAIN_NAME.match(targets):
            raise AdapterError(
                f"{path}: target_modules {targets[:80]!r} is a regular expression, which is not "
                f"supported; list the module names instead, e.g. {list(spec.lora_targets[:2])}"
            )
        targets = [targets]
    if isinstance(targets, list) and not targets and cfg.get("target_parameters"):
        return []  # peft 0.21's experts-only adapter: every target is a parameter
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise AdapterError(f"{path}: target_modules must be a non-empty list of module names")
    supported = ", ".join(spec.lora_targets)
    modules = [m for i in range(spec.num_layers) for m in _layer_modules(spec, i)]
    for entry in targets:
        if not _PLAIN_NAME.match(entry):
            raise AdapterError(f"{path}: target_modules entry {entry[:80]!r} is not a module name")
        if any(_matches(entry, m) for m in modules):
            continue
        last = entry.rsplit(".", 1)[-1]
        if last in _other_modules(spec):
            raise AdapterError(
                f"{path}: target module {entry!r} is not supported; supported: {supported}"
            )
        raise AdapterError(
            f"{path}: target module {entry!r} does not exist in the base model "
            f"({spec.family}, {spec.num_layers} layers); its LoRA targets: {supported}"
        )
    return targets


def _classify(path: str, layer: int, spec: ModelSpec, where: str):
    """A weight's module path inside decoder layer `layer` -> what it adapts:
    ("module", PEFT target), ("expert", (expert, projection)) or ("experts", nesting depth)
    for PEFT's `target_parameters` on the fused experts (`experts.base_layer.lora_A` wraps
    one parameter, `experts.lora_A` the next)."""
    parts = [_MIXTRAL.get(p, p) for p in path.split(".")]
    supported = ", ".join(spec.lora_targets)
    sparse = spec.is_sparse(layer)
    if len(parts) >= 2 and parts[0] == "mlp" and parts[1] == "experts" and sparse:
        rest = parts[2:]
        if rest and rest[0].isdigit() and len(rest) == 2 and rest[1] in EXPERT_PROJECTIONS:
            if int(rest[0]) >= spec.num_experts:
                raise AdapterError(
                    f"{where}: expert {rest[0]} but the base model has {spec.num_experts}"
                )
            return "expert", (int(rest[0]), rest[1])
        if all(p == "base_layer" for p in rest):
            return "experts", len(rest)
    shared = len(parts) == 3 and parts[:2] == ["mlp", SHARED_EXPERT]
    if shared and spec.shared_expert_size and parts[2] in EXPERT_PROJECTIONS:
        return "module", f"{SHARED_EXPERT}.{parts[2]}"
    if len(parts) == 2:
        parent, module = parts
        if module == spec.router_name and parent == "mlp" and sparse:
            return "module", module
        if module in spec.lora_targets and module != spec.router_name and parent == _parent(module):
            if parent == "mlp" and sparse:
                raise AdapterError(
                    f"{where}: layer {layer} of this {spec.family} model is a mixture of "
                    f"experts: it has no mlp.{module} (its experts are targeted per expert "
                    "or with target_parameters)"
                )
            return "module", module
    name = parts[-1] if len(parts) == 2 else ".".join(parts)
    raise AdapterError(
        f"{where}: target module {name!r} is not supported ({spec.family}); "
        f"supported: {supported}"
        + (", the experts (per expert or target_parameters) and the router" if spec.is_moe else "")
    )


def _module_in_out(spec: ModelSpec, module: str) -> tuple[int, int]:
    if module.startswith(SHARED_EXPERT + "."):
        h, i = spec.hidden_size, spec.shared_expert_size
        return (i, h) if module.endswith("down_proj") else (h, i)
    return spec.lora_in_out(module)


def _check_factors(where: str, a: torch.Tensor, b: torch.Tensor, fin: int, fout: int) -> int:
    for t in (a, b):
        if t.dtype not in _FLOAT or t.dim() != 2:
            raise AdapterError(f"{where}: expected 2-D float tensors, got {t.dtype} {t.dim()}-D")
    r = a.shape[0]
    if a.shape[1] != fin or b.shape[0] != fout or b.shape[1] != r:
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
            f"base model (expected [r, {fin}] and [{fout}, r]): wrong base model?"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{where}: weights contain NaN or Inf")
    return r


def _declared_parameters(cfg: dict, path: Path) -> list[str]:
    params = cfg.get("target_parameters") or []
    if not isinstance(params, list) or not all(
        isinstance(p, str) and _PLAIN_NAME.match(p) for p in params
    ):
        raise AdapterError(f"{path}: target_parameters must be a list of parameter names")
    return params


def load_adapter(
    folder: str | Path, spec: ModelSpec, max_rank: int, dtype: torch.dtype, name: str | None = None
) -> LoRAAdapter:
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    cfg = read_adapter_config(folder)
    wpath = folder / "adapter_model.safetensors"
    if not wpath.is_file():
        pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        if pickles:
            raise AdapterError(
                f"{folder}: only pickle weights ({', '.join(pickles)}); loraplex never unpickles. "
                "Save the adapter with safetensors (peft's save_pretrained does by default)"
            )
        raise AdapterError(f"{folder}: adapter_model.safetensors is missing")

    try:
        allowed_layers = check_adapter_layers(cfg, spec)
    except AdapterError as e:
        raise AdapterError(f"{folder / 'adapter_config.json'}: {e}") from None
    supported = ", ".join(spec.lora_targets)
    # (layer, kind, key) -> {"A": tensor, "B": tensor}; kinds as _classify returns them
    pairs: dict[tuple[int, str, object], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(wpath), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(
                        f"{wpath.name}: tensor {key!r} is not a LoRA weight of a supported "
                        f"module; supported targets: {supported}"
                    )
                layer, path, ab = int(m[1]), m[2], m[3] or "M"
                if layer >= spec.num_layers:
                    raise AdapterError(
                        f"{key}: layer {layer} but the base model has {spec.num_layers} layers"
                    )
                if allowed_layers is not None and layer not in allowed_layers:
                    raise AdapterError(
                        f"{key}: layer {layer}, which adapter_config.json's "
                        f"layers_to_transform {sorted(allowed_layers)} does not list"
                    )
                kind, what = _classify(path, layer, spec, wpath.name)
                pairs.setdefault((layer, kind, what), {})[ab] = f.get_tensor(key)
    except SafetensorError as e:
        raise AdapterError(f"{wpath}: unreadable safetensors file ({e})") from None
    if not pairs:
        raise AdapterError(f"{wpath}: holds no LoRA weights")
    declared = declared_targets(cfg, folder / "adapter_config.json", spec)
    params = _declared_parameters(cfg, folder / "adapter_config.json")
    dora = bool(cfg.get("use_dora"))
    for (layer, kind, what), ab in pairs.items():
        _check_dora_keys(layer, kind, what, ab, dora)
        if kind == "experts":
            if not any(p.endswith(tuple(EXPERT_PARAMETERS)) for p in params):
                raise AdapterError(
                    f"{wpath.name}: holds expert weights for layer {layer}, which "
                    "adapter_config.json's target_parameters does not declare"
                )
            continue
        full = (f"model.layers.{layer}.mlp.experts.{what[0]}.{what[1]}" if kind == "expert"
                else f"model.layers.{layer}.{_parent(what)}.{what}")  # fmt: skip
        router_param = f"{spec.router_name}.weight"
        if (
            kind == "module"
            and what == spec.router_name
            and any(p.endswith(router_param) for p in params)
        ):
            if dora:  # peft's ParamWrapper refuses use_dora: no such adapter can be trained
                raise AdapterError(
                    f"{wpath.name}: DoRA on the router as a target_parameters entry is not "
                    "supported (peft does not support it either); target it as a module"
                )
            continue  # the router targeted as a parameter
        if declared is not None and not any(_matches(entry, full) for entry in declared):
            raise AdapterError(
                f"{wpath.name}: holds weights for {full.removeprefix('model.')}, which "
                f"adapter_config.json's target_modules {declared} does not declare"
            )

    r_default, alpha_default = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    rank_pat, alpha_pat = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}

    def scaled(where: str, full_name: str, r: int, b: torch.Tensor, limit: int = 1):
        r_cfg = _pattern_value(rank_pat, full_name, r_default)
        if r != r_cfg:
            raise AdapterError(f"{where}: rank {r} but adapter_config.json says {r_cfg}")
        if r > max_rank * limit:
            raise AdapterError(
                f"{where}: rank {r} exceeds {'2 x ' if limit == 2 else ''}max_lora_rank "
                f"{max_rank}; raise max_lora_rank"
            )
        alpha = _pattern_value(alpha_pat, full_name, alpha_default)
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        if not math.isfinite(scale):
            raise AdapterError(f"{where}: lora_alpha {alpha!r} gives a non-finite scale")
        return (b.float() * scale).to(dtype)

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    magnitudes: dict[tuple[int, str], torch.Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, kind, what), ab in sorted(pairs.items(), key=lambda kv: str(kv[0])):
        a, b = ab["A"], ab["B"]
        if kind == "expert":
            e, proj = what
            where = f"layers.{layer}.mlp.experts.{e}.{proj}"
            r = _check_factors(where, a, b, *spec.expert_in_out(proj))
            b = scaled(where, f"model.layers.{layer}.mlp.experts.{e}.{proj}", r, b)
            per_expert.setdefault((layer, proj), {})[e] = (a.to(dtype), b)
            continue
        if kind == "experts":
            _fused_expert_factors(spec, layer, a, b, scaled, experts, dtype)
            continue
        module = what
        where = f"layers.{layer}.{module}"
        fin, fout = _module_in_out(spec, module)
        r = _check_factors(where, a, b, fin, fout)
        full_name = f"model.layers.{layer}.{_parent(module)}.{module}"
        a, b = a.to(dtype), scaled(where, full_name, r, b)
        mag = _check_magnitude(where, ab["M"], fout) if "M" in ab else None
        if module in FUSED and FUSED[module][1] != (module,):
            # A fused target's B rows are our slices' B rows, in our slice order (q|k|v,
            # gate|up, as the checkpoint's own fused weight): each slice gets its rows and
            # the shared A, so B A x lands in the same output rows it does in peft. DoRA's
            # magnitude is per output row, so it splits the same way.
            sizes = [spec.lora_in_out(p)[1] for p in FUSED[module][1]]
            for i, (p, rows) in enumerate(zip(FUSED[module][1], b.split(sizes), strict=True)):
                weights[(layer, p)] = (a, rows)
                if mag is not None:
                    magnitudes[(layer, p)] = mag.split(sizes)[i].clone()
        else:
            weights[(layer, module)] = (a, b)
            if mag is not None:
                magnitudes[(layer, module)] = mag
    for (layer, proj), by_expert in per_expert.items():
        # Experts a transformers-4 adapter left out get zero factors: no delta.
        ranks = {a.shape[0] for a, _ in by_expert.values()}
        if len(ranks) != 1:
            raise AdapterError(
                f"layers.{layer}.mlp.experts.*.{proj}: the experts' ranks differ ({sorted(ranks)})"
            )
        r, (fin, fout) = ranks.pop(), spec.expert_in_out(proj)
        a_all = torch.zeros(spec.num_experts, r, fin, dtype=dtype)
        b_all = torch.zeros(spec.num_experts, fout, r, dtype=dtype)
        for e, (a, b) in by_expert.items():
            a_all[e], b_all[e] = a, b
        experts[(layer, proj)] = (a_all, b_all)
    _check_served_finite([*weights.items(), *experts.items()], dtype)
    modules = {what for (_, kind, what) in pairs if kind == "module"}
    targets = tuple(dict.fromkeys(
        [t for t in spec.lora_targets if t in modules]
        + sorted({m for _, m in weights if m.startswith(SHARED_EXPERT + ".")})
        + [f"experts.{p}" for p in ("gate_up_proj", *EXPERT_PROJECTIONS)
           if any(q == p for _, q in experts)]
    ))  # fmt: skip
    rank = max(
        [a.shape[0] for a, _ in weights.values()] + [a.shape[1] for a, _ in experts.values()]
    )
    return LoRAAdapter(
        name=name or folder.name, rank=rank, targets=targets, weights=weights, experts=experts,
        magnitudes=magnitudes,
    )  # fmt: skip


def _check_served_finite(factors, dtype: torch.dtype) -> None:
    """Every factor as the engine multiplies it (cast to the serving dtype, B scaled by
    lora_alpha / r) must be finite, not only the file's values: the batched LoRA forms
    multiply a row's zeroed columns by other slots' B, and 0 x inf is NaN in another
    tenant's row (kernels/cpu.py, the dense group)."""
    for (layer, target), (a, b) in factors:
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(
                f"layers.{layer}.{target}: weights overflow {str(dtype).removeprefix('torch.')}"
                " once lora_alpha / r scales them; the adapter cannot be served in this dtype"
            )


def _check_dora_keys(layer: int, kind: str, what, ab: dict, dora: bool) -> None:
    """Each adapted module has lora_A and lora_B, plus DoRA's magnitude exactly when the
    config says use_dora; DoRA only on the modules the engine runs as LoRALinear."""
    where = f"layers.{layer}." + (
        f"mlp.experts.{what[0]}.{what[1]}" if kind == "expert"
        else "mlp.experts" if kind == "experts"
        else f"{_parent(what)}.{what}"
    )  # fmt: skip
    if not {"A", "B"} <= set(ab):
        raise AdapterError(f"{where}: needs both lora_A and lora_B")
    if "M" in ab and not dora:
        raise AdapterError(
            f"{where}: holds a DoRA lora_magnitude_vector but adapter_config.json does not "
            "say use_dora: true"
        )
    if dora and kind != "module":
        # peft's target_parameters (ParamWrapper) refuses use_dora; the per-expert form is
        # served by the experts' own LoRA path, which has no DoRA epilogue
        raise AdapterError(
            f"{where}: DoRA on mixture-of-experts expert weights is not supported; train "
            "DoRA on the attention, router or shared-expert modules, or plain LoRA on experts"
        )
    if dora and "M" not in ab:
        raise AdapterError(f"{where}: use_dora is true but the module has no lora_magnitude_vector")


def _check_magnitude(where: str, m: torch.Tensor, fout: int) -> torch.Tensor:
    if m.dtype not in _FLOAT or tuple(m.shape) != (fout,):
        raise AdapterError(
            f"{where}: lora_magnitude_vector is {m.dtype} {tuple(m.shape)}; expected a float "
            f"vector of the module's {fout} output rows: wrong base model?"
        )
    if not torch.isfinite(m).all():
        raise AdapterError(f"{where}: lora_magnitude_vector contains NaN or Inf")
    return m.float()


def dora_scales(
    adapter: LoRAAdapter,
    base_rows: Callable[[int, str], torch.Tensor | BaseProbe],
    dtype: torch.dtype,
    rows_per_chunk: int = 1024,
) -> dict[tuple[int, str], torch.Tensor]:
    """DoRA's per-output-row factor m / ||W + s B A||_row for each DoRA target, as peft's
    DoraLinearLayer computes it at inference (the norm is a constant there: detached).

    `base_rows(layer, target)` is the float32 [out, in] base weight the engine multiplies that
    target's rows by (on a quantized base the dequantized weight, so the factor matches what
    is served), or where only a packed weight stays a `BaseProbe`: ||W_n||^2 and a product
    a -> W a^T, from which ||W_n + (B A)_n||^2 = ||W_n||^2 + 2 B_n . (W A^T)_n + B_n A A^T B_n^T.
    Computed once per adapter load, in float32 and in row chunks (a large module's W + B A is
    never whole in memory); returns the factors in `dtype` on the CPU."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    # the slices of one fused module in a row (q|k|v, gate|up): `base_rows` may keep its weight
    order = sorted(adapter.magnitudes, key=lambda k: (k[0], PROJECTIONS.get(k[1], (k[1], 0))))
    for key in order:
        m = adapter.magnitudes[key]
        a, b = adapter.weights[key]  # [r, in], [out, r] with the scale folded in
        w = base_rows(*key)
        if isinstance(w, BaseProbe):
            dev = w.sq.device
            af, bf = a.to(dev, torch.float32), b.to(dev, torch.float32)
            wa = w.probe(a.to(dev))  # [out, r]
            sq = w.sq + 2 * (bf * wa).sum(1) + ((bf @ (af @ af.T)) * bf).sum(1)
            norms = sq.clamp_min(0).sqrt().cpu()
        else:
            a = a.to(w.device, torch.float32)
            norms = torch.empty(w.shape[0], dtype=torch.float32)
            for lo in range(0, w.shape[0], rows_per_chunk):
                hi = min(lo + rows_per_chunk, w.shape[0])
                full = w[lo:hi].float() + b[lo:hi].to(w.device, torch.float32) @ a
                norms[lo:hi] = torch.linalg.vector_norm(full, dim=1).cpu()
        scale = m / norms
        if not torch.isfinite(scale).all():
            raise AdapterError(
                f"layers.{key[0]}.{key[1]}: an output row of W + B A has norm 0, so DoRA's "
                "m / ||W + B A|| is not finite"
            )
        out[key] = scale.to(dtype)
    return out


@dataclass
class BaseProbe:
    """A base layer's rows known only through its product (a pre-packed CPU weight):
    ||W_n||^2 [out] and a -> W a^T [out, r] for a [r, in]."""

    sq: torch.Tensor
    probe: Callable[[torch.Tensor], torch.Tensor]


def _deinterleave(n: int) -> torch.Tensor:
    """Row order that turns gpt-oss' interleaved gate/up ([g0, u0, g1, u1, ...]) into ours."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _fused_expert_factors(spec, layer, a, b, scaled, experts, dtype) -> None:
    """PEFT's `target_parameters` LoRA on a fused [experts, out, in] parameter: lora_A
    [r * experts, in] holds expert e's A in rows e*r:(e+1)*r; lora_B [out, r * experts] holds
    its B in columns e, e + experts, e + 2 * experts, ... (peft reshapes it to [out, r,
    experts]). Which parameter it is follows from the shapes (gate|up: in = hidden, out =
    2 x intermediate; down: in = intermediate, out = hidden)."""
    h, i, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    where = f"layers.{layer}.mlp.experts"
    if a.dim() != 2 or b.dim() != 2 or a.dtype not in _FLOAT or b.dtype not in _FLOAT:
        raise AdapterError(f"{where}: expected 2-D float tensors")
    fits = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    param = next((p for p, (fin, fout) in fits.items()
                  if a.shape[1] == fin and b.shape[0] == fout), None)  # fmt: skip
    if param is None or a.shape[0] % n or b.shape[1] != a.shape[0]:
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} fit neither "
            f"gate_up_proj nor down_proj of {n} experts: wrong base model?"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{where}.{param}: weights contain NaN or Inf")
    r = a.shape[0] // n
    a3 = a.reshape(n, r, a.shape[1]).to(dtype)
    b3 = b.reshape(b.shape[0], r, n).permute(2, 0, 1)  # [experts, out, r]
    if param == "gate_up_proj" and spec.family == "gpt_oss":
        # gpt-oss interleaves gate and up outputs; our rows are gate, then up
        # (engine/weights/loader.py)
        b3 = b3[:, _deinterleave(b3.shape[1])]
    # gate|up share one A (peft fuses a transformers-4 config's gate and up ranks into one of
    # twice the rank), so it may use both slices' width
    limit = 2 if param == "gate_up_proj" else 1
    b3 = scaled(f"{where}.{param}", f"model.layers.{layer}.mlp.experts.{param}", r, b3, limit)
    if (layer, param) in experts:
        raise AdapterError(f"{where}.{param}: targeted twice")
    experts[(layer, param)] = (a3, b3.contiguous())
