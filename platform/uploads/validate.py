"""Decide whether a received adapter folder can be served by the resident base model.

Order: sizes, the config's JSON and field types, the safetensors header parsed by hand (no
torch, nothing loaded), the rank limit, the declared base model, then the engine's own
`load_adapter` (targets, shapes against the base, finite values; for DoRA, `use_dora: true`,
one finite magnitude vector of the module's output size per targeted module and none without
use_dora) so an accepted upload is exactly one the engine will load.

Base-model rule (lenient on purpose: names are free text and often local paths): refuse only
when `base_model_name_or_path` names a model family and none of the families it names is
ours. Absolute paths, names equal to ours, and names that mention no family we know are
accepted; the shape checks catch a real mismatch among same-family models.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engine import (
    AdapterError,
    ModelSpec,
    check_adapter_layers,
    load_adapter,
    read_adapter_config,
)
from loraplex.platform.openai.bodies import check_json_depth
from loraplex.platform.store.base import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE, adapter_digest
from loraplex.platform.uploads.policy import UploadError, expected_files, too_large

SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
MAX_CONFIG_BYTES = 1024**2  # as the engine's read_adapter_config
MAX_HEADER_BYTES = 100_000_000
# Substrings (distinctive) naming the families we can serve, keyed by ModelSpec.family.
_FAMILIES = {
    "llama": ("llama",),
    "mistral": ("mistral", "mixtral"),
    "qwen2": ("qwen",),  # lenient: also Qwen3 names (the shape checks tell them apart)
    "qwen3": ("qwen3",),
    "gemma3": ("gemma",),
    "phi3": ("phi-3", "phi3", "phi_3", "phi-4", "phi4", "phi_4"),
}
# Families we never serve; short names, so matched as words ("phi-2" yes, "dolphin" no).
_FOREIGN = ("phi", "falcon", "gpt2", "gptj", "gpt-j", "gpt-neox", "pythia", "bloom", "opt",
            "mpt", "olmo", "starcoder", "t5", "bert")  # fmt: skip
# rank_pattern/alpha_pattern keys are regexes to peft; allow module paths and anchors only, so
# a crafted pattern cannot backtrack for minutes.
# peft itself writes one other form, `.*\.<name>`, for the experts it fuses (the same as <name>).
_PATTERN_KEY = re.compile(r"^(\.\*\\\.)?[\w.^$-]{1,200}$")


@dataclass(frozen=True)
class ValidatedAdapter:
    rank: int  # largest module rank
    alpha: float
    targets: tuple[str, ...]  # PEFT names, e.g. ("q_proj", "v_proj")
    nbytes: int  # both files on disk
    digest: str  # adapter_digest: the store key and registry sha256
    use_rslora: bool
    base_model: str | None  # as the adapter's config declares it


def _invalid(code: str, message: str) -> UploadError:
    return UploadError(422, code, message)


def _bad_st(message: str) -> UploadError:
    return _invalid("bad_safetensors", f"{WEIGHTS_FILE}: {message}")


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _int_list(value: object, length: int | None = None) -> list[int] | None:
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
    return value if ok and (length is None or len(value) == length) else None  # type: ignore[return-value]


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), after checking the header describes the file exactly."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad_st("shorter than the 8-byte header length; truncated?")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise _bad_st(f"header length {n} is not sane (over {MAX_HEADER_BYTES} bytes)")
        if 8 + n > size:
            raise _bad_st(
                f"header length {n} runs past the end of the {size}-byte file; truncated?"
            )
        raw = f.read(n)
    deep = check_json_depth(raw)
    if deep is not None:
        raise _invalid("json_too_deep", f"{WEIGHTS_FILE}: the header: {deep}")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise _bad_st(f"the header names {e.args[0]!r} twice") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_st(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad_st("the header is not a JSON object")
    if not isinstance(header.pop("__metadata__", {}), dict):
        raise _bad_st("__metadata__ is not a JSON object")
    if not header:
        raise _bad_st("holds no tensors")

    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _bad_st(f"tensor {name!r} has no dtype/shape/data_offsets entry")
        dtype = info.get("dtype")
        if dtype not in SAFETENSORS_DTYPES:
            raise _invalid(
                "bad_dtype",
                f"{WEIGHTS_FILE}: tensor {name!r} has dtype {dtype}; only "
                f"{', '.join(SAFETENSORS_DTYPES)} are accepted",
            )
        shape, offsets = _int_list(info.get("shape")), _int_list(info.get("data_offsets"), 2)
        if shape is None or offsets is None:
            raise _bad_st(f"tensor {name!r}: shape / data_offsets are not lists of integers")
        begin, end = offsets
        need = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if end - begin != need:
            raise _bad_st(
                f"tensor {name!r}: {dtype} {shape} needs {need} bytes but its data_offsets "
                f"[{begin}, {end}] span {end - begin}"
            )
        tensors[name] = (dtype, tuple(shape))
        spans.append((begin, end, name))
    data_len = size - 8 - n
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            kind = "overlaps the previous one" if begin < pos else "leaves a gap"
            raise _bad_st(f"tensor {name!r} at data offset {begin} {kind} (expected {pos})")
        pos = end
    if pos != data_len:
        hint = "; truncated?" if pos > data_len else ""
        raise _bad_st(f"tensors need {pos} data bytes but the file holds {data_len}{hint}")
    return tensors


def _check_config_types(cfg: dict) -> None:
    """Catch what the engine would hit as a TypeError or a runaway regex, not an AdapterError."""

    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    if not number(cfg.get("lora_alpha", 1)):
        raise _invalid("bad_config", f"{CONFIG_FILE}: lora_alpha must be a number")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(field) or {}
        if not isinstance(pattern, dict):
            raise _invalid("bad_config", f"{CONFIG_FILE}: {field} must be an object")
        for key, value in pattern.items():
            if not _PATTERN_KEY.match(key) or not number(value):
                raise _invalid(
                    "bad_config",
                    f"{CONFIG_FILE}: {field} entry {key!r}: {value!r} must map a module name "
                    "(letters, digits, _ . - ^ $) to a number",
                )
    base = cfg.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise _invalid("bad_config", f"{CONFIG_FILE}: base_model_name_or_path must be a string")


def check_base_model(declared: str | None, spec: ModelSpec, base_model_name: str) -> None:
    """The lenient rule of the module docstring."""
    name = (declared or "").strip()
    if not name or name == base_model_name or os.path.isabs(name) or re.match(r"[A-Za-z]:", name):
        return
    low = name.lower()
    named = {fam for fam, words in _FAMILIES.items() if any(w in low for w in words)}
    named |= {w for w in _FOREIGN if re.search(rf"(?<![a-z]){re.escape(w)}(?![a-z])", low)}
    if named and spec.family not in named:
        raise _invalid(
            "base_model_mismatch",
            f"{CONFIG_FILE} says the adapter was trained on {name!r} "
            f"({', '.join(sorted(named))}), but this server serves {base_model_name!r} "
            f"({spec.family}); train it on a {spec.family} model or correct "
            "base_model_name_or_path",
        )


def _check_magnitude(adapter, limit: float) -> None:
    """The largest |value| the adapter multiplies activations by (A, B with lora_alpha / r
    folded in, DoRA's magnitude vectors) must stay within `limit` (docs/security.md says
    how the default was measured)."""
    pairs = [*adapter.weights.items(), *adapter.experts.items()]
    tensors = [(key, t) for key, ab in pairs for t in ab]
    tensors += list(adapter.magnitudes.items())
    for (layer, target), t in tensors:
        top = float(t.abs().max()) if t.numel() else 0.0
        if top > limit:
            raise _invalid(
                "weights_too_large",
                f"layers.{layer}.{target}: a weight of magnitude {top:.3g} (lora_alpha / r "
                f"included) exceeds {limit:g}; trained adapters stay far below it. The "
                "server's max_adapter_weight setting raises the limit",
            )


# The default bound on |weight| (lora_alpha / r folded into B): the largest value measured
# in trained adapters (docs/security.md) is about two orders of magnitude below it.
MAX_ADAPTER_WEIGHT = 1000.0


def validate_adapter(
    folder: str | Path,
    spec: ModelSpec,
    *,
    max_rank: int,
    base_model_name: str,
    max_bytes: int,
    max_weight: float | None = MAX_ADAPTER_WEIGHT,
) -> ValidatedAdapter:
    """Check everything the engine and the tenant's quota need; raise UploadError otherwise.
    `max_weight`: the bound on the adapter's weights (None: no bound)."""
    folder = Path(folder)
    missing = [n for n in ADAPTER_FILES if not (folder / n).is_file()]
    if missing:
        raise UploadError(
            400, "missing_file", f"{', '.join(missing)} missing; upload {expected_files()}"
        )
    nbytes = sum((folder / n).stat().st_size for n in ADAPTER_FILES)
    if nbytes > max_bytes:
        raise too_large(f"adapter ({nbytes} bytes)", max_bytes)

    def clean(e: Exception) -> str:  # engine messages name our temp folder; the client needn't
        text = str(e)
        for name in {str(folder), os.path.realpath(folder)}:  # as given, and through links
            text = text.replace(f"{name}/", "").replace(name, "adapter")
        return text

    config = folder / CONFIG_FILE
    if config.stat().st_size <= MAX_CONFIG_BYTES:  # larger: read_adapter_config refuses it
        deep = check_json_depth(config.read_bytes())
        if deep is not None:
            raise _invalid("json_too_deep", f"{CONFIG_FILE}: {deep}")
    try:
        cfg = read_adapter_config(folder)
    except AdapterError as e:
        raise _invalid("bad_config", clean(e)) from None
    _check_config_types(cfg)
    try:
        check_adapter_layers(cfg, spec)
    except AdapterError as e:
        raise _invalid("bad_layers", f"{CONFIG_FILE}: {e}") from None
    tensors = read_safetensors_header(folder / WEIGHTS_FILE)
    # A fused expert adapter's lora_A (peft's target_parameters) stacks every expert's A:
    # rank x experts rows; gate|up may carry twice the rank (engine/adapters/lora.py checks
    # exactly).
    fused = re.compile(r"\.experts(\.base_layer)*\.lora_A\.")
    ranks = [shape[0] // max(spec.num_experts, 1) / 2 if fused.search(name) else shape[0]
             for name, (_, shape) in tensors.items() if "lora_A" in name and shape]  # fmt: skip
    rank = int(max(ranks, default=0))
    if rank > max_rank:
        raise _invalid(
            "rank_too_large", f"adapter rank {rank} exceeds the maximum rank {max_rank} allowed"
        )
    check_base_model(cfg.get("base_model_name_or_path"), spec, base_model_name)
    try:
        adapter = load_adapter(folder, spec, max_rank, torch.float32)
    except (AdapterError, TypeError, ValueError, re.error) as e:
        raise _invalid("invalid_adapter", clean(e)) from None
    if max_weight is not None:
        _check_magnitude(adapter, max_weight)
    return ValidatedAdapter(
        rank=adapter.rank,
        alpha=float(cfg.get("lora_alpha", cfg["r"])),
        targets=adapter.targets,
        nbytes=nbytes,
        digest=adapter_digest(folder),
        use_rslora=bool(cfg.get("use_rslora", False)),
        base_model=cfg.get("base_model_name_or_path"),
    )
