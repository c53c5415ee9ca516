// API keys of one tenant: create (the secret is shown once, with a copy button) and revoke
// (optionally ending the streams running on the key at once).

import { api } from "./api.js";
import { keyState, secretBox } from "./key-secret.js";
import { attempt, field, h, table, when } from "./dom.js";

export async function keysPage(main, query) {
  const { data: tenants } = await api.get("/tenants");
  main.append(h("h1", {}, "API keys"));
  if (!tenants.length) {
    main.append(h("p", { class: "muted" }, "No tenants yet. ", h("a", { href: "#tenants" }, "Create one"), " first."));
    return;
  }
  const wanted = Number(query.get("tenant")) || tenants[0].id;
  const select = h("select", { name: "tenant", id: "key-tenant" },
    tenants.map((t) => h("option", { value: t.id, selected: t.id === wanted }, t.name)));
  const name = h("input", { name: "name", value: "default", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]*", maxlength: "64" });
  const form = h("form", { class: "card form-grid", id: "create-key" },
    field("Tenant", select), field("Key name", name),
    h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Create key")));
  const secretSlot = h("div");
  const list = h("section", { class: "card" });
  // Off: a revoked key's running streams finish (new requests are refused at once).
  const endStreams = h("input", { type: "checkbox", id: "revoke-end-streams" });
  const endStreamsField = h("label", { class: "check" }, endStreams, " Revoking also ends the key's running streams");

  async function reload() {
    const tid = Number(select.value);
    const { data } = await api.get(`/tenants/${tid}/keys`);
    list.replaceChildren(h("h2", {}, `Keys of ${select.selectedOptions[0].textContent}`), endStreamsField, table([
      { label: "Name", cell: (k) => k.name },
      { label: "Prefix", cell: (k) => h("code", {}, `${k.prefix}…`) },
      { label: "State", cell: keyState },
      { label: "Created", cell: (k) => when(k.created_at) },
      { label: "Last used", cell: (k) => when(k.last_used_at) },
      { label: "", cell: (k) => k.revoked_at ? "" : h("button", { type: "button", class: "danger", onclick: async () => {
        const cut = endStreams.checked;
        const streams = cut ? " Its running streams end now." : " Its running streams finish.";
        if (!confirm(`Revoke key ${k.prefix}…? Clients using it are refused at once.${streams}`)) return;
        const path = `/keys/${k.id}/revoke${cut ? "?end_streams=true" : ""}`;
        if (await attempt(() => api.post(path), `Key ${k.prefix}… revoked.`)) reload();
      } }, "Revoke") },
    ], data, "This tenant has no keys."));
  }

  select.addEventListener("change", () => {
    secretSlot.replaceChildren();
    history.replaceState(null, "", `#keys?tenant=${select.value}`);
    attempt(reload);
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const created = await attempt(() => api.post(`/tenants/${select.value}/keys`, { name: name.value }));
    if (!created) return;
    secretSlot.replaceChildren(secretBox(created));
    reload();
  });
  main.append(form, secretSlot, list);
  await reload();
}
