// Live figures, polled every 2 s: request and token rates over all replicas (from the usage
// ledger), queue and caches of the replica that answered. Below them, latency from the ledger
// (every replica): p50/p99 TTFT and TPOT over time, overall or for one tenant or adapter, and
// per tenant its errors, quota refusals and p99 TTFT against the window before. Between them,
// each replica's live engine state and the adapters with the most cold loads (engine counts).

import { api } from "./api.js";
import { lineChart, sparkline } from "./charts.js";
import { bytes, field, h, number, table } from "./dom.js";

const LATENCY_POLL_MS = 30000;
const BASE = "(base model)";

function ms(v) {
  return v === null || v === undefined ? "–" : `${number(v, v < 10 ? 1 : 0)} ms`;
}

function rate(v) {
  return v === null || v === undefined ? "–" : `${number(100 * v, 1)} %`;
}

// p99 TTFT against the window before: risen by a fifth or more is flagged.
function trend(now, before) {
  if (now === null || before === null || before === undefined || before <= 0) return "–";
  const change = (now - before) / before;
  const text = `${change >= 0 ? "▲" : "▼"} ${number(Math.abs(100 * change), 0)} %`;
  return h("span", { class: change >= 0.2 ? "rose" : change <= -0.2 ? "fell" : "" }, text);
}

async function latencySection(main) {
  const { data: tenants } = await api.get("/tenants");
  const windowSel = h("select", { id: "lat-window", name: "window" },
    ["1h", "6h", "24h", "7d"].map((w) => h("option", { value: w }, `last ${w}`)));
  const tenantSel = h("select", { id: "lat-tenant", name: "tenant" }, h("option", { value: "" }, "all tenants"),
    tenants.map((t) => h("option", { value: t.id }, t.name)));
  const adapterSel = h("select", { id: "lat-adapter", name: "adapter" });
  // The adapters with requests in the period (from the ledger: deleted ones too).
  function adapterOptions(names) {
    const keep = adapterSel.options.length ? adapterSel.value : "*";
    adapterSel.replaceChildren(h("option", { value: "*" }, "all adapters"), h("option", { value: "" }, BASE),
      ...names.map((n) => h("option", { value: n }, n)));
    adapterSel.value = [...adapterSel.options].some((o) => o.value === keep) ? keep : "*";
  }
  adapterOptions([]);
  const charts = h("div", { class: "charts" });
  const byTenant = h("section", { class: "card", id: "lat-tenants" });
  const section = h("section", { id: "latency" }, h("h2", {}, "Latency"),
    h("section", { class: "card toolbar" }, field("Period", windowSel), field("Tenant", tenantSel), field("Adapter", adapterSel)),
    charts, byTenant);
  main.append(section);

  async function reload() {
    const q = new URLSearchParams({ window: windowSel.value });
    if (tenantSel.value) q.set("tenant_id", tenantSel.value);
    if (adapterSel.value !== "*") q.set("adapter", adapterSel.value);
    const r = await api.get(`/latency?${q}`);
    adapterOptions(r.adapters);
    const range = { start: new Date(r.start), end: new Date(r.end), stepMs: r.bucket_s * 1000, unit: "ms" };
    const pts = (a, b) => r.series.map((p) => ({ t: new Date(p.t), n: p.requests, v: { p50: p[a], p99: p[b] } }));
    const who = [tenantSel.value ? tenantSel.selectedOptions[0].textContent : "all tenants",
      adapterSel.value === "*" ? "" : adapterSel.selectedOptions[0].textContent].filter(Boolean).join(" / ");
    const series = [{ key: "p50", name: "p50", cls: "s1" }, { key: "p99", name: "p99", cls: "s3" }];
    charts.replaceChildren(
      lineChart(`Time to first token · ${who}`, pts("ttft_p50_ms", "ttft_p99_ms"), series, { ...range, id: "chart-ttft" }),
      lineChart(`Time per output token · ${who}`, pts("tpot_p50_ms", "tpot_p99_ms"), series, { ...range, id: "chart-tpot" }));
    byTenant.replaceChildren(h("h2", {}, `By tenant, last ${r.window}`), table([
      { label: "Tenant", cell: (t) => h("button", { type: "button", class: "link-button", onclick: () => {
        tenantSel.value = String(t.tenant_id);
        adapterSel.value = "*";
        reload();
      } }, t.tenant) },
      { label: "Requests", num: true, cell: (t) => number(t.requests) },
      { label: "Errors", num: true, cell: (t) => rate(t.error_rate) },
      { label: "429 (this replica)", num: true, cell: (t) => `${number(t.refused)} · ${rate(t.refused_rate)}` },
      { label: "p50 TTFT", num: true, cell: (t) => ms(t.ttft_p50_ms) },
      { label: "p99 TTFT", num: true, cell: (t) => ms(t.ttft_p99_ms) },
      { label: "p99 TTFT before", num: true, cell: (t) => ms(t.ttft_p99_before_ms) },
      { label: "Change", num: true, cell: (t) => trend(t.ttft_p99_ms, t.ttft_p99_before_ms) },
      { label: "p99 TPOT", num: true, cell: (t) => ms(t.tpot_p99_ms) },
    ], r.tenants, "No requests in this period."));
  }
  windowSel.addEventListener("change", reload);
  tenantSel.addEventListener("change", () => { adapterSel.value = "*"; reload(); });
  adapterSel.addEventListener("change", reload);
  await reload();
  return reload;
}

