// The admin API, called with the session cookie. State-changing calls carry the session's
// CSRF token (the server refuses them without it); a 401 means the session ended.

let csrf = null;

async function token() {
  if (csrf === null) {
    const r = await fetch("/admin/session", { credentials: "same-origin" });
    if (r.status === 401) signedOut();
    csrf = (await r.json()).csrf_token;
  }
  return csrf;
}

function signedOut() {
  location.assign("/admin/login");
  throw new Error("signed out");
}

export class ApiError extends Error {}

async function call(method, path, body) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") headers["X-CSRF-Token"] = await token();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch("/admin/api" + path, {
    method,
    headers,
    credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) signedOut();
  const data = r.status === 204 ? null : await r.json();
  if (!r.ok) throw new ApiError(data?.error?.message || `${method} ${path}: HTTP ${r.status}`);
  return data;
}

export const api = {
  get: (path) => call("GET", path),
  post: (path, body) => call("POST", path, body),
  patch: (path, body) => call("PATCH", path, body),
  put: (path, body) => call("PUT", path, body),
  del: (path) => call("DELETE", path),
};

export async function signOut() {
  await fetch("/admin/logout", {
    method: "POST",
    headers: { "X-CSRF-Token": await token() },
    credentials: "same-origin",
  });
  location.assign("/admin/login");
}
