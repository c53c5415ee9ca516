// The tenant's guardrail policies (set by the operator, read-only here) and its newest audit
// events: each block, redaction, flag or fail-open, with its request id (docs/guardrails.md).

import { api } from "./portal-api.js";
import { h, table, when } from "./dom.js";

const checks = (p) => [
  p.terms.length ? `${p.terms.length} terms` : "",
  p.patterns.length ? `${p.patterns.length} patterns` : "",
  p.pii.length ? `PII: ${p.pii.join(", ")}` : "",
  p.guard_adapter ? `guard ${p.guard_adapter} (fail ${p.fail_mode})` : "",
].filter(Boolean).join(" · ");

export async function guardrailsPage(main) {
  const { policies, events } = await api.get("/guardrails");
  const policyTable = table([
    { label: "Name", cell: (p) => p.name },
    { label: "Stages", cell: (p) => p.stages },
    { label: "Action", cell: (p) => p.action },
    { label: "Checks", cell: checks },
    { label: "Key", cell: (p) => (p.api_key_id === null ? "all keys" : `key ${p.api_key_id}`) },
  ], policies, "No policies: requests are not filtered.");
  const eventTable = table([
    { label: "When", cell: (e) => when(e.created_at) },
    { label: "Policy", cell: (e) => e.policy_name },
    { label: "Rule", cell: (e) => h("code", {}, e.rule) },
    { label: "Stage", cell: (e) => e.stage },
    { label: "Action", cell: (e) => e.action },
    { label: "Request", cell: (e) => h("code", {}, e.request_id) },
  ], events, "No events.");
  main.append(
    h("h1", {}, "Guardrails"),
    h("section", { class: "card", id: "policies" }, h("h2", {}, "Policies"), policyTable),
    h("section", { class: "card", id: "events" }, h("h2", {}, "Newest events"), eventTable),
  );
}
