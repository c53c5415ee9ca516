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

// A nice round step for about `count` ticks up to `max` (1, 2 or 5 times a power of ten).
function niceStep(max, count) {
  const raw = max / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
}

function timeLabel(d, span) {
  const iso = d.toISOString();
  return span > 86400e3 * 1.5 ? iso.slice(5, 10) + " " + iso.slice(11, 13) + "h" : iso.slice(11, 16);
}

// series over time: points [{t: Date, v: {key: number|null}}], series [{key, name, cls}],
// from `start` to `end` (Dates), bucket `stepMs` apart (a longer gap breaks the lines). Drawn
// in SVG at the figure's own pixel width (redrawn when it changes, so text keeps its size),
// with value and time axes, and the values of the nearest time under the pointer.
export function lineChart(title, points, series, { unit, start, end, stepMs, id }) {
  const legend = h("p", { class: "legend" }, series.map((x) => h("span", { class: `key ${x.cls}` }, x.name)));
  const box = h("div", { class: "plot" });
  const tip = h("div", { class: "tip", hidden: true, role: "status" });
  const fig = h("figure", { class: "chart line-chart", id }, h("figcaption", {}, title), legend, box, tip);
  const values = points.flatMap((p) => series.map((x) => p.v[x.key])).filter((v) => v !== null && v !== undefined);
  if (!values.length) {
    box.append(h("p", { class: "muted" }, "No requests with this timing in this period."));
    return fig;
  }
  const step = niceStep(Math.max(...values) || 1, 4);
  const top = Math.ceil((Math.max(...values) || 1) / step) * step;
  const t0 = start.getTime(), t1 = end.getTime();
  const fmt = (v) => `${number(v, v < 10 ? 1 : 0)} ${unit}`;
  const decimals = step >= 1 ? 0 : Math.ceil(-Math.log10(step)); // as many as the ticks' step has

  function draw() {
    tip.hidden = true; // it pointed at the old drawing
    const W = Math.max(240, box.clientWidth || 600), H = 200, L = 56, R = 10, T = 10, B = 24;
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => T + (1 - v / top) * (H - T - B);
    const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "axes", role: "img", "aria-label": title });
    for (let v = 0; v <= top + step / 2; v += step) {
      svg.append(s("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: v ? "grid" : "axis" }),
        s("text", { x: L - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, `${number(v, decimals)} ${unit}`));
    }
    const ticks = Math.max(2, Math.floor((W - L - R) / 90));
    for (let i = 0; i <= ticks; i++) {
      const t = t0 + ((t1 - t0) * i) / ticks;
      svg.append(s("line", { x1: x(t), x2: x(t), y1: H - B, y2: H - B + 4, class: "axis" }),
        s("text", { x: x(t), y: H - 6, class: "tick", "text-anchor": i === 0 ? "start" : i === ticks ? "end" : "middle" },
          timeLabel(new Date(t), t1 - t0)));
    }
    for (const ser of series) {
      let d = "", prev = null;
      for (const p of points) {
        const v = p.v[ser.key];
        if (v === null || v === undefined) { prev = null; continue; }
        const t = p.t.getTime();
        d += `${prev !== null && t - prev <= stepMs * 1.5 ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)} `;
        prev = t;
      }
      svg.append(s("path", { d, class: `line ${ser.cls}` }));
      for (const p of points) {
        const v = p.v[ser.key];
        if (v !== null && v !== undefined) svg.append(s("circle", { cx: x(p.t.getTime()), cy: y(v), r: 2.5, class: `dot ${ser.cls}` }));
      }
    }
    const cursor = s("line", { y1: T, y2: H - B, class: "cursor", visibility: "hidden" });
    const hit = s("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "hit" });
    svg.append(cursor, hit);
    hit.addEventListener("pointermove", (ev) => {
      const r = svg.getBoundingClientRect();
      const at = t0 + ((ev.clientX - r.left - L) / (W - L - R)) * (t1 - t0);
      const p = points.reduce((a, b) => (Math.abs(b.t - at) < Math.abs(a.t - at) ? b : a));
      cursor.setAttribute("x1", x(p.t.getTime()));
      cursor.setAttribute("x2", x(p.t.getTime()));
      cursor.setAttribute("visibility", "visible");
      tip.replaceChildren(h("strong", {}, p.t.toISOString().slice(0, 16).replace("T", " ") + " UTC"),
        ...series.map((ser) => h("span", { class: `key ${ser.cls}` },
          `${ser.name}: ${p.v[ser.key] === null || p.v[ser.key] === undefined ? "–" : fmt(p.v[ser.key])}`)),
        p.n !== undefined ? h("span", { class: "muted" }, `${number(p.n)} requests`) : "");
      tip.hidden = false;
      const left = Math.max(0, Math.min(x(p.t.getTime()) + 12, W - tip.offsetWidth));
      tip.style.left = `${left}px`;
    });
    hit.addEventListener("pointerleave", () => {
      tip.hidden = true;
      cursor.setAttribute("visibility", "hidden");
    });
    box.replaceChildren(svg);
  }
  let width = 0;
  new ResizeObserver(() => {
    if (box.clientWidth && box.clientWidth !== width) {
      width = box.clientWidth;
      draw();
    }
  }).observe(box);
  return fig;
}
