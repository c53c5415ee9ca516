// The tenant's usage and costs of one month by adapter and by day, with a CSV download.

import { api } from "./portal-api.js";
import { barsChart, columnsChart } from "./charts.js";
import { field, h, number, table } from "./dom.js";

const TOKENS = [{ name: "prompt tokens", cls: "s1" }, { name: "completion tokens", cls: "s2" }];

// Time to first token (TTFT) and per output token (TPOT), as the server measured them.
function ms(v) {
  return v === null || v === undefined ? "–" : `${number(v, v < 10 ? 1 : 0)} ms`;
}

function monthBounds(month) {
  const [y, m] = month.split("-").map(Number);
  const days = new Date(Date.UTC(y, m, 0)).getUTCDate();
  return { start: `${month}-01`, end: `${month}-${String(days).padStart(2, "0")}`, days };
}

export async function usagePage(main, query) {
  const month = h("input", { type: "month", name: "month", id: "usage-month", value: query.get("month") || new Date().toISOString().slice(0, 7), required: true });
  const download = h("a", { class: "button primary", id: "usage-csv", download: "" }, "Download CSV");
  const body = h("div", { class: "usage-body" });
  main.append(h("h1", {}, "Usage"),
    h("section", { class: "card toolbar" }, field("Month (UTC)", month), download), body);

  async function reload() {
    const { start, end, days } = monthBounds(month.value);
    const q = `start=${start}&end=${end}`;
    download.href = `/portal/api/usage?format=csv&${q}`;
    const [report, latency] = await Promise.all([api.get(`/usage?${q}`), api.get(`/latency?${q}`)]);
    const byAdapter = new Map();
    const byDay = new Map();
    for (const r of report.data) {
      const name = r.adapter ?? "(base model)";
      const a = byAdapter.get(name) || [0, 0];
      byAdapter.set(name, [a[0] + r.prompt_tokens, a[1] + r.completion_tokens]);
      byDay.set(r.day, (byDay.get(r.day) || 0) + r.prompt_tokens + r.completion_tokens);
    }
    const points = Array.from({ length: days }, (_, i) => {
      const day = `${month.value}-${String(i + 1).padStart(2, "0")}`;
      return { label: String(i + 1), value: byDay.get(day) || 0 };
    });
    body.replaceChildren(
      h("div", { class: "charts" },
        barsChart("Tokens by adapter", [...byAdapter].map(([label, parts]) => ({ label, parts })), TOKENS),
        columnsChart("Tokens by day", points, "tokens")),
      h("section", { class: "card", id: "usage-table" }, h("h2", {}, `Cost this month: ${report.total_cost}`),
        h("p", { class: "muted" }, `Batch API tokens (in the totals too) cost ${number(report.batch_price_factor, 2)} × your prices.`),
        table([
          { label: "Day", cell: (r) => r.day },
          { label: "Adapter", cell: (r) => r.adapter ?? "(base model)" },
          { label: "Requests", num: true, cell: (r) => number(r.requests) },
          { label: "Prompt tokens", num: true, cell: (r) => number(r.prompt_tokens) },
          { label: "Completion tokens", num: true, cell: (r) => number(r.completion_tokens) },
          { label: "Batch tokens", num: true, cell: (r) => number(r.batch_prompt_tokens + r.batch_completion_tokens) },
          { label: "Errors", num: true, cell: (r) => number(r.errors) },
          { label: "Batch cost", num: true, cell: (r) => r.batch_cost },
          { label: "Cost", num: true, cell: (r) => r.cost },
        ], report.data, "No usage in this month.")),
      h("section", { class: "card", id: "latency-table" }, h("h2", {}, "Latency by adapter"), table([
        { label: "Adapter", cell: (r) => r.adapter ?? "(base model)" },
        { label: "Requests", num: true, cell: (r) => number(r.requests) },
        { label: "p50 TTFT", num: true, cell: (r) => ms(r.ttft_p50_ms) },
        { label: "p99 TTFT", num: true, cell: (r) => ms(r.ttft_p99_ms) },
        { label: "p50 TPOT", num: true, cell: (r) => ms(r.tpot_p50_ms) },
        { label: "p99 TPOT", num: true, cell: (r) => ms(r.tpot_p99_ms) },
      ], latency.data, "No requests in this month.")));
  }
  month.addEventListener("change", () => {
    history.replaceState(null, "", `#usage?month=${month.value}`);
    reload();
  });
  await reload();
}
