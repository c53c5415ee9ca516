// The tenant's guardrail policies (set by the operator) and its newest audit events: each
// block, redaction, flag, fail-open and policy edit, with its request id (docs/guardrails.md).
// The one thing a tenant changes here is its own: per policy, whether events keep the text
// that hit (its prompts and answers), a switch over the same handler as
// PATCH /v1/guardrails/policies/{id}.

import { api } from "./portal-api.js";
import { attempt, h, table, when } from "./dom.js";

const checks = (p) => [
  p.terms.length ? `${p.terms.length} terms` : "",
  p.patterns.length ? `${p.patterns.length} patterns` : "",
  p.pii.length ? `PII: ${p.pii.join(", ")}` : "",
  p.guard_adapter ? `guard ${p.guard_adapter} (fail ${p.fail_mode})` : "",
].filter(Boolean).join(" · ");

function recordTextSwitch(p) {
  const box = h("input", { type: "checkbox", id: `record-text-${p.id}`, checked: p.record_text,
    "aria-label": `Keep the text that hit ${p.name}` });
  box.addEventListener("change", async () => {
    const want = box.checked;
    box.disabled = true;
    const said = want ? `Policy ${p.name}: its events now keep the text that hit.`
      : `Policy ${p.name}: its events keep no text from now on.`;
    const saved = await attempt(() => api.put(`/guardrails/policies/${p.id}/record_text`,
      { record_text: want }), said);
    box.checked = saved ? saved.record_text : !want; // refused: the switch shows what is stored
    box.disabled = false;
  });
  return h("label", { class: "check" }, box, " keep text");
}

export async function guardrailsPage(main) {
  const { policies, events } = await api.get("/guardrails");
  const policyTable = table([
    { label: "Name", cell: (p) => p.name },
    { label: "Stages", cell: (p) => p.stages },
    { label: "Action", cell: (p) => p.action },
    { label: "Checks", cell: checks },
    { label: "Key", cell: (p) => (p.api_key_id === null ? "all keys" : `key ${p.api_key_id}`) },
    { label: "Recorded text", cell: recordTextSwitch },
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
    h("section", { class: "card", id: "policies" }, h("h2", {}, "Policies"),
      h("p", { class: "muted" }, "Set by the operator. Events never keep your prompts or answers "
        + "unless you switch on “keep text” for that policy; from the next request on."),
      policyTable),
    h("section", { class: "card", id: "events" }, h("h2", {}, "Newest events"), eventTable),
  );
}
