"""One request's policies: loaded once when the route starts, asked for the input's verdict
and (through `stream.OutputFilter`) for each output window's.

A policy's hits combine as: any block blocks; else every redaction's spans are replaced; flags
only leave events. A guard adapter that gives no verdict follows its policy's `fail_mode`:
"closed" acts as if the guard said unsafe (the policy's action, rule `guard_unavailable:…`),
"open" lets the text through and leaves a `fail_open` event. Never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from sqlalchemy import or_, select

from loraplex.engine import LoRARequest
from loraplex.platform.db.models import GuardrailPolicy, Tenant
from loraplex.platform.errors import APIError
from loraplex.platform.guardrails import audit
from loraplex.platform.guardrails.audit import Event
from loraplex.platform.guardrails.checks import Checks, redact
from loraplex.platform.guardrails.guard import (
    GuardFailed,
    GuardSpec,
    resolve_guard,
    unsafe_probability,
)

log = logging.getLogger("loraplex.guardrails")
CONTENT_FILTER = "content_filter"  # the error code of a blocked input, the finish_reason of output


@dataclass(frozen=True)
class Policy:
    id: int
    name: str
    stages: str
    action: str
    checks: Checks
    guard: GuardSpec | None
    fail_mode: str
    record_text: bool

    def on(self, stage: str) -> bool:
        return self.stages in (stage, "both")


@dataclass
class Verdict:
    """What the policies say of one text: block at `cut` (a char offset; 0 for a guard or a
    fail-closed guard), else the spans to redact; and the events to record."""

    block: bool = False
    cut: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def load_policies(state, tenant_id: int, key_id: int | None) -> list[Policy]:
    with state.sessions() as session:
        rows = session.scalars(
            select(GuardrailPolicy)
            .where(GuardrailPolicy.tenant_id == tenant_id)
            .where(or_(GuardrailPolicy.api_key_id.is_(None), GuardrailPolicy.api_key_id == key_id))
            .order_by(GuardrailPolicy.id)
        ).all()
        policies = []
        for r in rows:
            guard = None
            if r.guard_adapter:
                # Set at creation (the policy's own tenant by default): null only once its
                # owner is deleted, never a fallback to an adapter of the same name elsewhere.
                owner = session.get(Tenant, r.guard_tenant_id) if r.guard_tenant_id else None
                if owner is not None:
                    session.expunge(owner)
                    guard = GuardSpec(r.guard_adapter, owner, r.guard_threshold)
                else:  # its owner was deleted: a guard that can never answer
                    guard = GuardSpec(r.guard_adapter, Tenant(id=-1, weight=1.0), 1.0)
            checks = Checks.build(r.terms or [], r.patterns or [], r.pii or [])
            policies.append(Policy(r.id, r.name, r.stages, r.action, checks, guard,
                                   r.fail_mode, r.record_text))  # fmt: skip
        return policies


class Gate:
    def __init__(self, state, caller, route: str, policies: list[Policy]) -> None:
        self.state, self.caller, self.route, self.policies = state, caller, route, policies
        self.held: list[Event] = []  # input events, recorded once the request has its id
        # policy id -> its guard, resolved once (or why it could not be)
        self.loras: dict[int, LoRARequest | GuardFailed] = {}
        self.failed_open: set[tuple[int, str]] = set()  # (policy id, stage) recorded

    @classmethod
    async def load(cls, state, caller, route: str) -> Gate | None:
        policies = await asyncio.to_thread(
            load_policies, state, caller.tenant.id, getattr(caller.key, "id", None)
        )
        return cls(state, caller, route, policies) if policies else None

    def has(self, stage: str) -> bool:
        return any(p.on(stage) for p in self.policies)

    def redacts_output(self) -> bool:
        return any(p.on("output") and p.action == "redact" for p in self.policies)

    # ------------------------------------------------------------ verdicts
    async def evaluate(self, stage: str, text: str, start: int = 0, new_from: int = 0) -> Verdict:
        """The verdict on `text`, of which `text[:start]` was sent already (context only) and
        `text[:new_from]` judged before: hits ending there are left out (their events were
        recorded), spans are clipped to begin at `start` at the earliest."""
        v = Verdict(cut=len(text))
        new_from = max(new_from, start)
        for p in self.policies:
            if not p.on(stage):
                continue
            hits = [(h.rule, max(h.start, start), h.end) for h in p.checks.scan(text)
                    if h.end > new_from]  # fmt: skip
            if p.guard is not None:
                hit = await self._guard(p, stage, text, start, v)
                if hit is not None:
                    hits.append(hit)
            for rule, s, e in hits:
                shown = text[s:e] if p.record_text else None
                v.events.append(Event(p.id, p.name, rule, stage, p.action, shown))
                if p.action == "block":
                    v.block, v.cut = True, min(v.cut, s)
                elif p.action == "redact":
                    v.spans.append((s, e))
        return v

    async def _guard(self, p: Policy, stage: str, text: str, start: int, v: Verdict):
        try:
            if p.id not in self.loras:
                self.loras[p.id] = await resolve_guard(self.state, p.guard)
            lora = self.loras[p.id]
            if isinstance(lora, GuardFailed):  # a lookup fails once per request, not per window
                raise lora
            prob = await unsafe_probability(self.state, p.guard, lora, text)
        except GuardFailed as e:
            self.loras.setdefault(p.id, e)
            rule = f"guard_unavailable:{p.guard.adapter}"
            if p.fail_mode == "closed":
                log.warning("policy %s: %s (fail closed)", p.name, e)
                return rule, start, len(text)
            if (p.id, stage) not in self.failed_open:  # one event per stage and request
                log.warning("policy %s: %s (fail open)", p.name, e)
                self.failed_open.add((p.id, stage))
                v.events.append(Event(p.id, p.name, rule, stage, "fail_open", None))
            return None
        if prob >= p.guard.threshold:
            return f"guard:{p.guard.adapter}", start, len(text)
        return None

    # ------------------------------------------------------------ the input
    async def input(self, text: str) -> str:
        """The prompt as it may run (redacted), or APIError 400 `content_filter`."""
        if not self.has("input"):
            return text
        v = await self.evaluate("input", text)
        events = v.events
        if v.block:
            request_id = f"blocked-{uuid.uuid4().hex}"
            await asyncio.to_thread(self._write, request_id, events)
            names = sorted({e.policy_name for e in events if e.action == "block"})
            raise APIError(
                400,
                f"the input was blocked by the tenant's content policy ({', '.join(names)}); "
                f"audit id {request_id}",
                CONTENT_FILTER,
                "messages" if self.route == "chat" else "prompt",
            )
        self.held += events
        return redact(text, v.spans) if v.spans else text

    def started(self, request_id: str) -> None:
        """The request has its id: record the input's redactions and flags under it."""
        events, self.held = self.held, []
        if events:
            self._write(request_id, events)

    def _write(self, request_id: str, events: list[Event]) -> None:
        key_id = getattr(self.caller.key, "id", None)
        audit.write(self.state, tenant_id=self.caller.tenant.id, key_id=key_id,
                    request_id=request_id, route=self.route, events=events)  # fmt: skip

    async def record(self, request_id: str, events: list[Event]) -> None:
        await asyncio.to_thread(self._write, request_id, events)
