// Live figures, polled every 2 s: request and token rates over all replicas (from the usage
// ledger), queue and caches of the replica that answered.

import { api } from "./api.js";
import { sparkline } from "./charts.js";
import { h, number } from "./dom.js";

const POLL_MS = 2000;
const HISTORY = 60;

function tile(id, label) {
  return h("section", { class: "card tile", id }, h("h3", {}, label),
    h("p", { class: "big" }, "–"), h("p", { class: "muted sub" }, ""), h("div", { class: "spark-box" }));
}

function set(root, id, big, sub, history) {
  const t = root.querySelector(`#${id}`);
  t.querySelector(".big").textContent = big;
  t.querySelector(".sub").textContent = sub;
  if (history) t.querySelector(".spark-box").replaceChildren(sparkline(history));
}

function pct(x) {
  return `${number(100 * x, 1)} %`;
}

export async function overviewPage(main) {
  const hist = { rps: [], tps: [], queue: [], kv: [] };
  const status = h("p", { class: "muted" }, "Loading…");
  main.append(
    h("h1", {}, "Overview"),
    status,
    h("div", { class: "tiles" },
      tile("t-rps", "Requests / s"), tile("t-tps", "Tokens / s"), tile("t-queue", "Queue depth"),
      tile("t-kv", "KV cache"), tile("t-adapters", "Adapter cache"))
  );

  async function poll() {
    const s = await api.get("/stats");
    const e = s.engine;
    for (const [k, v] of [["rps", s.requests_per_s], ["tps", s.tokens_per_s],
      ["queue", e ? e.waiting : 0], ["kv", e ? e.kv_usage : 0]]) {
      hist[k].push(v);
      if (hist[k].length > HISTORY) hist[k].shift();
    }
    status.textContent = `Model ${s.model} on replica ${s.replica}` +
      (s.ready ? "" : " (loading)") + `; rates over the last ${s.window_s} s, all replicas.`;
    set(main, "t-rps", number(s.requests_per_s, 1), "completed requests", hist.rps);
    set(main, "t-tps", number(s.tokens_per_s, 1), "prompt + completion", hist.tps);
    if (!e) return;
    set(main, "t-queue", number(e.waiting), `waiting · ${number(e.running)} running`, hist.queue);
    set(main, "t-kv", pct(e.kv_usage), `of ${number(e.kv_blocks)} blocks`, hist.kv);
    set(main, "t-adapters", `${e.adapter_slots_used} / ${e.adapter_slots}`,
      `device slots · ${e.adapters_in_host} in host memory · ${e.adapter_loads} loads`);
  }

  await poll();
  const timer = setInterval(() => poll().catch((err) => (status.textContent = err.message)), POLL_MS);
  return () => clearInterval(timer);
}
