// Usage of one month by tenant, by adapter and by day; billing with its CSV export.

import { api } from "./api.js";
import { barsChart, columnsChart } from "./charts.js";
import { field, h, number, table } from "./dom.js";

const TOKENS = [{ name: "prompt tokens", cls: "s1" }, { name: "completion tokens", cls: "s2" }];

function monthBounds(month) {
  const [y, m] = month.split("-").map(Number);
  const days = new Date(Date.UTC(y, m, 0)).getUTCDate();
  return { start: `${month}-01`, end: `${month}-${String(days).padStart(2, "0")}`, days };
}

function thisMonth() {
  return new Date().toISOString().slice(0, 7);
}

export async function usagePage(main, query) {
  const month = h("input", { type: "month", name: "month", id: "usage-month", value: query.get("month") || thisMonth(), required: true });
  const download = h("a", { class: "button primary", id: "billing-csv", download: "" }, "Download billing CSV");
  const body = h("div", { class: "usage-body" });
  main.append(h("h1", {}, "Usage"),
    h("section", { class: "card toolbar" }, field("Month (UTC)", month), download), body);

  async function reload() {
    const { start, end, days } = monthBounds(month.value);
    const q = `start=${start}&end=${end}`;
    download.href = `/admin/api/billing?format=csv&${q}`;
    const [byTenant, byAdapter, byDay, bill] = await Promise.all([
      api.get(`/usage?group_by=tenant&${q}`),
      api.get(`/usage?group_by=adapter&${q}`),
      api.get(`/usage?group_by=day&${q}`),
      api.get(`/billing?${q}`),
    ]);
    const parts = (r) => [r.prompt_tokens, r.completion_tokens];
    const perDay = new Map(byDay.data.map((r) => [r.day, r.prompt_tokens + r.completion_tokens]));
    const points = Array.from({ length: days }, (_, i) => {
      const day = `${month.value}-${String(i + 1).padStart(2, "0")}`;
      return { label: String(i + 1), value: perDay.get(day) || 0 };
    });
    body.replaceChildren(
      h("div", { class: "charts" },
        barsChart("Tokens by tenant", byTenant.data.map((r) => ({ label: r.tenant, parts: parts(r) })), TOKENS),
        barsChart("Tokens by adapter",
          byAdapter.data.map((r) => ({ label: `${r.tenant} / ${r.adapter ?? "(base model)"}`, parts: parts(r) })), TOKENS),
        columnsChart("Tokens by day", points, "tokens")),
      h("section", { class: "card" }, h("h2", {}, `Billing: ${bill.total_cost} in total`), table([
        { label: "Tenant", cell: (r) => r.tenant },
        { label: "Requests", num: true, cell: (r) => number(r.requests) },
        { label: "Prompt tokens", num: true, cell: (r) => number(r.prompt_tokens) },
        { label: "Completion tokens", num: true, cell: (r) => number(r.completion_tokens) },
        { label: "Cost", num: true, cell: (r) => r.cost },
      ], bill.data, "No billable usage in this month.")));
  }
  month.addEventListener("change", () => {
    history.replaceState(null, "", `#usage?month=${month.value}`);
    reload();
  });
  await reload();
}
