// The tenant's adapters: upload by drag and drop (or a file picker), details, delete; each
// name's versions and aliases (promote, roll back, split, delete a version). The upload is POST
// /v1/adapters' own form, checked by the server with the same rules and errors: under a name
// the tenant has, it becomes the next version.

import { api } from "./portal-api.js";
import { DEFAULT_ALIAS, traffic, versionsPanel } from "./adapter-versions.js";
import { attempt, badge, bytes, field, flash, h, table, when } from "./dom.js";

const NAME = "[A-Za-z0-9][A-Za-z0-9._\\-]*";

// A dropped folder arrives as a directory entry: its files (one level) are the adapter's.
async function filesOf(dataTransfer) {
  const entries = [...(dataTransfer.items || [])].map((i) => i.webkitGetAsEntry?.()).filter(Boolean);
  if (!entries.some((e) => e.isDirectory)) return { files: [...dataTransfer.files], folder: null };
  const files = [];
  let folder = null;
  for (const entry of entries) {
    if (entry.isFile) files.push(await new Promise((ok, no) => entry.file(ok, no)));
    else {
      folder = folder || entry.name;
      const children = await new Promise((ok, no) => entry.createReader().readEntries(ok, no));
      for (const c of children.filter((c) => c.isFile)) files.push(await new Promise((ok, no) => c.file(ok, no)));
    }
  }
  return { files, folder };
}

