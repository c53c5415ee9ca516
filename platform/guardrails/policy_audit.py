"""A policy's edits in the audit trail: each change of a policy (the operator's PATCH, or the
tenant's opt-in to recorded text) is one `GuardrailEvent` beside the policy's decisions, with
action `policy_edit`, stage `policy`, rule `edit:<field>,<field>...` (the fields that changed),
the key that made it (none for the operator) and, as its text, each changed field's old and new
value as JSON. An edit that changes nothing writes nothing. Billing counts never include these
(they count blocks, redactions, flags and fail-opens only)."""

from __future__ import annotations

import json
import secrets

from sqlalchemy.orm import Session

from loraplex.platform.db.models import GuardrailEvent, GuardrailPolicy
from loraplex.platform.guardrails.audit import EDIT, TEXT_LIMIT, log


def record_edit(session: Session, row: GuardrailPolicy, values: dict, *, tenant_id: int,
                key_id: int | None, route: str) -> dict:  # fmt: skip
    """Set `values` on `row` and add the edit's event to `session` (the caller commits both in
    one transaction). Returns field -> [old, new] of what changed."""
    changed = {k: [getattr(row, k), v] for k, v in values.items() if getattr(row, k) != v}
    if not changed:
        return changed
    for k, (_, new) in changed.items():
        setattr(row, k, new)
    request_id = f"edit-{secrets.token_hex(8)}"
    session.add(
        GuardrailEvent(
            tenant_id=tenant_id,
            api_key_id=key_id,
            policy_id=row.id,
            policy_name=row.name,
            rule=("edit:" + ",".join(sorted(changed)))[:200],
            stage="policy",
            action=EDIT,
            request_id=request_id,
            route=route,
            text=json.dumps(changed, sort_keys=True)[:TEXT_LIMIT],
        )
    )
    log.info("guardrail policy %s edited", row.id,
             extra={"request_id": request_id, "tenant_id": tenant_id, "policy": row.name,
                    "rule": ",".join(sorted(changed)), "stage": "policy"})  # fmt: skip
    return changed