const ENGINE_POLL_MS = 5000;
const TIERS = { device: "in a slot", host: "from host memory", disk: "read from disk" };

function who(a) {
  return a.tenant === null ? a.adapter : `${a.tenant} / ${a.adapter}`;
}

// Replicas and cold loads: every replica's engine state (the one that answered reads its own,
// the others' come from their heartbeat rows); cold loads are what the answering one counts.
async function engineSection(main) {
  const replicas = h("section", { class: "card", id: "replicas" });
  const loads = h("section", { class: "card", id: "cold-loads" });
  main.append(h("section", { id: "engine" }, h("h2", {}, "Engine"), replicas, loads));

  function engine(x) {
    if (x.stale) {
      return h("span", { class: "badge expired", title: `no heartbeat for ${Math.round(x.seen_s_ago)} s` }, "stale");
    }
    return h("span", { class: `badge ${x.alive ? "ready" : "failed"}` },
      x.alive ? "running" : x.ready ? "down" : "loading");
  }

  async function reload() {
    const [r, l] = await Promise.all([api.get("/replicas"), api.get("/adapter-loads")]);
    const stale = r.data.filter((x) => x.stale).length;
    replicas.replaceChildren(...[h("h2", {}, "Replicas"), table([
      { label: "Replica", cell: (x) => h("span", { title: x.replica }, x.id ?? x.replica,
        x.this ? h("span", { class: "muted" }, " (this page's)") : null) },
      { label: "Engine", cell: engine },
      { label: "Running", num: true, cell: (x) => number(x.running ?? 0) },
      { label: "Waiting", num: true, cell: (x) => number(x.waiting ?? 0) },
      { label: "KV cache", num: true, cell: (x) => (x.kv_usage === undefined ? "–" : pct(x.kv_usage)) },
      { label: "In slots", cell: (x) => (x.resident_adapters || []).map(who).join(", ") || "–" },
      { label: "Host memory", num: true, cell: (x) => number(x.host_adapters ?? 0) },
      { label: "As of", cell: (x) => new Date(x.updated_at).toLocaleTimeString() },
    ], r.data, "No replica answered."),
    r.heartbeat_s ? null : h("p", { class: "muted note" }, "Only the replica that answered this page: " +
      "the replica heartbeat is off (replica_heartbeat_s = 0). Each replica's own state is on its /metrics."),
    stale ? h("p", { class: "muted note" }, `${stale} replica(s) missed 3 heartbeats: stopped, crashed or cut off ` +
      "from the database; their rows go after 10 minutes.") : null].filter(Boolean));
    const tiers = Object.entries(TIERS).filter(([t]) => l.tiers[t] && l.tiers[t].requests).map(([t, label]) =>
      `${number(l.tiers[t].requests)} ${label}` + (t === "device" ? "" : ` (mean ${ms(l.tiers[t].mean_ms)})`));
    loads.replaceChildren(h("h2", {}, "Cold loads"),
      h("p", { class: "muted" }, `Adapter requests on ${l.replica} since its engine started: ` +
        (tiers.length ? tiers.join(" · ") : "none yet") + "."),
      table([
        { label: "Adapter", cell: (a) => a.adapter },
        { label: "Tenant", cell: (a) => a.tenant ?? "–" },
        { label: "Cold loads", num: true, cell: (a) => number(a.cold_loads) },
        { label: "From disk", num: true, cell: (a) => number(a.from_disk) },
        { label: "Mean load", num: true, cell: (a) => ms(a.mean_ms) },
        { label: "Longest", num: true, cell: (a) => ms(a.max_ms) },
      ], l.data, "No cold loads yet: every adapter request found its adapter in a slot."));
  }
  await reload();
  return reload;
}

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

