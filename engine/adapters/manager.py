"""Adapters in memory: device slots <- host LRU <- disk, loaded in the background.

    disk (the platform's cache of the store)
      --load (thread pool, started when a request is queued)--> host LRU (max_cpu_loras;
                                 adapters with requests queued or running are pinned;
                                 page-locked on CUDA so slot writes copy asynchronously)
      --activate (engine thread, at the step that needs it)--> device slots (max_loras),
                                 per-layer stacked tensors in every LoRALinear of the model

Only the engine thread touches `host`, `slots` and `loading`; a loader thread only reads files
and returns a `LoRAAdapter`, which `poll` installs. So a slow disk or store never stalls a
step: the scheduler admits a request only once its adapter is in host memory.

Slot layout (see kernels/reference.py): for a fused module with slices s_0..s_k, an adapter's
A matrices are stacked along the rank dimension and its B^T matrices form a block-diagonal
[width, out] matrix, scale folded in. A slot only holds the width the adapter uses.

DoRA (peft's use_dora): y = bias + m / ||W + B A||_row * (W x + B A x) per target module. The
factor m / ||W + B A||_row depends only on the adapter and the base weights, so the loader
thread computes it once per load (`dora_scales`, against the weights `base` multiplies by:
dequantized on a quantized base) and a slot holds it per output row in `lora_dora` (ones
where the slot's adapter has no DoRA on that module; `lora_dora_shift` = (1 - factor) * bias
where the module has a bias). `model.lora_dora_slots` says per slot whether its adapter uses
DoRA anywhere, for the step planner and the graph runner to skip the epilogue otherwise.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from loraplex.engine.adapters.lora import BaseProbe, LoRAAdapter, dora_scales, load_adapter
from loraplex.engine.errors import AdapterError, AdapterUnavailable
from loraplex.engine.models.decoder import DecoderLM
from loraplex.engine.models.layers import LoRALinear
from loraplex.engine.models.moe import Experts, SparseMoE
from loraplex.engine.models.spec import FUSED, SHARED_EXPERT
from loraplex.engine.sequence import LoRARequest

log = logging.getLogger("loraplex.engine")


def layer_modules(layer) -> dict[str, tuple[LoRALinear, tuple[str, ...]]]:
    """A decoder layer's LoRA-carrying linears: our name -> (module, the PEFT targets of its
    slices in order). Dense layers: q|k|v, o, gate|up, down; a routed layer: the router and a
    shared expert's gate|up and down instead of the MLP's."""
    mods = {}
    for name, (parent, slices) in FUSED.items():
        owner = getattr(layer, parent)
        if isinstance(owner, SparseMoE):
            continue
        mods[name] = (getattr(owner, name), slices)
    if isinstance(layer.mlp, SparseMoE):
        name = layer.mlp.router_name
        mods[name] = (getattr(layer.mlp, name), (name,))
        if layer.mlp.shared_expert is not None:
            for name in ("gate_up_proj", "down_proj"):
                targets = tuple(f"{SHARED_EXPERT}.{p}" for p in FUSED[name][1])
                mods[f"{SHARED_EXPERT}.{name}"] = (getattr(layer.mlp.shared_expert, name), targets)
    return mods


@dataclass
class AdapterCounters:
    hits: int = 0  # requests whose adapter was already in host memory
    misses: int = 0  # requests that had to wait for a load (started or joined)
    loads: int = 0  # loads that succeeded
    load_failures: int = 0
    load_seconds: float = 0.0  # summed wall time of successful loads
    slot_hits: int = 0  # a step found the adapter already in a device slot
    slot_writes: int = 0  # copies from host memory into a slot


def _read(lora: LoRARequest, spec, max_rank: int, dtype: torch.dtype, pin: bool,
          expert_lora: bool = True, base_rows=None):  # fmt: skip
    """Runs on a loader thread: read + validate, DoRA's factors against the base weights
    (`base_rows(layer, target)`, see `dora_scales`), then page-lock for async device copies."""
    start = time.monotonic()
    try:
        adapter = load_adapter(lora.lora_path, spec, max_rank, dtype, name=lora.lora_name)
    except OSError as e:  # an AdapterError (a bad adapter) passes through as it is
        raise AdapterUnavailable(f"adapter '{lora.lora_name}' could not be read: {e}") from e
    if adapter.experts and not expert_lora:
        raise AdapterError(
            f"adapter '{lora.lora_name}' adapts the experts, and this server runs with "
            "expert_lora off (attention and router adapters only)"
        )
    if adapter.use_dora:
        with torch.no_grad():
            adapter.dora = dora_scales(adapter, base_rows, dtype)
    if pin:
        adapter.dora = {k: v.pin_memory() for k, v in adapter.dora.items()}
        adapter.weights = {
            k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.weights.items()
        }
        adapter.experts = {
            k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.experts.items()
        }
    return adapter, time.monotonic() - start


class AdapterManager:
    def __init__(
        self,
        model: DecoderLM,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        load_workers: int = 2,
        expert_lora: bool = True,
    ):
        self.model, self.spec = model, model.spec
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.dtype = model.dtype
        self.pin = model.device.type == "cuda"
        self.modules: list[dict[str, LoRALinear]] = []
        self.slices: list[dict[str, tuple[str, ...]]] = []  # per layer: module -> its targets
        # per layer: the routed experts (None: a dense layer)
        self.experts: list[Experts | None] = [
            layer.mlp.experts if isinstance(layer.mlp, SparseMoE) else None
            for layer in model.model.layers
        ]
        for layer in model.model.layers:
            found = layer_modules(layer)
            # no slots (LoRA off: enable_lora=False): the modules keep no stacks, so that no
            # step runs LoRA on them
            mods = {name: mod for name, (mod, _) in found.items()} if max_loras else {}
            self.slices.append({name: targets for name, (_, targets) in found.items()})
            for name, mod in mods.items():
                width = len(found[name][1]) * max_rank
                dev = model.device  # one device for the whole model
                mod.lora_a = torch.zeros(
                    max_loras, width, mod.in_features, dtype=self.dtype, device=dev
                )
                mod.lora_b = torch.zeros(
                    max_loras, width, mod.out_features, dtype=self.dtype, device=dev
                )
                mod.lora_widths = [0] * max_loras
                # DoRA's factor per slot and output row, plus a last row of ones that rows
                # without an adapter (slot -1) index
                mod.lora_dora = torch.ones(
                    max_loras + 1, mod.out_features, dtype=self.dtype, device=dev
                )
                mod.lora_dora_shift = None if mod.bias is None else torch.zeros_like(mod.lora_dora)
                mod.lora_dora_on = set()
            self.modules.append(mods)
        self.dora_slots = [False] * max_loras  # per slot: its adapter uses DoRA
        model.lora_dora_slots = self.dora_slots  # read by the step planner and graph runner
        # Expert LoRA stacks for every slot, allocated now so that they come out of the
        # start's memory budget (engine/llm_engine.py) and never move (CUDA graphs).
        self.expert_lora = bool(expert_lora and max_loras) and any(
            ex is not None for ex in self.experts
        )
        if self.expert_lora:
            self._expert_stacks()
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self._slot_used = [0] * max_loras  # activation tick, for LRU slot reuse
        self._tick = 0
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.refs: dict[int, int] = {}  # lora_int_id -> requests queued or running
        self.loading: dict[int, Future] = {}
        self.counters = AdapterCounters()
        self._pool = ThreadPoolExecutor(load_workers, thread_name_prefix="loraplex-adapter-load")

    # Counters under their old names, for metrics and tests.
    @property
    def hits(self) -> int:
        return self.counters.hits

    @property
    def loads(self) -> int:
        return self.counters.loads

    @property
    def slot_writes(self) -> int:
        return self.counters.slot_writes

    @property
    def slot_bytes(self) -> int:
        dense = sum(
            m.lora_a.nbytes + m.lora_b.nbytes + m.lora_dora.nbytes
            + (0 if m.lora_dora_shift is None else m.lora_dora_shift.nbytes)
            for mods in self.modules for m in mods.values()
        )  # fmt: skip
        stacks = [ex for ex in self.experts if ex is not None and ex.lora_gate_up_a is not None]
        return dense + sum(
            t.nbytes
            for ex in stacks
            for t in (ex.lora_gate_up_a, ex.lora_gate_up_b, ex.lora_down_a, ex.lora_down_b)
        )

    def expert_slot_bytes(self) -> int:
        """What the expert LoRA stacks of all slots take once allocated: slots x experts x
        (2 x rank x (hidden + 2 x intermediate) + rank x (intermediate + hidden)) per routed
        layer, in the model's dtype."""
        s, r = self.max_loras, self.max_rank
        per = sum(ex.num_experts * (2 * r * (ex.hidden + 2 * ex.inter) + r * (ex.inter + ex.hidden))
                  for ex in self.experts if ex is not None)  # fmt: skip
        return s * per * self.dtype.itemsize

    def _expert_stacks(self) -> None:
        """Allocate every routed layer's expert LoRA stacks (all slots)."""
        log.info(
            "expert LoRA slots allocated: %.1f MiB for %d slots of rank %d",
            self.expert_slot_bytes() / 2**20, self.max_loras, self.max_rank,
        )  # fmt: skip
        s, r, dev = self.max_loras, self.max_rank, self.model.device
        for ex in self.experts:
            if ex is None:
                continue
            e, h, i = ex.num_experts, ex.hidden, ex.inter
            z = dict(dtype=self.dtype, device=dev)
            ex.lora_gate_up_a = torch.zeros(s, e, 2 * r, h, **z)
            ex.lora_gate_up_b = torch.zeros(s, e, 2 * r, 2 * i, **z)
            ex.lora_down_a = torch.zeros(s, e, r, i, **z)
            ex.lora_down_b = torch.zeros(s, e, r, h, **z)
            ex.lora_widths = [0] * s
            ex.lora_gate_up_widths, ex.lora_down_widths = [0] * s, [0] * s

    # ------------------------------------------------------------ host tier
    def acquire(self, lora: LoRARequest) -> None:
        """Pin an adapter for a new request and start loading it if it is not in memory."""
        lora_id = lora.lora_int_id
        self.refs[lora_id] = self.refs.get(lora_id, 0) + 1
        if lora_id in self.host:
            self.counters.hits += 1
            self.host.move_to_end(lora_id)
            return
        self.counters.misses += 1
        if lora_id not in self.loading:
            self.loading[lora_id] = self._pool.submit(
                _read, lora, self.spec, self.max_rank, self.dtype, self.pin, self.expert_lora,
                self._base_rows(),
            )  # fmt: skip

    def _base_rows(self):
        """A function (layer, PEFT target) -> float32 [out, in]: the base weight rows of that
        target, as the engine multiplies by them. For one adapter load on a loader thread (it
        only reads the model): it keeps the last module's weight, so the slices of a fused
        module (`dora_scales` takes them in a row) dequantize or probe it once."""
        last: dict[tuple[int, str], torch.Tensor | None] = {}

        def rows(layer: int, target: str) -> torch.Tensor | BaseProbe:
            for name, targets in self.slices[layer].items():
                if target in targets:
                    mod = self.modules[layer][name]
                    if (layer, name) not in last:
                        last.clear()
                        last[(layer, name)] = mod.base_weight()
                    idx = targets.index(target)
                    lo = sum(mod.out_sizes[:idx])
                    hi = lo + mod.out_sizes[idx]
                    w = last[(layer, name)]
                    if w is not None:
                        return w[lo:hi]
                    # a packed layer: its product gives W A^T (cheap at rank rows)
                    rows_of = slice(lo, hi)
                    return BaseProbe(
                        mod.weight_sq[rows_of],
                        lambda a, mod=mod, rows_of=rows_of: mod.base_probe(a)[rows_of],
                    )
            raise AdapterError(f"layers.{layer}.{target}: not a module this model serves LoRA on")

        return rows

    def loaded(self, lora_id: int) -> bool:
        return lora_id in self.host

    def poll(self) -> dict[int, Exception]:
        """Install finished loads in host memory; returns the failed ones (id -> error)."""
        failed = {}
        for lora_id, fut in list(self.loading.items()):
            if not fut.done():
                continue
            del self.loading[lora_id]
            err = fut.exception()
            if err is not None:
                self.counters.load_failures += 1
                failed[lora_id] = err
                continue
            adapter, seconds = fut.result()
            self.counters.loads += 1
            self.counters.load_seconds += seconds
            if lora_id in self.refs:  # nobody waits for it any more: let it go
                self.host[lora_id] = adapter
        self._evict_host()
        return failed

    def wait(self, lora_id: int, timeout: float | None = None) -> None:
        """Block until the load of `lora_id` is done (offline use); `poll` then takes it in."""
        fut = self.loading.get(lora_id)
        if fut is not None:
            wait([fut], timeout)

    def wait_any(self, timeout: float) -> None:
        """Sleep until some load finishes or `timeout` passes (for an otherwise idle step)."""
        if self.loading:
            wait(list(self.loading.values()), timeout, return_when="FIRST_COMPLETED")

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ device tier
    def activate(self, ids: set[int], in_use: set[int] = frozenset()) -> dict[int, int]:
        """Make every adapter in `ids` resident in a slot; returns lora_int_id -> slot.

        `in_use` names the adapters of every running request (a superset of `ids`); their
        slots are never reused, so a running request keeps its adapter between steps. Of the
        other slots, an empty one is taken first, then the least recently used.
        """
        keep = set(ids) | set(in_use)
        assert len(keep) <= self.max_loras, "scheduler exceeded the adapter-slot cap"
        self._tick += 1
        for lora_id in ids:
            if lora_id in self.slots:
                self.counters.slot_hits += 1
            else:
                free = [i for i, s in enumerate(self.slots) if s is None or s not in keep]
                slot = min(free, key=lambda i: (self.slots[i] is not None, self._slot_used[i]))
                self._write_slot(slot, self.host[lora_id])
                self.slots[slot] = lora_id
            self._slot_used[self.slots.index(lora_id)] = self._tick
        return {lora_id: self.slots.index(lora_id) for lora_id in ids}

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        self.counters.slot_writes += 1
        if adapter.use_dora and not adapter.dora:  # loaded elsewhere than `_read`
            with torch.no_grad():
                adapter.dora = dora_scales(adapter, self._base_rows(), self.dtype)
        with torch.no_grad():
            for layer, mods in enumerate(self.modules):
                if self.experts[layer] is not None:
                    self._write_experts(self.experts[layer], slot, layer, adapter)
                for name, mod in mods.items():
                    old = mod.lora_widths[slot]
                    mod.lora_a[slot, :old].zero_()
                    mod.lora_b[slot, :old].zero_()
                    width = 0
                    for idx, target in enumerate(self.slices[layer][name]):
                        w = adapter.weights.get((layer, target))
                        if w is None:
                            continue
                        a, b = w  # [r, in], [out_i, r]
                        r = a.shape[0]
                        off = sum(mod.out_sizes[:idx])
                        # From page-locked memory on CUDA: queued on the stream, no host wait.
                        mod.lora_a[slot, width : width + r].copy_(a, non_blocking=True)
                        mod.lora_b[slot, width : width + r, off : off + b.shape[0]].copy_(
                            b.T, non_blocking=True
                        )
                        width += r
                    mod.lora_widths[slot] = width
                    self._write_dora(mod, slot, layer, name, adapter)
            self.dora_slots[slot] = adapter.use_dora

    def _write_dora(self, mod: LoRALinear, slot: int, layer: int, name: str,
                    adapter: LoRAAdapter) -> None:  # fmt: skip
        """The slot's DoRA factors for this module (ones where it has none) and, with a bias,
        (1 - factor) * bias, so that y * factor + shift = bias + factor * (y - bias)."""
        if slot in mod.lora_dora_on:
            mod.lora_dora[slot].fill_(1)
            if mod.lora_dora_shift is not None:
                mod.lora_dora_shift[slot].zero_()
            mod.lora_dora_on.discard(slot)
        for idx, target in enumerate(self.slices[layer][name]):
            scale = adapter.dora.get((layer, target))
            if scale is None:
                continue
            off = sum(mod.out_sizes[:idx])
            rows = slice(off, off + scale.shape[0])
            mod.lora_dora[slot, rows].copy_(scale, non_blocking=True)
            if mod.lora_dora_shift is not None:
                factor = mod.lora_dora[slot, rows]
                mod.lora_dora_shift[slot, rows] = (1 - factor) * mod.bias[rows].to(factor.dtype)
            mod.lora_dora_on.add(slot)

    def _write_experts(self, ex: Experts, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        """Expert LoRA into slot `slot`: gate and up stacked along the rank (their B rows in
        the gate and up halves of the output), down on its own; zeros where not targeted."""
        if ex.lora_gate_up_a is None:
            return
        if ex.lora_widths[slot]:
            for t in (ex.lora_gate_up_a, ex.lora_gate_up_b, ex.lora_down_a, ex.lora_down_b):
                t[slot].zero_()
        width, down_width, i = 0, 0, ex.inter
        gate_up, down = (ex.lora_gate_up_a, ex.lora_gate_up_b), (ex.lora_down_a, ex.lora_down_b)
        places = [("gate_up_proj", gate_up, 0), ("gate_proj", gate_up, 0),
                  ("up_proj", gate_up, i), ("down_proj", down, 0)]  # fmt: skip
        for proj, (a_t, b_t), col in places:
            w = adapter.experts.get((layer, proj))
            if w is None:
                continue
            a, b = w  # [experts, r, in], [experts, out, r]
            r = a.shape[1]
            off = width if proj != "down_proj" else 0
            a_t[slot, :, off : off + r].copy_(a, non_blocking=True)
            b_t[slot, :, off : off + r, col : col + b.shape[1]].copy_(
                b.transpose(1, 2), non_blocking=True
            )
            if proj == "down_proj":
                down_width = r
            else:
                width += r
        ex.lora_widths[slot] = width + down_width
        ex.lora_gate_up_widths[slot], ex.lora_down_widths[slot] = width, down_width
