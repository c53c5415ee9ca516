// What the dashboard's and the portal's key pages share: the once-shown secret with its copy
// button, and a key's state as a badge.

import { attempt, badge, flash, h } from "./dom.js";

async function copy(text, input) {
  // The Clipboard API needs a secure context (https or localhost); elsewhere fall back to a
  // selection the user can copy by hand.
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    flash("Copied to the clipboard.");
  } else {
    input.select();
    flash("Selected: press Ctrl+C (or ⌘C) to copy.");
  }
}

export function secretBox(created) {
  const out = h("input", { id: "new-secret", readonly: true, value: created.secret, "aria-label": "New key secret" });
  return h("section", { class: "card secret", role: "alert" },
    h("h2", {}, `Key ${created.name} created`),
    h("p", {}, "Copy the secret now: it is shown this once, and only its hash is kept."),
    h("div", { class: "copy-row" }, out,
      h("button", { type: "button", class: "primary", id: "copy-secret", onclick: () => attempt(() => copy(created.secret, out)) }, "Copy")));
}

export function keyState(k) {
  if (k.revoked_at) return badge("revoked");
  if (k.expires_at && new Date(k.expires_at) < new Date()) return badge("expired");
  return badge("active");
}
