// One tenant's guardrail policies on the dashboard: create (terms, patterns, PII, a guard
// adapter) and delete, over the admin API (docs/guardrails.md). The server checks every field
// (a bad pattern, a policy with no check) and its message is shown as it says it.

import { api } from "./api.js";
import { attempt, field, h, table } from "./dom.js";

const choice = (name, values, selected) =>
  h("select", { name }, values.map((v) => h("option", { value: v, selected: v === selected }, v)));
const lines = (text) => text.split("\n").map((s) => s.trim()).filter(Boolean);

export function policiesSection(tenants) {
  const section = h("section", { class: "card", id: "guardrail-policies" });
  if (!tenants.length) return section;
  const tenant = h("select", { name: "tenant", id: "policy-tenant" },
    tenants.map((t) => h("option", { value: t.id }, t.name)));
  const name = h("input", { name: "name", required: true, maxlength: "64" });
  const stages = choice("stages", ["input", "output", "both"], "both");
  const action = choice("action", ["block", "redact", "flag"], "block");
  const terms = h("textarea", { name: "terms", rows: "3", placeholder: "one per line" });
  const patterns = h("textarea", { name: "patterns", rows: "2", placeholder: "one regular expression per line" });
  const pii = ["email", "phone", "card"].map((k) => h("input", { type: "checkbox", name: "pii", value: k }));
  const guard = h("input", { name: "guard_adapter", placeholder: "adapter name (optional)", maxlength: "160" });
  const failMode = choice("fail_mode", ["closed", "open"], "closed");
  const form = h("form", { class: "form-grid", id: "create-policy" },
    field("Tenant", tenant), field("Name", name), field("Stages", stages), field("Action", action),
    field("Terms", terms), field("Patterns", patterns),
    h("div", { class: "field" }, h("span", {}, "PII"),
      pii.map((box) => h("label", { class: "check" }, box, ` ${box.value}`))),
    field("Guard adapter", guard), field("Guard fails", failMode),
    h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Create policy")));
  const list = h("div");

  async function reload() {
    const tid = tenant.value;
    const { data } = await api.get(`/tenants/${tid}/guardrails`);
    if (tid !== tenant.value) return; // another tenant was picked meanwhile: its list wins
    list.replaceChildren(table([
      { label: "Name", cell: (p) => p.name },
      { label: "Stages", cell: (p) => p.stages },
      { label: "Action", cell: (p) => p.action },
      { label: "Checks", cell: (p) => [...p.terms.map((t) => `"${t}"`), ...p.patterns.map((r) => `/${r}/`),
        ...p.pii, ...(p.guard_adapter ? [`guard ${p.guard_adapter}`] : [])].join(", ") },
      { label: "Key", cell: (p) => p.api_key_id ?? "all" },
      { label: "Text kept", cell: (p) => (p.record_text ? "yes" : "no") },
      { label: "", cell: (p) => h("button", { type: "button", class: "danger", onclick: async () => {
        if (!confirm(`Delete policy ${p.name}? Its events stay.`)) return;
        const path = `/tenants/${p.tenant_id}/guardrails/${p.id}`;
        // A 204 has no body: `true` says it was done (attempt gives undefined on an error).
        const done = await attempt(async () => (await api.del(path), true), `Policy ${p.name} deleted.`);
        if (done) reload();
      } }, "Delete") },
    ], data, "This tenant has no policies."));
  }

  tenant.addEventListener("change", () => attempt(reload));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { name: name.value, stages: stages.value, action: action.value, terms: lines(terms.value),
      patterns: lines(patterns.value), pii: pii.filter((b) => b.checked).map((b) => b.value),
      fail_mode: failMode.value };
    if (guard.value.trim()) body.guard_adapter = guard.value.trim();
    const made = await attempt(() => api.post(`/tenants/${tenant.value}/guardrails`, body), `Policy ${name.value} created.`);
    if (!made) return;
    const tid = tenant.value;
    form.reset(); // the fields for the next policy, of the same tenant
    tenant.value = tid;
    reload();
  });
  section.append(h("h2", {}, "Policies"), form, list);
  attempt(reload);
  return section;
}
