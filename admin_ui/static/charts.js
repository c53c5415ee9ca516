// Charts drawn by us: horizontal stacked bars (HTML, so labels wrap on a phone), vertical
// bars for a time axis and a sparkline (SVG scaled to the container's width).

import { h, number } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  el.append(...children);
  return el;
}

// rows: [{label, parts: [n, n]}], series: [{name, cls}]: one bar per row, parts stacked.
export function barsChart(title, rows, series) {
  const max = Math.max(1, ...rows.map((r) => r.parts.reduce((a, b) => a + b, 0)));
  const legend = h("p", { class: "legend" }, series.map((x) => h("span", { class: `key ${x.cls}` }, x.name)));
  const body = rows.length
    ? rows.map((r) => {
        const total = r.parts.reduce((a, b) => a + b, 0);
        const bar = h("div", { class: "bar", role: "img", "aria-label": `${r.label}: ${total}` });
        r.parts.forEach((n, i) => {
          const seg = h("span", { class: `seg ${series[i].cls}`, title: `${series[i].name}: ${number(n)}` });
          seg.style.width = `${(100 * n) / max}%`;
          bar.append(seg);
        });
        return h("div", { class: "bar-row" }, h("span", { class: "bar-label", title: r.label }, r.label), bar,
          h("span", { class: "bar-value" }, number(total)));
      })
    : [h("p", { class: "muted" }, "No usage in this period.")];
  return h("figure", { class: "chart" }, h("figcaption", {}, title), legend, ...body);
}

// points: [{label, value}] along a time axis, drawn as columns (HTML, so the labels keep
// their size at any width).
export function columnsChart(title, points, unit) {
  const max = Math.max(1, ...points.map((p) => p.value));
  const every = Math.ceil(points.length / 10); // at most ~10 labels, whatever the period
  const cols = h("div", { class: "cols", role: "img", "aria-label": title });
  const labels = h("div", { class: "col-labels", "aria-hidden": "true" });
  points.forEach((p, i) => {
    const col = h("span", { class: "col", title: `${p.label}: ${number(p.value)} ${unit}` });
    col.style.height = `${(100 * p.value) / max}%`;
    cols.append(h("span", { class: "col-slot" }, col));
    labels.append(h("span", {}, i % every === 0 ? p.label : ""));
  });
  const top = points.some((p) => p.value > 0) ? `max ${number(max)} ${unit}` : "No usage in this period.";
  return h("figure", { class: "chart wide" }, h("figcaption", {}, title),
    h("p", { class: "legend" }, top), cols, labels);
}

// The last values of one live series, newest last.
export function sparkline(values) {
  const W = 200, H = 40;
  const max = Math.max(1e-9, ...values);
  const step = W / Math.max(values.length - 1, 1);
  const pts = values.map((v, i) => `${(i * step).toFixed(1)},${(H - 2 - ((H - 4) * v) / max).toFixed(1)}`);
  return s("svg", { viewBox: `0 0 ${W} ${H}`, class: "spark", "aria-hidden": "true", preserveAspectRatio: "none" },
    s("polyline", { points: pts.join(" ") || `0,${H - 2}`, class: "spark-line" }));
}