function details(a) {
  const rows = [["Name", a.name], ["Newest version", `v${a.version}`], ["Status", a.status], ["Base model", a.base_model], ["Rank", a.rank],
    ["Alpha", a.alpha], ["Targets", a.targets.join(", ")], ["Size", bytes(a.bytes)],
    ["SHA-256", h("code", { class: "digest" }, a.sha256)], ["Uploaded", when(a.created_at)],
    ["Requests naming it use", traffic(a.aliases[DEFAULT_ALIAS])],
    ["Last used", when(a.last_used_at)]];
  return h("section", { class: "card", id: "adapter-details" },
    h("h2", {}, `Adapter ${a.name}`),
    h("dl", { class: "details" }, rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    h("p", { class: "muted" }, "Use it with ", h("code", {}, `"model": "${a.name}"`), " in a completion request."));
}

export async function adaptersPage(main) {
  let chosen = [];
  const name = h("input", { name: "name", id: "adapter-name", required: true, pattern: NAME, maxlength: "64", placeholder: "my-adapter" });
  const picker = h("input", { type: "file", id: "adapter-files", multiple: true, accept: ".json,.safetensors,.gz,.tgz,.zip", class: "visually-hidden" });
  const chosenList = h("p", { class: "muted", id: "chosen" }, "No files chosen.");
  const zone = h("div", { class: "dropzone", id: "dropzone", tabindex: "0", role: "button",
    "aria-label": "Drop adapter files here, or press to choose them" },
    h("strong", {}, "Drop the adapter here"),
    h("span", { class: "muted" }, "its folder, or adapter_config.json + adapter_model.safetensors, or one .tar.gz / .zip"),
    h("span", { class: "link" }, "or choose files"));
  const submit = h("button", { type: "submit", class: "primary", id: "upload" }, "Upload");
  // A name's first version takes its traffic anyway; a later one only when promoted.
  const promote = h("input", { type: "checkbox", id: "adapter-promote", name: "promote" });
  const promoteField = h("label", { class: "check span" }, promote,
    " Under a name you have, the upload is its next version: send all traffic to it now");
  const error = h("p", { class: "error", id: "upload-error", role: "alert", hidden: true });
  const form = h("form", { class: "card", id: "upload-form" }, h("h2", {}, "Upload an adapter"),
    zone, picker, chosenList, h("div", { class: "form-grid" }, field("Name", name), promoteField,
      h("div", { class: "actions" }, submit)), error);
  const detailSlot = h("div");
  const list = h("section", { class: "card", id: "adapters" });

  function choose(files, folder) {
    chosen = files;
    chosenList.textContent = files.length
      ? `${files.length} file${files.length > 1 ? "s" : ""}: ${files.map((f) => `${f.name} (${bytes(f.size)})`).join(", ")}`
      : "No files chosen.";
    if (folder && !name.value) name.value = folder.replace(/[^A-Za-z0-9._-]/g, "-").replace(/^[^A-Za-z0-9]+/, "").slice(0, 64);
    error.hidden = true;
  }

  zone.addEventListener("click", () => picker.click());
  zone.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); picker.click(); } });
  picker.addEventListener("change", () => choose([...picker.files], null));
  for (const kind of ["dragenter", "dragover"]) {
    zone.addEventListener(kind, (ev) => { ev.preventDefault(); zone.classList.add("over"); });
  }
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", async (ev) => {
    ev.preventDefault();
    zone.classList.remove("over");
    const { files, folder } = await filesOf(ev.dataTransfer);
    choose(files, folder);
  });

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    error.hidden = true;
    if (!chosen.length) {
      error.textContent = "Choose or drop the adapter's files first.";
      error.hidden = false;
      return;
    }
    const data = new FormData();
    data.append("name", name.value);
    data.append("promote", promote.checked ? "true" : "false");
    for (const f of chosen) data.append("files", f, f.name);
    submit.disabled = true;
    submit.textContent = "Uploading…";
    try {
      const a = await api.post("/adapters", data);
      const taken = a.aliases[DEFAULT_ALIAS]?.[`v${a.version}`] ? "" : ` (its default stays: promote it under Details)`;
      flash(`Adapter ${a.name} v${a.version} uploaded${taken}.`);
      choose([], null);
      name.value = "";
      picker.value = "";
      await reload();
    } catch (e) {
      error.textContent = e.message; // the server's own reason: what to fix
      error.hidden = false;
    } finally {
      submit.disabled = false;
      submit.textContent = "Upload";
    }
  });

  // The adapter's details and its versions panel; a change there refreshes both and the list.
  async function open(adapterName) {
    const base = `/adapters/${encodeURIComponent(adapterName)}`;
    const refresh = async () => {
      detailSlot.firstChild?.replaceWith(details(await api.get(base)));
      await reload();
    };
    const panel = await versionsPanel({ api, base, title: `Versions of ${adapterName}`, changed: refresh });
    detailSlot.replaceChildren(details(await api.get(base)), panel);
    detailSlot.scrollIntoView({ block: "nearest" });
  }

  async function reload() {
    const { data } = await api.get("/adapters");
    const total = data.reduce((n, a) => n + a.bytes, 0);
    list.replaceChildren(h("h2", {}, `Your adapters (${data.length}, ${bytes(total)})`), table([
      { label: "Name", cell: (a) => h("strong", {}, a.name) },
      { label: "Versions", cell: (a) => a.versions.map((v) => `v${v.version}`).join(", ") },
      { label: "Default", cell: (a) => traffic(a.aliases[DEFAULT_ALIAS]) },
      { label: "Status", cell: (a) => badge(a.status) },
      { label: "Size", num: true, cell: (a) => bytes(a.bytes) },
      { label: "Rank", num: true, cell: (a) => a.rank },
      { label: "Last used", cell: (a) => when(a.last_used_at) },
      { label: "", cell: (a) => h("span", { class: "row-actions" },
        h("button", { type: "button", onclick: () => attempt(() => open(a.name)) }, "Details"),
        h("button", { type: "button", class: "danger", onclick: async () => {
          if (!confirm(`Delete adapter ${a.name}? Requests naming it will fail.`)) return;
          if (await attempt(() => api.del(`/adapters/${encodeURIComponent(a.name)}`), `Adapter ${a.name} deleted.`)) {
            detailSlot.replaceChildren();
            reload();
          }
        } }, "Delete")) },
    ], data, "No adapters yet: drop one above."));
  }

  main.append(h("h1", {}, "Adapters"), form, detailSlot, list);
  await reload();
}