// KV tiers (docs/kv-tiers.md), shown only on a replica that has them: per tier, the share of
// looked-up prefix blocks it held, bytes read / written since start, and bytes held now.
function kvTiers(main, tiers) {
  const names = Object.keys(tiers);
  if (!names.length) return;
  if (!main.querySelector("#t-kv-tiers")) main.querySelector(".tiles").append(tile("t-kv-tiers", "KV tiers"));
  const rate = (t) => (t.hit_rate === null ? "–" : pct(t.hit_rate));
  set(main, "t-kv-tiers", names.map((n) => `${n} ${rate(tiers[n])}`).join(" · "),
    names.map((n) => {
      const t = tiers[n];
      const held = t.bytes_stored === null ? "" : `, ${bytes(t.bytes_stored)} held`;
      return `${n}: ${number(t.hits)} of ${number(t.queried)} blocks, ${bytes(t.bytes_read)} read, ` +
        `${bytes(t.bytes_written)} written${held}`;
    }).join(" · "));
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
    const a = s.architecture;
    const family = !a ? "" : ` (${a.family}` + (a.mixture_of_experts
      ? `, ${a.mixture_of_experts.num_experts} experts, ${a.mixture_of_experts.experts_per_token} per token)`
      : ")");
    status.textContent = `Model ${s.model}${family} on replica ${s.replica}` +
      (s.ready ? "" : " (loading)") + `; rates over the last ${s.window_s} s, all replicas.`;
    set(main, "t-rps", number(s.requests_per_s, 1), "completed requests", hist.rps);
    set(main, "t-tps", number(s.tokens_per_s, 1), "prompt + completion", hist.tps);
    if (!e) return;
    set(main, "t-queue", number(e.waiting), `waiting · ${number(e.running)} running`, hist.queue);
    set(main, "t-kv", pct(e.kv_usage), `of ${number(e.kv_blocks)} blocks`, hist.kv);
    // Loads from disk since the replica started, their mean time, and the failed ones.
    const mean = e.adapter_loads ? ` (mean ${ms((1000 * e.adapter_load_seconds) / e.adapter_loads)})` : "";
    const failed = e.adapter_load_failures ? ` · ${e.adapter_load_failures} failed` : "";
    set(main, "t-adapters", `${e.adapter_slots_used} / ${e.adapter_slots}`,
      `device slots · ${e.adapters_in_host} in host memory · ${e.adapter_loads} loads${mean}${failed}`);
    kvTiers(main, e.kv_tiers || {});
  }

  await poll();
  const timer = setInterval(() => poll().catch((err) => (status.textContent = err.message)), POLL_MS);
  const reloadEngine = await engineSection(main);
  const live = setInterval(() => reloadEngine().catch((err) => (status.textContent = err.message)), ENGINE_POLL_MS);
  const reloadLatency = await latencySection(main);
  const slow = setInterval(() => reloadLatency().catch((err) => (status.textContent = err.message)), LATENCY_POLL_MS);
  return () => {
    clearInterval(timer);
    clearInterval(live);
    clearInterval(slow);
  };
}
