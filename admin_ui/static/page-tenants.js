// Tenants: create; edit weight, prices and quotas; suspend and reactivate; drop cached KV.

import { api } from "./api.js";
import { attempt, badge, field, h, table } from "./dom.js";

const QUOTAS = [
  ["requests_per_min", "Requests / min"],
  ["tokens_per_min", "Tokens / min"],
  ["tokens_per_month", "Tokens / month"],
  ["max_adapters", "Max adapters"],
  ["max_adapter_bytes", "Max adapter bytes"],
  ["max_rank", "Max rank"],
  ["batch_tokens_per_month", "Batch tokens / month"],
];

function input(name, value, attrs = {}) {
  return h("input", { name, value: value ?? "", ...attrs });
}

function numberInput(name, value, step = "any") {
  return input(name, value, { type: "number", min: "0", step, inputmode: "decimal" });
}

function formValues(form) {
  return Object.fromEntries(new FormData(form).entries());
}

function createForm(reload) {
  const form = h("form", { class: "card form-grid", id: "create-tenant" },
    h("h2", {}, "New tenant"),
    field("Name", input("name", "", { required: true, pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]*", maxlength: "64" })),
    field("Weight", numberInput("weight", "1")),
    field("Price / 1k prompt tokens", numberInput("price_prompt_per_1k", "0")),
    field("Price / 1k completion tokens", numberInput("price_completion_per_1k", "0")),
    h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Create tenant")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const v = formValues(form);
    const ok = await attempt(() => api.post("/tenants", { ...v, weight: Number(v.weight) }),
      `Tenant ${v.name} created.`);
    if (ok) reload();
  });
  return form;
}

async function editor(tenant, reload) {
  const quota = await api.get(`/tenants/${tenant.id}/quota`);
  const form = h("form", { class: "card form-grid", id: "edit-tenant" },
    h("h2", {}, `Edit ${tenant.name}`),
    field("Weight", numberInput("weight", tenant.weight)),
    field("Price / 1k prompt tokens", numberInput("price_prompt_per_1k", tenant.price_prompt_per_1k)),
    field("Price / 1k completion tokens", numberInput("price_completion_per_1k", tenant.price_completion_per_1k)),
    h("h3", { class: "span" }, "Quotas (empty = unlimited)"),
    QUOTAS.map(([k, label]) => field(label, numberInput(k, quota[k], "1"))),
    h("div", { class: "actions" },
      h("button", { type: "submit", class: "primary" }, "Save"),
      h("button", { type: "button", onclick: () => form.remove() }, "Cancel")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const v = formValues(form);
    const limits = Object.fromEntries(QUOTAS.map(([k]) => [k, v[k] === "" ? null : Number(v[k])]));
    const ok = await attempt(async () => {
      await api.patch(`/tenants/${tenant.id}`, {
        weight: Number(v.weight),
        price_prompt_per_1k: v.price_prompt_per_1k,
        price_completion_per_1k: v.price_completion_per_1k,
      });
      return api.put(`/tenants/${tenant.id}/quota`, limits);
    }, `Tenant ${tenant.name} saved.`);
    if (ok) reload();
  });
  return form;
}

export async function tenantsPage(main) {
  const list = h("section", { class: "card" });
  const slot = h("div");
  // Off: a suspended tenant's running streams finish (new requests are refused at once).
  const endStreams = h("input", { type: "checkbox", id: "suspend-end-streams" });
  const endStreamsField = h("label", { class: "check" }, endStreams, " Suspending also ends the tenant's running streams");
  async function reload() {
    const { data } = await api.get("/tenants");
    slot.replaceChildren();
    list.replaceChildren(h("h2", {}, `Tenants (${data.length})`), endStreamsField, table([
      { label: "Name", cell: (t) => h("strong", {}, t.name) },
      { label: "Status", cell: (t) => badge(t.status) },
      { label: "Weight", num: true, cell: (t) => t.weight },
      { label: "Prompt / 1k", num: true, cell: (t) => t.price_prompt_per_1k },
      { label: "Completion / 1k", num: true, cell: (t) => t.price_completion_per_1k },
      { label: "", cell: (t) => h("span", { class: "row-actions" },
        h("button", { type: "button", onclick: async () => {
          const form = await attempt(() => editor(t, reload));
          if (form) { slot.replaceChildren(form); form.scrollIntoView({ block: "nearest" }); }
        } }, "Edit"),
        h("button", { type: "button", class: t.status === "active" ? "danger" : null, onclick: async () => {
          const status = t.status === "active" ? "suspended" : "active";
          const cut = status === "suspended" && endStreams.checked;
          const streams = cut ? " Its running streams end now." : " Its running streams finish.";
          if (status === "suspended" && !confirm(`Suspend ${t.name}? Its keys stop working.${streams}`)) return;
          const path = `/tenants/${t.id}${cut ? "?end_streams=true" : ""}`;
          if (await attempt(() => api.patch(path, { status }), `${t.name} is ${status}.`)) reload();
        } }, t.status === "active" ? "Suspend" : "Activate"),
        // A new prefix-cache salt: the tenant's cached KV unreachable on every replica.
        h("button", { type: "button", onclick: async () => {
          if (!confirm(`Drop ${t.name}'s cached KV? Its next prompts are computed anew.`)) return;
          await attempt(() => api.post(`/tenants/${t.id}/cache-salt/rotate`),
            `${t.name}'s cached KV dropped (cache salt rotated).`);
        } }, "Drop cached KV"),
        h("a", { class: "button", href: `#keys?tenant=${t.id}` }, "Keys"),
        h("a", { class: "button", href: `#batches?tenant=${t.id}` }, "Batches")) },
    ], data, "No tenants yet: create the first one above."));
  }
  main.append(h("h1", {}, "Tenants"), createForm(reload), slot, list);
  await reload();
}
