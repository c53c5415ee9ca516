// API keys of one tenant: create (the secret is shown once, with a copy button) and revoke
// (optionally ending the streams running on the key at once).

import { api } from "./api.js";
import { attempt, badge, field, flash, h, table, when } from "./dom.js";

async function copy(text, input) {
  // The Clipboard API needs a secure context (https or localhost); elsewhere fall back to a
  // selection the operator can copy by hand.
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    flash("Copied to the clipboard.");
  } else {
    input.select();
    flash("Selected: press Ctrl+C (or ⌘C) to copy.");
  }
}

function secretBox(created) {
  const out = h("input", { id: "new-secret", readonly: true, value: created.secret, "aria-label": "New key secret" });
  return h("section", { class: "card secret", role: "alert" },
    h("h2", {}, `Key ${created.name} created`),
    h("p", {}, "Copy the secret now: it is shown this once, and only its hash is kept."),
    h("div", { class: "copy-row" }, out,
      h("button", { type: "button", class: "primary", id: "copy-secret", onclick: () => attempt(() => copy(created.secret, out)) }, "Copy")));
}

function keyState(k) {
  if (k.revoked_at) return badge("revoked");
  if (k.expires_at && new Date(k.expires_at) < new Date()) return badge("expired");
  return badge("active");
}

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
