// Every tenant's adapters, one row per name (its versions together): status, size, rank, last
// use; delete. "Versions" opens the name's versions and aliases: promote, roll back, split,
// delete a version. `#adapters?tenant=ID&name=NAME` opens that panel directly.

import { api } from "./api.js";
import { versionsPanel } from "./adapter-versions.js";
import { attempt, badge, bytes, h, table, when } from "./dom.js";

// The admin API lists one row per version (oldest first); the page shows one per name.
function byName(rows) {
  const names = new Map();
  for (const row of rows) {
    const key = `${row.tenant_id}/${row.name}`;
    if (!names.has(key)) names.set(key, { tenant: row.tenant, tenant_id: row.tenant_id, name: row.name, versions: [] });
    names.get(key).versions.push(row);
  }
  return [...names.values()].map((a) => {
    const newest = a.versions.reduce((x, y) => (y.version > x.version ? y : x));
    const used = a.versions.map((v) => v.last_used_at).filter(Boolean).sort();
    return { ...a, newest, bytes: a.versions.reduce((n, v) => n + v.bytes, 0), last_used_at: used.at(-1) || null };
  });
}

function adapterPath(tenantId, name) {
  return `/tenants/${tenantId}/adapters/${encodeURIComponent(name)}`;
}

export async function adaptersPage(main, query) {
  const list = h("section", { class: "card" });
  const slot = h("div");
  let open = null; // the name whose panel shows: {tenant_id, name}

  async function show(a) {
    const panel = await attempt(() => versionsPanel({
      api, base: adapterPath(a.tenant_id, a.name), title: `${a.tenant} / ${a.name}`, changed: reload,
    }));
    if (!panel) return;
    open = a;
    slot.replaceChildren(panel);
    panel.scrollIntoView({ block: "nearest" });
  }

  async function reload() {
    const { data } = await api.get("/adapters");
    const names = byName(data);
    const total = names.reduce((n, a) => n + a.bytes, 0);
    if (open && !names.some((a) => a.tenant_id === open.tenant_id && a.name === open.name)) {
      open = null;
      slot.replaceChildren();
    }
    list.replaceChildren(h("h2", {}, `Adapters (${names.length}, ${bytes(total)})`), table([
      { label: "Tenant", cell: (a) => a.tenant },
      { label: "Name", cell: (a) => h("strong", {}, a.name) },
      { label: "Versions", cell: (a) => a.versions.map((v) => `v${v.version}`).join(", ") },
      { label: "Status", cell: (a) => badge(a.newest.status) },
      { label: "Size", num: true, cell: (a) => bytes(a.bytes) },
      { label: "Rank", num: true, cell: (a) => a.newest.rank },
      { label: "Targets", cell: (a) => a.newest.targets.join(", ") },
      { label: "Last used", cell: (a) => when(a.last_used_at) },
      { label: "", cell: (a) => h("span", { class: "row-actions" },
        h("button", { type: "button", onclick: () => show(a) }, "Versions"),
        h("button", { type: "button", class: "danger", onclick: async () => {
          const all = a.versions.length > 1 ? ` and its ${a.versions.length} versions` : "";
          if (!confirm(`Delete ${a.tenant}/${a.name}${all}? Requests naming it will fail.`)) return;
          const ok = await attempt(() => api.del(adapterPath(a.tenant_id, a.name)), `Adapter ${a.name} deleted.`);
          if (ok) reload();
        } }, "Delete")) },
    ], names, "No adapters yet: tenants upload them with POST /v1/adapters."));
  }

  main.append(h("h1", {}, "Adapters"), slot, list);
  await reload();
  const tenantId = Number(query?.get("tenant"));
  const wanted = query?.get("name");
  if (tenantId && wanted) {
    const { data } = await api.get(`/adapters?tenant_id=${tenantId}`);
    const match = byName(data).find((a) => a.name === wanted);
    if (match) await show(match);
  }
}
