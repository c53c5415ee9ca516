"""PEFT LoRA adapters: read, validate against the base model, and hold in memory.

Only `adapter_config.json` + `adapter_model.safetensors` are read; pickle files (`.bin`,
`.pt`) are refused, never opened. Every check happens before anything is kept, so a bad
adapter loads nothing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraplex.engine.models.spec import FUSED, PARENTS, PROJECTIONS, ModelSpec

GROUPS = PROJECTIONS  # PEFT target -> (fused module of ours, slice index within it)
TARGETS = tuple(GROUPS)  # the split names; a family's own: ModelSpec.lora_targets
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FLOAT = {torch.float32, torch.float16, torch.bfloat16}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass
class LoRAAdapter:
    name: str
    rank: int  # largest module rank
    targets: tuple[str, ...]
    # (layer, target) -> (A [r, in], B [out, r] with the scale folded in); keyed by the split
    # names (q_proj, ...) also when the adapter targets a fused module (Phi-3's qkv_proj),
    # whose slices then share one A
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        tensors = {id(t): t for ab in self.weights.values() for t in ab}
        return sum(t.nbytes for t in tensors.values())


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.]{1,200}$")


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule: a key matches a module name that ends with it at a dot boundary.

    peft treats keys as regexes; we accept only plain dotted names (checked on load), so an
    uploaded config cannot make matching run for ever.
    """
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def _check_patterns(cfg: dict, path: Path) -> None:
    for field, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pat = cfg.get(field) or {}
        if not isinstance(pat, dict):
            raise AdapterError(f"{path}: {field} must be an object of module name -> value")
        for key, value in pat.items():
            if not _PLAIN_NAME.match(key):
                raise AdapterError(
                    f"{path}: {field} key {key[:60]!r}: only plain module names are supported"
                )
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                raise AdapterError(f"{path}: {field}[{key!r}] must be a positive number")


def read_adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"{folder}: adapter_config.json is missing")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise AdapterError(f"{path}: DoRA adapters are not supported")
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
    return PARENTS[target] if target in PARENTS else FUSED[target][0]


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
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise AdapterError(f"{path}: target_modules must be a non-empty list of module names")
    supported = ", ".join(spec.lora_targets)
    modules = [f"model.layers.{i}.{_parent(m)}.{m}" for i in range(spec.num_layers)
               for m in spec.lora_targets]  # fmt: skip
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

    supported = ", ".join(spec.lora_targets)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    parents: dict[str, str] = {}
    try:
        with safe_open(str(wpath), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(
                        f"{wpath.name}: tensor {key!r} is not a LoRA weight of a supported "
                        f"module; supported targets: {supported}"
                    )
                layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
                if module not in spec.lora_targets or parent != _parent(module):
                    raise AdapterError(
                        f"{wpath.name}: target module {module!r} is not supported "
                        f"({spec.family}); supported: {supported}"
                    )
                if layer >= spec.num_layers:
                    raise AdapterError(
                        f"{key}: layer {layer} but the base model has {spec.num_layers} layers"
                    )
                parents[module] = parent
                pairs.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    except SafetensorError as e:
        raise AdapterError(f"{wpath}: unreadable safetensors file ({e})") from None
    if not pairs:
        raise AdapterError(f"{wpath}: holds no LoRA weights")
    declared = declared_targets(cfg, folder / "adapter_config.json", spec)
    if declared is not None:
        for layer, module in sorted(pairs):
            full = f"model.layers.{layer}.{parents[module]}.{module}"
            if not any(_matches(entry, full) for entry in declared):
                raise AdapterError(
                    f"{wpath.name}: holds weights for layers.{layer}.{module}, which "
                    f"adapter_config.json's target_modules {declared} does not declare"
                )

    r_default, alpha_default = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    rank_pat, alpha_pat = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        for t in (a, b):
            if t.dtype not in _FLOAT or t.dim() != 2:
                raise AdapterError(
                    f"{where}: expected 2-D float tensors, got {t.dtype} {t.dim()}-D"
                )
        r = a.shape[0]
        fin, fout = spec.lora_in_out(module)
        if a.shape[1] != fin or b.shape[0] != fout or b.shape[1] != r:
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                f"base model (expected [r, {fin}] and [{fout}, r]): wrong base model?"
            )
        full_name = f"model.layers.{layer}.{parents[module]}.{module}"
        r_cfg = _pattern_value(rank_pat, full_name, r_default)
        if r != r_cfg:
            raise AdapterError(f"{where}: rank {r} but adapter_config.json says {r_cfg}")
        if r > max_rank:
            raise AdapterError(
                f"{where}: rank {r} exceeds max_lora_rank {max_rank}; raise max_lora_rank"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{where}: weights contain NaN or Inf")
        alpha = _pattern_value(alpha_pat, full_name, alpha_default)
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        if not math.isfinite(scale):
            raise AdapterError(f"{where}: lora_alpha {alpha!r} gives a non-finite scale")
        a, b = a.to(dtype), (b.float() * scale).to(dtype)
        if module in FUSED and FUSED[module][1] != (module,):
            # A fused target's B rows are our slices' B rows, in our slice order (q|k|v,
            # gate|up, as the checkpoint's own fused weight): each slice gets its rows and
            # the shared A, so B A x lands in the same output rows it does in peft.
            sizes = [spec.lora_in_out(p)[1] for p in FUSED[module][1]]
            for p, rows in zip(FUSED[module][1], b.split(sizes), strict=True):
                weights[(layer, p)] = (a, rows)
        else:
            weights[(layer, module)] = (a, b)
    targets = tuple(t for t in spec.lora_targets if any(m == t for _, m in pairs))
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name=name or folder.name, rank=rank, targets=targets, weights=weights)
