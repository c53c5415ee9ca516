"""The embedded default's demo tenant: created once with a key, and given the demo adapters."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loraplex.engine import spec_from_config
from loraplex.platform.adapter_service import store_and_register
from loraplex.platform.db import crud
from loraplex.platform.demo.adapters import prepare_demo_adapters
from loraplex.platform.state import AppState
from loraplex.platform.uploads.validate import validate_adapter

TENANT = "demo"
log = logging.getLogger("loraplex.platform")


def bootstrap_demo(
    state: AppState, model_dir: Path, *, adapters: bool
) -> tuple[str | None, list[str]]:
    """(the new key's secret, or None if the tenant existed; the demo adapter names it has)."""
    secret = None
    with state.sessions() as session:
        tenant = crud.get_tenant_by_name(session, name=TENANT)
        if tenant is None:
            tenant = crud.create_tenant(session, name=TENANT)
            secret, _ = crud.create_key(session, tenant_id=tenant.id, name=TENANT)
        tenant_id = tenant.id
    names = register_demo_adapters(state, tenant_id, model_dir) if adapters else []
    return secret, names


def register_demo_adapters(state: AppState, tenant_id: int, model_dir: Path) -> list[str]:
    """Train (once, cached in the data dir) and register the demo adapters the tenant lacks.

    They go through the same validation, store and registry as an upload."""
    settings = state.settings
    folders = prepare_demo_adapters(model_dir, settings.data_dir / "demo-adapters")
    spec = spec_from_config(json.loads((model_dir / "config.json").read_text()))
    for name, folder in folders.items():
        with state.sessions() as session:
            if crud.get_adapter(session, tenant_id=tenant_id, name=name) is not None:
                continue  # kept as it is, also if the operator replaced it
        info = validate_adapter(
            folder,
            spec,
            max_rank=settings.max_lora_rank,
            base_model_name=state.model_name,
            max_bytes=settings.max_upload_bytes,
        )
        store_and_register(state, tenant_id, name, folder, info)
        log.info("registered demo adapter %r for tenant %r", name, TENANT)
    return list(folders)
