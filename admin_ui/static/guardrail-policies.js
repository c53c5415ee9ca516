// One tenant's guardrail policies on the dashboard: create (terms, patterns, PII, a guard
// adapter), edit (the same form, filled with the policy: a PATCH of its fields) and delete,
// over the admin API (docs/guardrails.md). The server checks every field
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
    h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Create policy"),
      h("button", { type: "button", id: "cancel-edit", hidden: true, onclick: () => stopEditing() }, "Cancel")));
  const list = h("div");
  let editing = null; // the policy the form is editing, or null: the form creates one
  const submit = form.querySelector("button[type=submit]");
  const cancel = form.querySelector("#cancel-edit");

  function stopEditing() {
    editing = null;
    const tid = tenant.value;
    form.reset();
    tenant.value = tid;
    tenant.disabled = false;
    submit.textContent = "Create policy";
    cancel.hidden = true;
  }

  function edit(p) {
    editing = p;
    name.value = p.name;
    stages.value = p.stages;
    action.value = p.action;
    terms.value = p.terms.join("\n");
    patterns.value = p.patterns.join("\n");
    for (const box of pii) box.checked = p.pii.includes(box.value);
    guard.value = p.guard_adapter ?? "";
    failMode.value = p.fail_mode;
    tenant.disabled = true; // a policy stays its tenant's
    submit.textContent = `Save ${p.name}`;
    cancel.hidden = false;
    name.focus();
  }

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
      { label: "", cell: (p) => [h("button", { type: "button", onclick: () => edit(p) }, "Edit"), " ",
        h("button", { type: "button", class: "danger", onclick: async () => {
        if (!confirm(`Delete policy ${p.name}? Its events stay.`)) return;
        const path = `/tenants/${p.tenant_id}/guardrails/${p.id}`;
        // A 204 has no body: `true` says it was done (attempt gives undefined on an error).
        const done = await attempt(async () => (await api.del(path), true), `Policy ${p.name} deleted.`);
        if (done) {
          if (editing?.id === p.id) stopEditing();
          reload();
        }
      } }, "Delete")] },
    ], data, "This tenant has no policies."));
  }

  tenant.addEventListener("change", () => attempt(reload));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { name: name.value, stages: stages.value, action: action.value, terms: lines(terms.value),
      patterns: lines(patterns.value), pii: pii.filter((b) => b.checked).map((b) => b.value),
      fail_mode: failMode.value };
    if (editing) {
      // Every field of the form is sent; a cleared guard removes it (its owner with it).
      const p = editing;
      body.guard_adapter = guard.value.trim() || null;
      const saved = await attempt(() => api.patch(`/tenants/${p.tenant_id}/guardrails/${p.id}`, body),
        `Policy ${body.name} saved.`);
      if (!saved) return; // refused: the form keeps what was typed, to be fixed
      stopEditing();
      reload();
      return;
    }
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
