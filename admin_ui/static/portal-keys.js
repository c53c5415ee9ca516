// The tenant's API keys: create (the secret is shown once) and revoke.

import { api } from "./portal-api.js";
import { keyState, secretBox } from "./key-secret.js";
import { attempt, field, h, table, when } from "./dom.js";

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
