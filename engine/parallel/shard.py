"""How the base model and its adapters split over the ranks (Megatron's layout, S-LoRA's
adapters).

Each rank keeps a decoder of its own, built from a *local* spec: 1/N of the attention heads
(q and kv), 1/N of the MLP's intermediate size. So its q|k|v and gate|up projections are
column-parallel (their output rows split: rank r keeps heads r*h/N.. and intermediate rows
r*i/N.. of every slice), and its o and down projections row-parallel (their input columns
split the same way): each rank's o and down give a partial sum of the full output, which an
all-reduce (`install_all_reduce`) completes. Embeddings, norms, RoPE tables and the LM head
are whole on every rank; a row-parallel bias is added once, on rank 0. A rank's KV cache
holds its own kv heads only, so a KV block costs 1/N of the bytes on each rank; a model with
fewer kv heads than ranks keeps on each rank the kv head its query heads read (replicated, as
vLLM does: no KV bytes saved there).

Adapters split the way their base layer does (S-LoRA): on a column-parallel target B's rows
(its output) are split and A is whole; on a row-parallel target A's columns (its input) are
split and B is whole, and the all-reduce after the layer sums the LoRA term's partial sums
with the base's (x_r A_r^T B summed over r is x A^T B). No collective of its own, except in
bf16 / fp16 (`_float32_output`): there the shrink's partials x_r A_r^T are all-reduced in
float32 and rounded once before the expand, as one device rounds them.

A mixture of experts splits every expert the way an MLP splits (1/N of each expert's
intermediate rows; Qwen2-MoE's shared expert too), the router whole on every rank (each rank
routes every token alike), and one all-reduce after the whole routed block. Expert adapters
are not split yet (refused); attention, router and shared-expert adapters are.
"""

from __future__ import annotations

import dataclasses

import torch

from loraplex.engine.adapters.lora import LoRAAdapter
from loraplex.engine.errors import AdapterError
from loraplex.engine.models.decoder import DecoderLM
from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.moe import SparseMoE
from loraplex.engine.models.packing import PackedLoRALinear
from loraplex.engine.models.spec import ModelSpec

COLUMN = ("qkv_proj", "gate_up_proj")  # our fused modules whose output rows split
ROW = ("o_proj", "down_proj")  # whose input columns split (followed by the all-reduce)
# PEFT targets on each side (an adapter's weights are keyed by the split names)
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_TARGETS = ("o_proj", "down_proj")


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """One rank's share of the model; ValueError where the model does not split into `world`."""
    sizes = [("attention heads", spec.num_heads), ("intermediate_size", spec.intermediate_size)]
    if spec.is_moe:
        sizes += [("moe_intermediate_size", spec.moe_intermediate_size),
                  ("shared expert's intermediate size", spec.shared_expert_size)]  # fmt: skip
    for what, n in sizes:
        if n % world:
            raise ValueError(f"tensor_parallel_size {world} must divide the model's {what} ({n})")
    kv = spec.num_kv_heads
    if kv % world and world % kv:
        raise ValueError(
            f"tensor_parallel_size {world} and the model's {kv} kv heads: one must divide the other"
        )
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // world,
        num_kv_heads=max(kv // world, 1),
        intermediate_size=spec.intermediate_size // world,
        moe_intermediate_size=spec.moe_intermediate_size // world,
        shared_expert_size=spec.shared_expert_size // world,
    )


