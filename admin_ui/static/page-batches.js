// Batch API jobs of one tenant, newest first: state, endpoint, progress (answered and failed
// lines of the total) and the files. While a batch runs, the page refreshes itself.

import { api } from "./api.js";
import { attempt, badge, field, h, number, table, when } from "./dom.js";

const POLL_MS = 3000;
const RUNNING = new Set(["validating", "in_progress", "finalizing", "cancelling"]);

function at(seconds) {
  return seconds ? when(new Date(seconds * 1000).toISOString()) : "—";
}

function progress(b) {
  const { total, completed, failed } = b.request_counts;
  if (!total) return h("span", { class: "muted" }, "—");
  const done = completed + failed;
  const pct = Math.floor((100 * done) / total);
  return h("span", { class: "progress" },
    h("progress", { max: total, value: done, "aria-label": `${b.id}: ${pct}% of lines done` }),
    h("span", { class: "progress-text" }, `${number(done)} / ${number(total)}`,
      failed ? h("span", { class: "failed" }, ` (${number(failed)} failed)`) : null));
}

function ended(b) {
  return b.completed_at || b.failed_at || b.cancelled_at || b.expired_at;
}

export async function batchesPage(main, query) {
  const { data: tenants } = await api.get("/tenants");
  main.append(h("h1", {}, "Batches"));
  if (!tenants.length) {
    main.append(h("p", { class: "muted" }, "No tenants yet. ", h("a", { href: "#tenants" }, "Create one"), " first."));
    return;
  }
  const wanted = Number(query.get("tenant")) || tenants[0].id;
  const select = h("select", { name: "tenant", id: "batch-tenant" },
    tenants.map((t) => h("option", { value: t.id, selected: t.id === wanted }, t.name)));
  const list = h("section", { class: "card", id: "batches" });
  let timer = null;

  async function reload() {
    const tid = Number(select.value);
    const { data } = await api.get(`/tenants/${tid}/batches`);
    list.replaceChildren(h("h2", {}, `Batches of ${select.selectedOptions[0].textContent} (${data.length})`), table([
      { label: "Batch", cell: (b) => h("code", {}, b.id) },
      { label: "Status", cell: (b) => badge(b.status) },
      { label: "Endpoint", cell: (b) => h("code", {}, b.endpoint) },
      { label: "Progress", cell: progress },
      { label: "Created", cell: (b) => at(b.created_at) },
      { label: "Ended", cell: (b) => at(ended(b)) },
      { label: "Output", cell: (b) => b.output_file_id ? h("code", {}, b.output_file_id) : "—" },
    ], data, "This tenant has no batches."));
    // Poll only while something can still change.
    clearTimeout(timer);
    if (data.some((b) => RUNNING.has(b.status))) {
      timer = setTimeout(() => attempt(reload), POLL_MS);
    }
  }

  select.addEventListener("change", () => {
    history.replaceState(null, "", `#batches?tenant=${select.value}`);
    attempt(reload);
  });
  main.append(h("div", { class: "card form-grid" }, field("Tenant", select)), list);
  await reload();
  return () => clearTimeout(timer);
}
