// The tenant's account: prices, and each quota with how much of it is used and left.

import { api } from "./portal-api.js";
import { bytes, h, number, when } from "./dom.js";

const LIMITS = [
  ["requests_per_min", "Requests this minute", number],
  ["tokens_per_min", "Tokens this minute", number],
  ["tokens_per_month", "Tokens this month", number],
  ["max_adapters", "Adapters", number],
  ["max_adapter_bytes", "Adapter storage", bytes],
  ["batch_tokens_per_month", "Batch API tokens this month", number],
];

function meter(id, label, fmt, limit, used, left) {
  const body = [h("h3", {}, label)];
  if (limit === null) {
    body.push(h("p", { class: "big" }, fmt(used)), h("p", { class: "muted sub" }, "no limit"));
  } else {
    const share = limit > 0 ? Math.min(1, used / limit) : 1;
    const bar = h("div", { class: "meter", role: "meter", "aria-label": label, "aria-valuemin": "0",
      "aria-valuemax": String(limit), "aria-valuenow": String(Math.min(used, limit)) },
      h("span", { class: share >= 0.9 ? "fill full" : "fill" }));
    bar.firstChild.style.width = `${(100 * share).toFixed(1)}%`;
    body.push(h("p", { class: "big" }, fmt(left), h("span", { class: "unit" }, " left")),
      h("p", { class: "muted sub" }, `${fmt(used)} of ${fmt(limit)} used`), bar);
  }
  return h("section", { class: "card tile", id }, ...body);
}

// Prices are exact decimal strings ("0.500000000"): shown without their trailing zeros.
function price(text) {
  return text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text;
}

export async function accountPage(main) {
  const a = await api.get("/account");
  const t = a.tenant;
  main.append(
    h("h1", {}, `Account ${t.name}`),
    h("section", { class: "card" }, h("h2", {}, "Prices"),
      h("p", { id: "prices" }, `Prompt tokens ${price(t.price_prompt_per_1k)} and completion tokens `,
        `${price(t.price_completion_per_1k)} per 1,000. `,
        h("span", { class: "muted" }, `Monthly budgets restart ${when(a.month_resets_at)}.`))),
    h("h2", {}, "Quotas"),
    h("div", { class: "tiles", id: "quotas" },
      LIMITS.map(([k, label, fmt]) => meter(`q-${k}`, label, fmt, a.limits[k], a.used[k], a.left[k]))),
    h("p", { class: "muted" }, a.limits.max_rank === null ? "Adapters of any rank the server serves."
      : `Adapters up to rank ${a.limits.max_rank}.`));
}
