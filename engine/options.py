"""Every engine option, defined once: its type, default, help and bounds.

`EngineConfig` (engine/config.py) is these fields plus the model; the server's settings
(`LORAPLEX_*` environment variables, platform/settings.py) and `loraplex serve`'s flags
(platform/cli.py) are derived from the fields marked `server` here, names, types, choices,
defaults, bounds and help included. Adding an engine option is one field below plus its use.

Standard library only: the CLI reads this to build `--help` without importing torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["int8", "int4", "fp8"]
KVCacheDtype = Literal["auto", "int8"]
CPUAttention = Literal["auto", "sdpa", "matmul"]
KernelMode = Literal["auto", "reference", "triton"]
PreemptionMode = Literal["auto", "swap", "recompute"]
SchedulingPolicy = Literal["fcfs", "vtc"]

_UNSET: Any = dataclasses.MISSING


def option(
    default: Any = _UNSET,
    help: str = "",
    *,
    server: bool = False,
    server_default: Any = _UNSET,
    setting: str | None = None,
    flag: str | bool = False,
    ge: float | None = None,
    le: float | None = None,
    default_factory: Any = _UNSET,
) -> Any:
    """A field of `EngineOptions`. `server`: the server exposes it as a setting (named
    `setting`, default the field's name; default `server_default` where a server wants
    another than an embedder); `flag`: `loraplex serve` also takes it on the command line
    (True: --the-name, or the flag spelt out, e.g. vLLM's "--swap-space")."""
    meta = {"help": help, "server": server or bool(flag), "server_default": server_default,
            "setting": setting, "flag": flag, "ge": ge, "le": le}  # fmt: skip
    if default_factory is not _UNSET:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EngineOptions:
    model: str = option("", "model folder (config.json, safetensors, tokenizer)")
    dtype: Dtype = option(
        "auto", "weights' and activations' dtype; 'auto': what config.json declares",
        flag=True,
    )  # fmt: skip
    device: str = option(
        "cpu",
        "torch device: cpu, cuda, cuda:N, or auto (the first GPU torch sees, else the CPU)",
        server_default="auto", flag=True,
    )  # fmt: skip
    block_size: int = option(16, "tokens per KV cache block (a power of two, 8-128)")
    num_kv_blocks: int | None = option(
        None, "KV pool size in blocks; default: what the memory budget holds", server=True, ge=1
    )
    kv_cache_bytes: int = option(1 << 30, "the KV pool's budget when num_kv_blocks is unset")
    gpu_memory_utilization: float | None = option(
        None,
        "on a GPU: the share of its memory this engine takes (weights, adapter slots, KV pool "
        "and a step's working memory), as vLLM's flag: the KV pool gets what is left of it "
        "instead of kv_cache_bytes; unset: kv_cache_bytes; ignored on the CPU",
        server_default=0.9, flag=True, ge=0.05, le=1.0,
    )  # fmt: skip
    max_model_len: int | None = option(
        None,
        "longest prompt + output; default: the model's max_position_embeddings (capped at 8192)",
        server_default=2048,
        flag=True,
        ge=16,
    )
    max_num_seqs: int = option(64, "requests running at once", server=True, ge=1)
    max_num_batched_tokens: int = option(
        2048, "tokens one step computes at most (prompt chunks and decodes)", flag=True, ge=1
    )
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    max_batch_step_tokens: int = option(
        16,
        "tokens one step may give the Batch API's class: a request that arrives while a step "
        "runs waits for its end, so steps carrying batch work stay short",
        server=True,
        ge=1,
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of a prompt prefix another request computed", flag=True
    )
    max_loras: int = option(
        4, "adapters resident on the device at once", server_default=8, flag=True, ge=1
    )
    max_lora_rank: int = option(64, "largest adapter rank served", flag=True, ge=1, le=512)
    max_cpu_loras: int | None = option(
        None, "adapters kept in host memory (LRU); default 4 x max_loras", server=True, ge=1
    )
    enable_lora: bool = option(
        True,
        "serve adapters; false: the base model alone, as vLLM without --enable-lora: no adapter "
        "slots (their memory goes to the KV cache), no LoRA in any step, and a request naming "
        "an adapter is refused",
    )
    expert_lora: bool = option(
        True,
        "mixture-of-experts bases: room in every adapter slot for LoRA on the experts (counted "
        "in the memory budget); false serves attention and router adapters only",
        server=True,
    )
    scheduling_policy: SchedulingPolicy = option(
        "fcfs", "'vtc': weighted fair share across tenants; 'fcfs': arrival order",
        server_default="vtc", server=True,
    )  # fmt: skip
    cpu_float32_compute: bool | None = option(
        None,
        "on a CPU without bf16/fp16 matmul instructions compute in float32 (twice the weight "
        "memory, several times the speed); None: decide from the CPU's flags",
    )
    quantization: Quantization | None = option(
        None,
        "weight-only quantization of the base model's linear layers (from a float checkpoint; "
        "a GPTQ / AWQ / FP8 checkpoint is detected by itself)",
        flag=True,
    )
    cpu_attention: CPUAttention = option(
        help="CPU attention form: torch's fused kernel, batched matmuls, or 'auto' (time both "
        "at start on the model's shape, keep the faster); LORAPLEX_CPU_ATTENTION sets the "
        "default",
        default_factory=lambda: os.environ.get("LORAPLEX_CPU_ATTENTION", "auto"),
        server_default="auto",  # the server's own LORAPLEX_CPU_ATTENTION is this setting
        server=True,
    )
    kernel_mode: KernelMode = option(
        help="which kernels run each op (kernels/backend.py): 'auto' Triton on CUDA, the batched "
        "CPU backend elsewhere; 'reference' the torch oracle everywhere (slow, for checking); "
        "'triton' Triton everywhere (on the CPU only under TRITON_INTERPRET=1); "
        "LORAPLEX_KERNELS sets the default",
        default_factory=lambda: os.environ.get("LORAPLEX_KERNELS", "auto"),
        server_default="auto",  # the server's own LORAPLEX_KERNELS is this setting
        server=True,
        setting="kernels",
    )
    enforce_eager: bool | None = option(
        None,
        "never capture decode as CUDA graphs (persistent buffers captured per batch bucket, "
        "engine/step/graph_runner.py). Unset: graphs on CUDA, plain steps on the CPU; false: the "
        "buffered forward always (uncaptured on the CPU, as a check)",
        flag=True,
    )
    num_threads: int | None = option(
        None,
        "CPU threads for the engine's torch ops; the server's default is the usable cores minus "
        "one, leaving one to the HTTP loop (busy compute threads starve it)",
        server=True,
        setting="engine_threads",
        ge=1,
    )
    seed: int = option(0, "seed of the engine's sampling generator")
    kv_cache_dtype: KVCacheDtype = option(
        "auto", "KV cache element type; int8 holds about twice the tokens", flag=True
    )
    kv_admission: bool = option(
        False,
        "admit a request only when its expected KV growth fits (output lengths learned from "
        "finished requests) instead of by its prompt alone",
        flag=True,
    )
    num_speculative_tokens: int = option(
        0,
        "speculative decoding by prompt lookup: tokens proposed per request per step (0: off); "
        "pays where outputs copy their prompt (editing, summarising)",
        flag=True,
        ge=0,
        le=16,
    )
    swap_space_gib: float = option(
        0.0,
        "host memory (GiB) for preempted requests' KV blocks: a preempted request is swapped "
        "out and back instead of recomputed when that measures cheaper; 0: recompute",
        flag="--swap-space",
        ge=0,
    )
    num_host_kv_blocks: int | None = option(None, "the host KV pool in blocks instead", ge=0)
    preemption_mode: PreemptionMode = option(
        "auto",
        "'auto': swap or recompute each preempted request by the measured costs; 'swap' / "
        "'recompute': always that (swap needs swap_space_gib)",
        server=True,
    )
    tensor_parallel_size: int = option(
        1,
        "processes (devices) one base model is split across: each holds 1/N of every layer's "
        "heads and MLP, of its adapters and of the KV cache (docs/tensor-parallel.md)",
        flag=True,
        ge=1,
    )

    # KV tiers below the device pool (engine/memory/tiers, docs/kv-tiers.md): prefix blocks are
    # written through to each configured tier; a new request's stored prefix is loaded, not
    # prefilled. Any of the three turns them on.
    kv_tier_host_gib: float = option(
        0.0, "host memory (GiB) for prefix KV blocks below the device pool; 0: none",
        server=True, ge=0,
    )  # fmt: skip
    kv_tier_disk_path: str | None = option(
        None, "folder for prefix KV blocks on local disk (survive restarts); unset: none",
        server=True,
    )  # fmt: skip
    kv_tier_disk_gib: float = option(
        10.0, "the disk tier's bound (GiB); least recently used blocks go first", server=True,
        ge=0,
    )  # fmt: skip
    kv_tier_shared_url: str | None = option(
        None,
        "a store replicas share for prefix KV blocks: redis://host:port/db (the measured "
        "choice) or s3://bucket/prefix; unset: none",
        server=True,
    )
    kv_tier_ttl_s: int = option(
        86400, "seconds a block lives in the shared Redis tier (0: no expiry)", server=True, ge=0
    )
    kv_tier_salt: str = option(
        "", "secret mixed into every KV tier key; changing it makes all stored blocks "
        "unreachable", server=True,
    )  # fmt: skip

    def check_options(self) -> None:
        """Choices and bounds from the declarations above; ValueError names the option."""
        hints = typing.get_type_hints(EngineOptions)
        for f in dataclasses.fields(EngineOptions):
            value = getattr(self, f.name)
            choices = literal_choices(hints[f.name])
            if choices and value is not None and value not in choices:
                listed = ", ".join(repr(c) for c in choices)
                raise ValueError(f"{f.name} must be one of {listed}, got {value!r}")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lo, hi = f.metadata["ge"], f.metadata["le"]
                if (lo is not None and value < lo) or (hi is not None and value > hi):
                    bounds = " and ".join(
                        s for s in (lo is not None and f">= {lo}", hi is not None and f"<= {hi}")
                        if s
                    )  # fmt: skip
                    raise ValueError(f"{f.name} must be {bounds}, got {value!r}")


def literal_choices(annotation: Any) -> tuple | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) allows, else None."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


