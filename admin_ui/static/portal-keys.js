// The tenant's API keys: create (the secret is shown once) and revoke.

import { api } from "./portal-api.js";
import { attempt, badge, field, flash, h, table, when } from "./dom.js";

async function copy(text, input) {
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

export async function keysPage(main) {
  const name = h("input", { name: "name", value: "default", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]*", maxlength: "64" });
  const form = h("form", { class: "card form-grid", id: "create-key" }, field("Key name", name),
    h("div", { class: "actions" }, h("button", { type: "submit", class: "primary" }, "Create key")));
  const secretSlot = h("div");
  const list = h("section", { class: "card", id: "keys" });

  async function reload() {
    const { data } = await api.get("/keys");
    list.replaceChildren(h("h2", {}, "Your keys"), table([
      { label: "Name", cell: (k) => [k.name, k.current ? h("span", { class: "badge" }, "this session") : ""] },
      { label: "Prefix", cell: (k) => h("code", {}, `${k.prefix}…`) },
      { label: "State", cell: keyState },
      { label: "Created", cell: (k) => when(k.created_at) },
      { label: "Last used", cell: (k) => when(k.last_used_at) },
      { label: "", cell: (k) => k.revoked_at ? "" : h("button", { type: "button", class: "danger", onclick: async () => {
        const ending = k.current ? " You signed in with it: this session ends too." : "";
        if (!confirm(`Revoke key ${k.prefix}…? Clients using it are refused at once.${ending}`)) return;
        if (await attempt(() => api.post(`/keys/${k.id}/revoke`), `Key ${k.prefix}… revoked.`)) {
          if (k.current) location.assign("/portal/login");
          else reload();
        }
      } }, "Revoke") },
    ], data, "No keys."));
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const created = await attempt(() => api.post("/keys", { name: name.value }));
    if (!created) return;
    secretSlot.replaceChildren(secretBox(created));
    reload();
  });
  main.append(h("h1", {}, "API keys"), form, secretSlot, list);
  await reload();
}
