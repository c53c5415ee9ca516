"""Adapters in memory: a host LRU of loaded adapters and the device slots a step uses.

    store/disk --load_adapter--> host cache (LRU, max_cpu_loras; adapters with requests
                                             in flight are pinned)
               --activate-----> device slots (max_loras), per-layer stacked tensors
                                installed in every LoRALinear of the model

Slot layout (see kernels/reference.py): for a fused module with slices s_0..s_k, an adapter's
A matrices are stacked along the rank dimension and its B^T matrices form a block-diagonal
[width, out] matrix, scale folded in. A slot only holds the width the adapter uses.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from loraplex.engine.lora import GROUPS, LoRAAdapter, load_adapter
from loraplex.engine.models.decoder import DecoderLM
from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.sequence import LoRARequest

_SLICES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


class AdapterManager:
    def __init__(self, model: DecoderLM, max_loras: int, max_rank: int, max_cpu_loras: int):
        self.model, self.spec = model, model.spec
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype = model.lm_head.weight.dtype
        self.modules: list[dict[str, LoRALinear]] = []
        for layer in model.model.layers:
            mods = {
                "qkv_proj": layer.self_attn.qkv_proj,
                "o_proj": layer.self_attn.o_proj,
                "gate_up_proj": layer.mlp.gate_up_proj,
                "down_proj": layer.mlp.down_proj,
            }
            for name, mod in mods.items():
                width = _SLICES[name] * max_rank
                dev = mod.weight.device
                mod.lora_a = torch.zeros(
                    max_loras, width, mod.weight.shape[1], dtype=self.dtype, device=dev
                )
                mod.lora_b = torch.zeros(
                    max_loras, width, mod.weight.shape[0], dtype=self.dtype, device=dev
                )
                mod.lora_widths = [0] * max_loras
            self.modules.append(mods)
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.refs: dict[int, int] = {}
        self.hits = self.loads = self.slot_writes = 0

    @property
    def slot_bytes(self) -> int:
        return sum(
            m.lora_a.nbytes + m.lora_b.nbytes for mods in self.modules for m in mods.values()
        )

    def acquire(self, lora: LoRARequest) -> LoRAAdapter:
        """Load (or find) an adapter for a new request and pin it in host memory."""
        adapter = self.host.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_adapter(
                lora.lora_path, self.spec, self.max_rank, self.dtype, name=lora.lora_name
            )
            self.loads += 1
            self.host[lora.lora_int_id] = adapter
        else:
            self.hits += 1
            self.host.move_to_end(lora.lora_int_id)
        self.refs[lora.lora_int_id] = self.refs.get(lora.lora_int_id, 0) + 1
        self._evict_host()
        return adapter

    def release(self, lora: LoRARequest) -> None:
        n = self.refs.get(lora.lora_int_id, 0) - 1
        if n <= 0:
            self.refs.pop(lora.lora_int_id, None)
        else:
            self.refs[lora.lora_int_id] = n
        self._evict_host()

    def _evict_host(self) -> None:
        for key in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if key not in self.refs and key not in self.slots:
                del self.host[key]

    def activate(self, ids: set[int]) -> dict[int, int]:
        """Make every adapter in `ids` resident in a slot; returns lora_int_id -> slot.

        Slots whose adapter is not needed now are reused, so needed ones are never evicted.
        """
        assert len(ids) <= self.max_loras, "scheduler exceeded the adapter-slot cap"
        for lora_id in ids:
            if lora_id in self.slots:
                continue
            slot = next((i for i, s in enumerate(self.slots) if s is None or s not in ids), None)
            assert slot is not None
            self._write_slot(slot, self.host[lora_id])
            self.slots[slot] = lora_id
        return {lora_id: self.slots.index(lora_id) for lora_id in ids}

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        self.slot_writes += 1
        with torch.no_grad():
            for layer, mods in enumerate(self.modules):
                for name, mod in mods.items():
                    old = mod.lora_widths[slot]
                    mod.lora_a[slot, :old].zero_()
                    mod.lora_b[slot, :old].zero_()
                    width = 0
                    for target, (group, idx) in GROUPS.items():
                        w = adapter.weights.get((layer, target))
                        if group != name or w is None:
                            continue
                        a, b = w  # [r, in], [out_i, r]
                        r = a.shape[0]
                        off = sum(mod.out_sizes[:idx])
                        mod.lora_a[slot, width : width + r] = a
                        mod.lora_b[slot, width : width + r, off : off + b.shape[0]] = b.T
                        width += r
                    mod.lora_widths[slot] = width