@dataclass(frozen=True)
class ServerOption:
    """An engine option as the server exposes it."""

    name: str  # the EngineOptions field
    setting: str  # the Settings field (LORAPLEX_<SETTING>)
    annotation: Any
    default: Any
    help: str
    flag: str | None
    ge: float | None
    le: float | None

    def add_flag(self, parser: Any, *, default_note: str = "default: settings") -> None:
        """This option as an argparse flag of `parser` (dest: the setting's name), None
        unless given, so that the settings' own value (environment, file) stands."""
        kind = next((a for a in typing.get_args(self.annotation) if a is not type(None)), None)
        base = self.annotation if kind is None else kind
        choices = literal_choices(self.annotation)
        help = f"{self.help} ({default_note})"
        if base is bool:
            parser.add_argument(self.flag, dest=self.setting, action=argparse.BooleanOptionalAction,
                                default=None, help=help)  # fmt: skip
        elif choices:
            parser.add_argument(self.flag, dest=self.setting, choices=choices, help=help)
        else:
            parser.add_argument(self.flag, dest=self.setting, type=base, help=help)


def server_options() -> list[ServerOption]:
    hints = typing.get_type_hints(EngineOptions)
    out = []
    for f in dataclasses.fields(EngineOptions):
        m = f.metadata
        if not m["server"]:
            continue
        default = m["server_default"]
        if default is _UNSET:
            default = f.default if f.default is not _UNSET else f.default_factory()
        flag = m["flag"]
        if flag is True:
            flag = "--" + f.name.replace("_", "-")
        setting = m["setting"] or f.name
        out.append(ServerOption(f.name, setting, hints[f.name], default, m["help"],
                                flag or None, m["ge"], m["le"]))  # fmt: skip
    return out
