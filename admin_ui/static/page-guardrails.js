// Guardrails across tenants: one tenant's policies (made and deleted here), this month's
// blocks, redactions, flags and fail-opens per tenant, and the newest audit events
// (docs/guardrails.md).

import { api } from "./api.js";
import { h, table, when } from "./dom.js";
import { policiesSection } from "./guardrail-policies.js";

const ACTIONS = ["block", "redact", "flag", "fail_open"];

export async function guardrailsPage(main) {
  const [counts, events, tenants] = await Promise.all([
    api.get("/guardrails/counts"),
    api.get("/guardrails/events?limit=100"),
    api.get("/tenants"),
  ]);
  const names = Object.fromEntries(tenants.data.map((t) => [t.id, t.name]));
  const tenant = (id) => names[id] ?? `#${id}`;
  const countTable = table([
    { label: "Tenant", cell: (c) => tenant(c.tenant_id) },
    ...ACTIONS.map((a) => ({ label: a, cell: (c) => String(c[a] ?? 0) })),
  ], counts.data, "No guardrail events this month.");
  const eventTable = table([
    { label: "When", cell: (e) => when(e.created_at) },
    { label: "Tenant", cell: (e) => tenant(e.tenant_id) },
    { label: "Policy", cell: (e) => e.policy_name },
    { label: "Rule", cell: (e) => h("code", {}, e.rule) },
    { label: "Stage", cell: (e) => e.stage },
    { label: "Action", cell: (e) => e.action },
    { label: "Request", cell: (e) => h("code", {}, e.request_id) },
  ], events.data, "No events.");
  main.append(
    h("h1", {}, "Guardrails"),
    policiesSection(tenants.data),
    h("section", { class: "card", id: "guardrail-counts" }, h("h2", {}, "This month"), countTable),
    h("section", { class: "card", id: "guardrail-events" }, h("h2", {}, "Newest events"), eventTable),
  );
}
