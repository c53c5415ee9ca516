// The dashboard shell: one page at a time, chosen by the URL's #fragment.

import { signOut } from "./api.js";
import { attempt } from "./dom.js";
import { adaptersPage } from "./page-adapters.js";
import { batchesPage } from "./page-batches.js";
import { guardrailsPage } from "./page-guardrails.js";
import { keysPage } from "./page-keys.js";
import { overviewPage } from "./page-overview.js";
import { tenantsPage } from "./page-tenants.js";
import { usagePage } from "./page-usage.js";

const pages = {
  overview: overviewPage,
  tenants: tenantsPage,
  keys: keysPage,
  adapters: adaptersPage,
  usage: usagePage,
  batches: batchesPage,
  guardrails: guardrailsPage,
};

let stop = null; // what the current page must do when left (the overview stops polling)

async function show() {
  const [name, query] = location.hash.slice(1).split("?");
  const page = pages[name] ? name : "overview";
  if (stop) stop();
  document.getElementById("flash").hidden = true; // it spoke of the page we left
  stop = null;
  for (const a of document.querySelectorAll("#nav a")) {
    a.toggleAttribute("aria-current", a.getAttribute("href") === `#${page}`);
  }
  const main = document.getElementById("page");
  main.replaceChildren();
  main.dataset.page = page;
  document.title = `${page[0].toUpperCase()}${page.slice(1)} · loraplex admin`;
  stop = (await attempt(() => pages[page](main, new URLSearchParams(query || "")))) || null;
}

document.getElementById("signout").addEventListener("click", () => attempt(signOut));
window.addEventListener("hashchange", show);
show();
