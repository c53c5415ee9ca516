// A tiny element builder and the formatters every page shares. Text always goes in as text
// nodes, never as HTML, so a tenant or adapter name can never become markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined && c !== false) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

export function table(columns, rows, empty = "Nothing here yet.") {
  if (!rows.length) return h("p", { class: "muted" }, empty);
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      {},
      h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : null }, c.label)))),
      h(
        "tbody",
        {},
        rows.map((row) =>
          h(
            "tr",
            {},
            columns.map((c) =>
              h("td", { class: c.num ? "num" : null, "data-label": c.label }, c.cell(row))
            )
          )
        )
      )
    )
  );
}

export function field(label, input) {
  return h("label", { class: "field" }, h("span", {}, label), input);
}

export function flash(message, kind = "ok") {
  const el = document.getElementById("flash");
  el.textContent = message;
  el.className = `flash ${kind}`;
  el.hidden = false;
  clearTimeout(flash.timer);
  flash.timer = setTimeout(() => (el.hidden = true), kind === "error" ? 8000 : 4000);
}

// Run an action from a button or form: errors are shown, not thrown into the console.
export async function attempt(action, done) {
  try {
    const result = await action();
    if (done) flash(done);
    return result;
  } catch (e) {
    flash(e.message, "error");
    return undefined;
  }
}

const units = ["B", "KiB", "MiB", "GiB", "TiB"];
export function bytes(n) {
  let i = 0;
  while (n >= 1024 && i < units.length - 1) (n /= 1024), i++;
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

export function number(n, digits = 0) {
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function when(iso) {
  if (!iso) return "never";
  const d = new Date(iso.endsWith("Z") || iso.includes("+") ? iso : iso + "Z");
  return d.toISOString().slice(0, 16).replace("T", " ") + " UTC";
}

export function badge(text) {
  return h("span", { class: `badge ${text}` }, text);
}
