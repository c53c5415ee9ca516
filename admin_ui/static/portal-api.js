// The portal's API, called with the tenant's session cookie. State-changing calls carry the
// session's CSRF token (the server refuses them without it); a 401 means the session ended
// (signed out, expired, or the key it was signed in with was revoked).

let session = null;

export async function sessionInfo() {
  if (session === null) {
    const r = await fetch("/portal/session", { credentials: "same-origin" });
    if (r.status === 401) signedOut();
    session = await r.json();
  }
  return session;
}

function signedOut() {
  location.assign("/portal/login");
  throw new Error("signed out");
}

export class ApiError extends Error {}

async function call(method, path, body) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") headers["X-CSRF-Token"] = (await sessionInfo()).csrf_token;
  let payload;
  if (body instanceof FormData) payload = body; // the browser sets the multipart boundary
  else if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const r = await fetch("/portal/api" + path, { method, headers, credentials: "same-origin", body: payload });
  if (r.status === 401) signedOut();
  const data = r.status === 204 ? null : await r.json().catch(() => null);
  if (!r.ok) throw new ApiError(data?.error?.message || `${method} ${path}: HTTP ${r.status}`);
  return data;
}

export const api = {
  get: (path) => call("GET", path),
  post: (path, body) => call("POST", path, body),
  put: (path, body) => call("PUT", path, body),
  del: (path) => call("DELETE", path),
};

export async function signOut() {
  await fetch("/portal/logout", {
    method: "POST",
    headers: { "X-CSRF-Token": (await sessionInfo()).csrf_token },
    credentials: "same-origin",
  });
  location.assign("/portal/login");
}
