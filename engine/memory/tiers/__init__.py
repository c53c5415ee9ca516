"""KV tiers below the device pool: host memory, local disk and a store replicas share
(engine/memory/tiers/manager.py; docs/kv-tiers.md). `attach` builds them from an engine's
options, or returns None when none is configured."""

from __future__ import annotations

import logging

from loraplex.engine.memory.tiers.keys import model_identity
from loraplex.engine.memory.tiers.layout import KVLayout
from loraplex.engine.memory.tiers.manager import KVTiers, TierCounters
from loraplex.engine.memory.tiers.stores import DiskStore, HostStore, shared_store

__all__ = ["KVTiers", "TierCounters", "attach"]

log = logging.getLogger("loraplex.engine.kv_tiers")
GIB = 2**30


def attach(engine) -> KVTiers | None:
    """The engine's tiers per its config (kv_tier_* options), wired to its scheduler and
    block manager; None when no tier is configured or prefix caching is off."""
    cfg = engine.config
    if not cfg.enable_prefix_caching:
        return None
    stores = []
    if cfg.kv_tier_host_gib > 0:
        stores.append(HostStore(int(cfg.kv_tier_host_gib * GIB)))
    if cfg.kv_tier_disk_path:
        stores.append(DiskStore(cfg.kv_tier_disk_path, int(cfg.kv_tier_disk_gib * GIB)))
    if cfg.kv_tier_shared_url:
        stores.append(shared_store(cfg.kv_tier_shared_url, cfg.kv_tier_ttl_s))
    if not stores:
        return None
    model = engine.model
    quant = getattr(model, "quantization", None)
    model_id = model_identity(cfg.model, str(model.dtype), quant)
    layout = KVLayout(engine.runner.attentions, cfg.block_size)
    tiers = KVTiers(stores, layout, engine.block_manager, model_id, cfg.kv_tier_salt)
    engine.scheduler.tiers = tiers
    log.info("KV tiers: %s; %d bytes a block", ", ".join(s.name for s in stores),
             layout.block_bytes)  # fmt: skip
    return tiers
