"""The audit trail: one `GuardrailEvent` row per block, redaction, flag or fail-open, with
the rule, request id, tenant, key and time; the text only where the policy records text."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import GuardrailEvent

log = logging.getLogger("loraplex.guardrails")
TEXT_LIMIT = 2000  # characters of recorded text per event
EDIT = "policy_edit"  # the action of a policy's edit (policy_audit.py): in the trail, not a count


@dataclass(frozen=True)
class Event:
    policy_id: int
    policy_name: str
    rule: str
    stage: str  # input | output
    action: str  # block | redact | flag | fail_open
    text: str | None  # None unless the policy records text


def write(state, *, tenant_id: int, key_id: int | None, request_id: str, route: str,
          events: list[Event]) -> None:  # fmt: skip
    """Rows for `events`, in one transaction. A database error is logged, never raised: the
    decision was already made and enforced; the answer must not turn into a 500."""
    if not events:
        return
    try:
        with state.sessions() as session:
            session.add_all(
                GuardrailEvent(
                    tenant_id=tenant_id,
                    api_key_id=key_id,
                    policy_id=e.policy_id,
                    policy_name=e.policy_name,
                    rule=e.rule[:200],
                    stage=e.stage,
                    action=e.action,
                    request_id=request_id[:80],
                    route=route[:16],
                    text=None if e.text is None else e.text[:TEXT_LIMIT],
                )  # fmt: skip
                for e in events
            )
            session.commit()
    except Exception:
        log.exception("guardrail events of %s not written", request_id)
    for e in events:
        log.info(
            "guardrail %s", e.action,
            extra={"request_id": request_id, "tenant_id": tenant_id, "policy": e.policy_name,
                   "rule": e.rule, "stage": e.stage},
        )  # fmt: skip


def list_events(session: Session, *, tenant_id: int | None, limit: int = 100,
                request_id: str | None = None) -> list[GuardrailEvent]:  # fmt: skip
    q = select(GuardrailEvent).order_by(GuardrailEvent.id.desc()).limit(limit)
    if tenant_id is not None:
        q = q.where(GuardrailEvent.tenant_id == tenant_id)
    if request_id is not None:
        q = q.where(GuardrailEvent.request_id == request_id)
    return list(session.scalars(q))


def counts(session: Session, *, start: datetime, end: datetime,
           tenant_id: int | None = None) -> dict[int, dict[str, int]]:  # fmt: skip
    """tenant id -> action -> events in [start, end): what the billing export counts (the
    decisions; a policy's edits are not)."""
    q = (
        select(GuardrailEvent.tenant_id, GuardrailEvent.action, func.count())
        .where(GuardrailEvent.created_at >= start, GuardrailEvent.created_at < end)
        .where(GuardrailEvent.action != EDIT)
        .group_by(GuardrailEvent.tenant_id, GuardrailEvent.action)
    )
    if tenant_id is not None:
        q = q.where(GuardrailEvent.tenant_id == tenant_id)
    out: dict[int, dict[str, int]] = {}
    for tenant, action, n in session.execute(q):
        out.setdefault(tenant, {})[action] = n
    return out
