// One adapter's versions and aliases, with promote, roll back, split and delete-version: the
// dashboard (any tenant's, through /admin/api) and the portal (the tenant's own, through
// /portal/api) show the same panel, each with its own API client and paths.

import { attempt, bytes, field, flash, h, table, when } from "./dom.js";

export const DEFAULT_ALIAS = "default";

// {"v3": 90, "v4": 10} -> "v3 90% · v4 10%"; one version alone -> "v3".
export function traffic(weights) {
  const pairs = Object.entries(weights || {});
  if (pairs.length === 1) return pairs[0][0];
  const total = pairs.reduce((n, [, w]) => n + w, 0);
  return pairs.map(([v, w]) => `${v} ${Math.round((100 * w) / total)}%`).join(" · ");
}

// The aliases that send a version traffic, as "default" or "default 10%" (of a split).
function usedBy(adapter, version) {
  const key = `v${version}`;
  return Object.entries(adapter.aliases)
    .filter(([, weights]) => key in weights)
    .map(([alias, weights]) => {
      const total = Object.values(weights).reduce((n, w) => n + w, 0);
      return weights[key] === total ? alias : `${alias} ${Math.round((100 * weights[key]) / total)}%`;
    });
}

// "v3=90 v4=10" (spaces or commas between pairs) -> {v3: 90, v4: 10}; null if malformed.
function parseSplit(text) {
  const weights = {};
  for (const pair of text.split(/[\s,]+/).filter(Boolean)) {
    const m = /^(v?\d+)\s*[=:]\s*(\d+)$/.exec(pair);
    if (!m) return null;
    const v = m[1].startsWith("v") ? m[1] : `v${m[1]}`;
    weights[v] = (weights[v] || 0) + Number(m[2]);
  }
  return Object.keys(weights).length ? weights : null;
}

/**
 * The panel of one adapter. `api` is the page's client (get/put/post/del), `base` the
 * adapter's path under it; `changed` runs after every change (to refresh the page's list);
 * `split` adds the canary form, `remove` the per-version delete.
 */
export async function versionsPanel({ api, base, title, changed, split = true, remove = true }) {
  const panel = h("section", { class: "card versions-panel", id: "adapter-versions" });

  async function act(action, done) {
    if ((await attempt(action, done)) === undefined) return;
    await render();
    if (changed) await changed();
  }

  function aliasPath(alias) {
    return `${base}/aliases/${encodeURIComponent(alias)}`;
  }

  async function render() {
    const a = await api.get(base);
    const current = Object.keys(a.aliases[DEFAULT_ALIAS] || {});
    const isDefault = (v) => current.length === 1 && current[0] === `v${v.version}`;
    const versions = table([
      { label: "Version", cell: (v) => h("strong", {}, `v${v.version}`) },
      { label: "Digest", cell: (v) => h("code", { title: v.sha256 }, v.sha256.slice(0, 12)) },
      { label: "Size", num: true, cell: (v) => bytes(v.bytes) },
      { label: "Rank", num: true, cell: (v) => v.rank },
      { label: "Created", cell: (v) => when(v.created_at) },
      { label: "Last used", cell: (v) => when(v.last_used_at) },
      { label: "Aliases", cell: (v) => h("span", { class: "aliases" },
        usedBy(a, v.version).map((text) => h("span", { class: "badge alias" }, text))) },
      { label: "", cell: (v) => h("span", { class: "row-actions" },
        isDefault(v) ? null : h("button", { type: "button", class: "primary",
          title: `Send all of ${DEFAULT_ALIAS}'s traffic to v${v.version}`,
          onclick: () => act(() => api.put(aliasPath(DEFAULT_ALIAS), { version: `v${v.version}` }),
            `${a.name}: ${DEFAULT_ALIAS} now sends all traffic to v${v.version}.`) }, "Promote"),
        remove ? h("button", { type: "button", class: "danger", onclick: () => {
          if (!confirm(`Delete ${a.name}@v${v.version}? Requests pinning it will fail.`)) return;
          act(() => api.del(`${base}/versions/v${v.version}`), `${a.name}@v${v.version} deleted.`);
        } }, "Delete") : null) },
    ], a.versions);
    const aliases = table([
      { label: "Alias", cell: ([alias]) => h("span", {}, h("strong", {}, alias), " ",
        h("code", { class: "muted" }, alias === DEFAULT_ALIAS ? a.name : `${a.name}@${alias}`)) },
      { label: "Traffic", cell: ([, weights]) => traffic(weights) },
      { label: "", cell: ([alias]) => h("span", { class: "row-actions" },
        h("button", { type: "button", title: `Put ${alias} back where it pointed before its last change`,
          onclick: () => act(() => api.post(`${aliasPath(alias)}/rollback`),
            `${a.name}@${alias} rolled back.`) }, "Roll back")) },
    ], Object.entries(a.aliases), "No aliases.");
    const heading = h("h2", {}, title || a.name);
    const hint = h("p", { class: "muted" }, "Requests naming ", h("code", {}, a.name),
      ` follow the ${DEFAULT_ALIAS} alias; `, h("code", {}, `${a.name}@v${a.version}`),
      " pins a version, ", h("code", {}, `${a.name}@canary`), " follows another alias.");
    panel.replaceChildren(heading, hint, h("h3", {}, "Versions"), h("div", { id: "version-list" }, versions),
      h("h3", {}, "Aliases"), h("div", { id: "alias-list" }, aliases), split ? splitForm(a) : null);
  }

  function splitForm(a) {
    const alias = h("input", { name: "alias", value: DEFAULT_ALIAS, required: true, pattern: "[A-Za-z][A-Za-z0-9_\\-]*", maxlength: "64" });
    const last = a.versions.slice(-2).map((v) => v.version);
    const example = last.length === 2 ? `v${last[0]}=90 v${last[1]}=10` : `v${last[0]}=100`;
    const weights = h("input", { name: "weights", required: true, placeholder: example, autocomplete: "off" });
    const form = h("form", { class: "form-grid split-form", id: "split-form" },
      h("h3", { class: "span" }, "Split traffic (canary)"),
      field("Alias", alias), field("Version=weight pairs", weights),
      h("div", { class: "actions" }, h("button", { type: "submit" }, "Split")));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const parsed = parseSplit(weights.value);
      if (!parsed) {
        flash(`Write version=weight pairs, e.g. ${example}`, "error");
        return;
      }
      act(() => api.put(aliasPath(alias.value), { weights: parsed }),
        `${a.name}@${alias.value}: ${traffic(parsed)}.`);
    });
    return form;
  }

  await render();
  return panel;
}
