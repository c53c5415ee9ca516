// The tenant portal's shell: one page at a time, chosen by the URL's #fragment.

import { sessionInfo, signOut } from "./portal-api.js";
import { attempt } from "./dom.js";
import { accountPage } from "./portal-account.js";
import { adaptersPage } from "./portal-adapters.js";
import { guardrailsPage } from "./portal-guardrails.js";
import { keysPage } from "./portal-keys.js";
import { usagePage } from "./portal-usage.js";

const pages = { account: accountPage, adapters: adaptersPage, keys: keysPage, usage: usagePage,
  guardrails: guardrailsPage };
const titles = { account: "Account", adapters: "Adapters", keys: "API keys", usage: "Usage",
  guardrails: "Guardrails" };

async function show() {
  const [name, query] = location.hash.slice(1).split("?");
  const page = pages[name] ? name : "account";
  document.getElementById("flash").hidden = true; // it spoke of the page we left
  for (const a of document.querySelectorAll("#nav a")) {
    a.toggleAttribute("aria-current", a.getAttribute("href") === `#${page}`);
  }
  const main = document.getElementById("page");
  main.replaceChildren();
  main.dataset.page = page;
  document.title = `${titles[page]} · loraplex`;
  await attempt(() => pages[page](main, new URLSearchParams(query || "")));
}

document.getElementById("signout").addEventListener("click", () => attempt(signOut));
window.addEventListener("hashchange", show);
attempt(async () => {
  const s = await sessionInfo();
  document.getElementById("who").textContent = `${s.tenant} · key ${s.key_prefix}…`;
});
show();
