// Every tenant's adapters: status, size, rank, last use; delete.

import { api } from "./api.js";
import { attempt, badge, bytes, h, table, when } from "./dom.js";

export async function adaptersPage(main) {
  const list = h("section", { class: "card" });
  async function reload() {
    const { data } = await api.get("/adapters");
    const total = data.reduce((n, a) => n + a.bytes, 0);
    list.replaceChildren(h("h2", {}, `Adapters (${data.length}, ${bytes(total)})`), table([
      { label: "Tenant", cell: (a) => a.tenant },
      { label: "Name", cell: (a) => h("strong", {}, a.name) },
      { label: "Status", cell: (a) => badge(a.status) },
      { label: "Size", num: true, cell: (a) => bytes(a.bytes) },
      { label: "Rank", num: true, cell: (a) => a.rank },
      { label: "Targets", cell: (a) => a.targets.join(", ") },
      { label: "Last used", cell: (a) => when(a.last_used_at) },
      { label: "", cell: (a) => h("button", { type: "button", class: "danger", onclick: async () => {
        if (!confirm(`Delete ${a.tenant}/${a.name}? Requests naming it will fail.`)) return;
        const ok = await attempt(() => api.del(`/tenants/${a.tenant_id}/adapters/${encodeURIComponent(a.name)}`),
          `Adapter ${a.name} deleted.`);
        if (ok) reload();
      } }, "Delete") },
    ], data, "No adapters yet: tenants upload them with POST /v1/adapters."));
  }
  main.append(h("h1", {}, "Adapters"), list);
  await reload();
}