def head_share(t: torch.Tensor, heads: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s share of `t`'s dim 0, `heads` groups of rows (heads, or intermediate
    rows): 1/world of them; with fewer kv heads than ranks (world a multiple of heads), the one
    kv head its query heads read, as vLLM replicates them."""
    if heads % world == 0:
        return t.chunk(world)[rank]
    return t.chunk(heads)[rank * heads // world]


def _rows(t: torch.Tensor, sizes: list[int], heads: list[int], rank: int,
          world: int) -> torch.Tensor:  # fmt: skip
    """Rank `rank`'s share of each slice of `t` (dim 0 split into `sizes`, slice i of
    heads[i] groups), concatenated."""
    parts = t.split(sizes)
    return torch.cat([head_share(p, n, rank, world) for p, n in zip(parts, heads, strict=True)])


@torch.no_grad()
def shard_model(full: DecoderLM, rank: int, world: int) -> DecoderLM:
    """Rank `rank`'s decoder, its weights copied out of `full` (float weights, before any
    packing or quantization). It keeps `full_spec` (what adapters are checked against)."""
    spec = full.spec
    lspec = local_spec(spec, world)
    with torch.device("meta"):
        local = DecoderLM(lspec).to(full.dtype)
    local = local.to_empty(device=full.device)
    if spec.tie_embeddings:
        local.lm_head.weight = local.model.embed_tokens.weight
    src = dict(full.named_parameters())
    for name, p in local.named_parameters():
        t = src[name]
        *owner, mod, leaf = name.split(".")
        if mod == "experts":  # [experts, 2i, h] gate|up rows, [experts, h, i] down columns
            if leaf.startswith("gate_up_proj"):
                t = torch.cat([g.chunk(world, dim=1)[rank] for g in t.chunk(2, dim=1)], dim=1)
            elif leaf == "down_proj":
                t = t.chunk(world, dim=2)[rank]
            elif leaf == "down_proj_bias" and rank:
                t = torch.zeros_like(t)
        elif mod in COLUMN:
            sizes = full.get_submodule(".".join([*owner, mod])).out_sizes
            heads = ([spec.num_heads, spec.num_kv_heads, spec.num_kv_heads]
                     if mod == "qkv_proj" else [world, world])  # fmt: skip
            t = _rows(t, sizes, heads, rank, world)
        elif mod in ROW and leaf == "weight":
            t = t.chunk(world, dim=1)[rank]
        elif mod in ROW and leaf == "bias" and rank:
            t = torch.zeros_like(t)
        elif leaf == "sinks":
            t = t.chunk(world)[rank]
        if t.shape != p.shape:
            raise AssertionError(f"{name}: shard {tuple(t.shape)} != {tuple(p.shape)}")
        p.copy_(t)
    local.full_spec = spec
    local.tp_rank, local.tp_world = rank, world
    # bf16 / fp16: the row-parallel weights in float32, taken before any packing or
    # quantization, for their float32 partial sums (`install_all_reduce`)
    local.tp_float32 = {}
    if local.dtype in (torch.float16, torch.bfloat16):
        for i, layer in enumerate(local.model.layers):
            row = [("self_attn.o_proj", layer.self_attn.o_proj)]
            if not isinstance(layer.mlp, SparseMoE):
                row.append(("mlp.down_proj", layer.mlp.down_proj))
            for name, mod in row:
                local.tp_float32[f"{i}.{name}"] = mod.weight.detach().float()
    return local


def shard_adapter(adapter: LoRAAdapter, spec: ModelSpec, rank: int, world: int) -> LoRAAdapter:
    """Rank `rank`'s share of an adapter read against the whole model `spec` (see the module
    doc)."""
    router = spec.router_name
    if adapter.use_dora or adapter.experts:
        what = "DoRA" if adapter.use_dora else "expert LoRA"
        raise AdapterError(
            f"adapter '{adapter.name}': {what} is not served with tensor_parallel_size > 1 yet"
        )
    weights = {}
    for (layer, target), (a, b) in adapter.weights.items():
        proj = target.rpartition(".")[2]  # a shared expert's: shared_expert.gate_proj, ...
        if proj in COLUMN_TARGETS:
            heads = spec.num_kv_heads if proj in ("k_proj", "v_proj") else world
            b = head_share(b, heads, rank, world)
        elif proj in ROW_TARGETS:
            a = a.chunk(world, dim=1)[rank]
        elif proj != router:  # the router is whole on every rank, and so is its adapter
            raise AdapterError(f"adapter '{adapter.name}': {target} cannot be split by rank")
        weights[(layer, target)] = (a.contiguous(), b.contiguous())
    return dataclasses.replace(adapter, weights=weights)


def _float32_output(mod, w32: torch.Tensor, all_reduce) -> None:
    """Make a row-parallel LoRALinear of a bf16 / fp16 model sum its output over the ranks
    the way one device rounds it: x W^T (and the bias, rank 0's) multiplied in float32
    against `w32`, a float32 copy of its weight shard, all-reduced in float32 and rounded
    once; then, in a step with adapters, the LoRA shrink x A^T likewise (each rank's half of
    the input against its half of A, in float32, all-reduced, rounded once) and its expand by
    the whole B added by the backend's own kernel, as on one device. The shrink and expand run
    the module's kernels against identity stacks (the identity's products are exact), so the
    step's LoRA plan serves both. A step with adapters costs one more all-reduce of [tokens,
    max rank] per module."""
    b32 = None if mod.bias is None else mod.bias.detach().float()
    eyes: dict = {}

    def eye(dtype):
        n_slots, width, _ = mod.lora_a.shape
        if dtype not in eyes:
            e = torch.eye(width, dtype=dtype, device=w32.device)
            eyes[dtype] = e.expand(n_slots, width, width).contiguous()
        return eyes[dtype]

    def lora_term(y, x, lora, a, b):
        if lora.static:
            mod.backend.lora_apply_static(y, x, a, b, lora.row_slots)
        else:
            plan = lora.plans.get(tuple(mod.lora_widths))
            mod.backend.lora_apply(y, x, a, b, lora.segments, mod.lora_widths, plan=plan)

    def forward(x, lora):
        y32 = torch.matmul(x.float(), w32.t())
        if b32 is not None:
            y32 += b32
        all_reduce(y32)
        y = y32.to(x.dtype)
        if lora is not None and mod.lora_a is not None:
            t32 = y32.new_zeros(x.shape[0], mod.lora_a.shape[1])
            lora_term(t32, x.float(), lora, mod.lora_a.float(), eye(torch.float32))  # x A^T
            all_reduce(t32)
            lora_term(y, t32.to(x.dtype), lora, eye(x.dtype), mod.lora_b)  # + (x A^T) B
        return y

    mod.forward = forward


def install_all_reduce(model: DecoderLM, all_reduce) -> list:
    """After every row-parallel module (o_proj, down_proj) of the loaded (packed, quantized)
    model: `all_reduce(t)` sums its output over the ranks. The sum is taken in float32
    whatever the dtype; in bf16 / fp16 a dense layer's o and down products (not quantized
    ones) are made in float32 too (`_float32_output`), so each rank's partial is not
    rounded before the sum. Returns the hooks' handles."""

    def hook(_module, _args, out: torch.Tensor):
        if out.dtype == torch.float32:
            all_reduce(out)
            return None
        acc = out.float()
        all_reduce(acc)
        out.copy_(acc)
        return None

    weights32 = getattr(model, "tp_float32", {})
    handles = []
    for i, layer in enumerate(model.model.layers):
        # a routed layer: once after the whole block (experts and shared expert are both
        # split by intermediate rows, and the block's output is linear in their partial sums)
        mlp = layer.mlp if isinstance(layer.mlp, SparseMoE) else layer.mlp.down_proj
        for name, mod in (("self_attn.o_proj", layer.self_attn.o_proj), ("mlp.down_proj", mlp)):
            # plain or pre-packed (the same weights); a quantized one multiplies its own
            w32 = weights32.get(f"{i}.{name}")
            if w32 is not None and type(mod) in (LoRALinear, PackedLoRALinear):
                _float32_output(mod, w32, all_reduce)  # its own all-reduces
            else:
                handles.append(mod.register_forward_hook(hook))
    return handles
