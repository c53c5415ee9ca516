"""The admin dashboard's session cookie and CSRF token, both stateless.

A session is a cookie `v1.<expiry>.<nonce>.<mac>`: an HMAC-SHA256 over the version, expiry
and nonce, keyed by a key derived from the admin key. Nothing is stored on the server, so any
replica that shares the admin key (one Kubernetes Secret) accepts a cookie another replica
issued, and rotating the admin key signs every dashboard user out.

CSRF: the cookie is `SameSite=Strict`, and on top of that every state-changing request the
cookie authenticates must carry `X-CSRF-Token`, an HMAC of the cookie value under a second
derived key. Another site can make a browser send the cookie but can never read it (HttpOnly)
nor compute the token; the dashboard's own script gets the token from `GET /admin/session`.

Sign-out clears the cookie in the browser; a copy taken before lives until its expiry
(`SESSION_SECONDS`), the price of keeping no server-side session table.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from fastapi import Request, Response

from loraplex.platform.errors import APIError

SESSION_COOKIE = "lpx_admin"
CSRF_HEADER = "x-csrf-token"
SESSION_SECONDS = 8 * 3600
COOKIE_PATH = "/admin"
_VERSION = "v1"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _derived(admin_key: str, purpose: str) -> bytes:
    # Separate keys per purpose: a CSRF token can never be replayed as a session MAC.
    return hmac.new(admin_key.encode(), f"loraplex-admin-{purpose}".encode(), "sha256").digest()


def _mac(admin_key: str, purpose: str, message: str) -> str:
    return hmac.new(_derived(admin_key, purpose), message.encode(), hashlib.sha256).hexdigest()


def new_session(admin_key: str, *, now: float | None = None) -> tuple[str, int]:
    """A fresh signed session value and its expiry (unix seconds)."""
    expires = int(now if now is not None else time.time()) + SESSION_SECONDS
    body = f"{_VERSION}.{expires}.{secrets.token_urlsafe(16)}"
    return f"{body}.{_mac(admin_key, 'session', body)}", expires


def session_expiry(admin_key: str, value: str, *, now: float | None = None) -> int | None:
    """The expiry of a valid, unexpired session value; None for anything else."""
    body, _, mac = value.rpartition(".")
    parts = body.split(".")
    if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isdigit():
        return None
    if not hmac.compare_digest(mac, _mac(admin_key, "session", body)):
        return None
    expires = int(parts[1])
    return expires if expires > (now if now is not None else time.time()) else None


def csrf_token(admin_key: str, session_value: str) -> str:
    return _mac(admin_key, "csrf", session_value)


def _set_cookie(response: Response, request: Request, name: str, value: str, path: str):
    response.set_cookie(
        name,
        value,
        max_age=SESSION_SECONDS,
        path=path,
        httponly=True,
        samesite="strict",
        # Behind TLS (directly, or a proxy uvicorn trusts for X-Forwarded-Proto) the cookie
        # never travels over plain HTTP; on a laptop's http://127.0.0.1 it has to.
        secure=request.url.scheme == "https",
    )


def _check_csrf(request: Request, expected: str, what: str) -> None:
    """A request that changes state must carry its session's CSRF token (403 otherwise)."""
    if request.method in _SAFE_METHODS:
        return
    if not hmac.compare_digest(request.headers.get(CSRF_HEADER, ""), expected):
        raise APIError(
            403, f"missing or wrong {CSRF_HEADER} header for a {what} request", "csrf_failed"
        )


def set_session_cookie(response: Response, request: Request, value: str) -> None:
    _set_cookie(response, request, SESSION_COOKIE, value, COOKIE_PATH)


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


def check_session_request(request: Request, admin_key: str) -> None:
    """Admit a request authenticated by the session cookie, or raise 401/403."""
    value = request.cookies.get(SESSION_COOKIE, "")
    if session_expiry(admin_key, value) is None:
        raise APIError(401, "dashboard session missing or expired: sign in again", "no_session")
    _check_csrf(request, csrf_token(admin_key, value), "dashboard")


# --- the tenant portal ---------------------------------------------------------------------
# The same scheme for a tenant's session at /portal: `p1.<tenant>.<key>.<expiry>.<nonce>.<mac>`
# signed under keys of its own purpose (a portal cookie is never an admin one, nor the other
# way round). It names the API key it was signed in with: every portal request checks that the
# key still works, so revoking it, its expiry or the tenant's suspension ends the session too.

PORTAL_COOKIE = "lpx_portal"
PORTAL_PATH = "/portal"
_PORTAL_VERSION = "p1"


def new_portal_session(
    admin_key: str, tenant_id: int, key_id: int, *, now: float | None = None
) -> tuple[str, int]:
    """A signed portal session for the tenant's key, and its expiry (unix seconds)."""
    expires = int(now if now is not None else time.time()) + SESSION_SECONDS
    body = f"{_PORTAL_VERSION}.{tenant_id}.{key_id}.{expires}.{secrets.token_urlsafe(16)}"
    return f"{body}.{_mac(admin_key, 'portal-session', body)}", expires


def portal_session(
    admin_key: str, value: str, *, now: float | None = None
) -> tuple[int, int, int] | None:
    """(tenant id, key id, expiry) of a valid, unexpired portal session; None otherwise."""
    body, _, mac = value.rpartition(".")
    parts = body.split(".")
    if len(parts) != 5 or parts[0] != _PORTAL_VERSION or not all(p.isdigit() for p in parts[1:4]):
        return None
    if not hmac.compare_digest(mac, _mac(admin_key, "portal-session", body)):
        return None
    tenant_id, key_id, expires = (int(p) for p in parts[1:4])
    if expires <= (now if now is not None else time.time()):
        return None
    return tenant_id, key_id, expires


def portal_csrf_token(admin_key: str, session_value: str) -> str:
    return _mac(admin_key, "portal-csrf", session_value)


def set_portal_cookie(response: Response, request: Request, value: str) -> None:
    _set_cookie(response, request, PORTAL_COOKIE, value, PORTAL_PATH)


def clear_portal_cookie(response: Response) -> None:
    response.delete_cookie(PORTAL_COOKIE, path=PORTAL_PATH, httponly=True, samesite="strict")


def check_portal_request(request: Request, admin_key: str) -> tuple[int, int]:
    """(tenant id, key id) of a request authenticated by the portal cookie (with its CSRF
    header when it changes state), or raise 401/403."""
    value = request.cookies.get(PORTAL_COOKIE, "")
    found = portal_session(admin_key, value)
    if found is None:
        raise APIError(401, "portal session missing or expired: sign in again", "no_session")
    _check_csrf(request, portal_csrf_token(admin_key, value), "portal")
    return found[0], found[1]
