"""Hostile edge strings in every field of every route: never a 5xx, and every refusal in OpenAI's
error shape with a machine-readable `code`.

The routes and their fields come from the app itself (its OpenAPI document, built over every
route, the dashboard's hidden ones included), so a new route or field is covered without
editing this file. schemathesis (test_fuzz_api.py) already varies types; this feeds the strings
that slip past type checks: a trailing newline (Python's `re` lets `$` match before it), NUL,
an RTL override, a lone surrogate (legal JSON, not encodable as UTF-8), very long and empty
strings, and raw bytes that are not UTF-8, in JSON bodies, form fields, file names, path and
query parameters.
"""

from __future__ import annotations

import copy
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute, iter_route_contexts

from loraplex.platform.admin_session import CSRF_HEADER
from loraplex.platform.api.deps import require_admin
from loraplex.platform.db import crud
from tests.platform.conftest import _empty_pg_schema
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.uploads import folder_parts

HOSTILE = {
    "newline": "evil\n",
    "nul": "a\x00b",
    "rtl": "\u202eevil",
    "surrogate": "\ud800",
    "long": "x" * 20_000,
    "empty": "",
}
# In a URL: percent-encoded, with two byte strings that are not UTF-8 (an overlong '/', a
# surrogate's encoding); 4,000 characters stay under the server's request-line limit.
URL_HOSTILE = {
    "newline": "evil%0A",
    "nul": "a%00b",
    "rtl": "%E2%80%AEevil",
    "overlong": "%C0%AF",
    "surrogate": "%ED%A0%80",
    "long": "x" * 4_000,
    "huge-number": "9" * 30,
    "empty": "",
}
NOT_UTF8 = b"\xc0\xaf\xed\xa0\x80\xff"
# Values the walk cannot guess from the schema, so that every field but the hostile one is
# valid and the request gets as far as it can. max_tokens keeps accepted completions short.
KNOWN = {
    "max_tokens": 1,
    "messages": [{"role": "user", "content": "hi"}],
    "lora_name": "hostile-ok",
    "lora_path": "peft-folder",
}
MAX_DEPTH = 4


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tiny_models, tmp_path_factory):
    # Each registry refuses its own values: PostgreSQL NUL in text and ids past 32/64 bits,
    # SQLite's driver ints past 64 bits.
    overrides = {}
    if request.param == "postgresql":
        overrides["database_url"] = request.getfixturevalue("pg_database_url")
        _empty_pg_schema(overrides["database_url"])
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("hostile"),
                    max_model_len=128, **overrides) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def ids(server, tiny_adapters) -> dict:
    """Real ids for path parameters, so a hostile value in one field meets valid others."""
    tenant_id, key = server.new_tenant("hostile")
    with server.sessions() as session:
        _, spare = crud.create_key(session, tenant_id=tenant_id, name="spare")
        key_id = spare.id
    good = tiny_adapters["llama"]["qv4"]
    # A real folder for vLLM's load_lora_adapter, so its other fields are checked past the path.
    shutil.copytree(good, server.settings.adapter_import_roots[0] / KNOWN["lora_path"])
    r = httpx.post(f"{server.url}/v1/adapters", headers=_auth(key), data={"name": "mine"},
                   files=folder_parts(good), timeout=60)  # fmt: skip
    assert r.status_code == 201, r.text
    return {"tenant_id": tenant_id, "key_id": key_id, "name": "mine", "key": key,
            "model": server.state.model_name, "files": folder_parts(good)}  # fmt: skip


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _document(app) -> dict:
    """The app's OpenAPI document, plus the routes it hides (the dashboard's)."""
    doc = copy.deepcopy(app.openapi())
    hidden = []
    for ctx in iter_route_contexts(app.routes):
        route = ctx.original_route
        if isinstance(route, APIRoute) and not route.include_in_schema:
            route = copy.copy(route)
            route.include_in_schema = True
            route.path, route.path_format = ctx.path, ctx.path_format
            hidden.append(route)
    more = get_openapi(title="hidden", version="0", routes=hidden)
    for path, ops in more["paths"].items():
        doc["paths"].setdefault(path, {}).update(ops)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(
        more.get("components", {}).get("schemas", {})
    )
    return doc


def _needs_admin(app, path: str, method: str) -> bool:
    for ctx in iter_route_contexts(app.routes):
        if ctx.path == path and method.upper() in (ctx.methods or ()):
            stack = [ctx.dependant]
            while stack:
                d = stack.pop()
                if d.call is require_admin:
                    return True
                stack += d.dependencies
    return False


class Schemas:
    def __init__(self, doc: dict):
        self.defs = doc.get("components", {}).get("schemas", {})

    def resolve(self, s: dict) -> dict:
        while "$ref" in s:
            s = self.defs[s["$ref"].rsplit("/", 1)[1]]
        return s

    def alternatives(self, s: dict) -> list[dict]:
        s = self.resolve(s)
        alts = s.get("anyOf") or s.get("oneOf")
        if alts:
            return [a for alt in alts for a in self.alternatives(alt)]
        return [s]

    def example(self, s: dict, name: str = ""):
        """A value of schema `s`: required fields only, KNOWN ones by name."""
        if name in KNOWN:
            return copy.deepcopy(KNOWN[name])
        s = next((a for a in self.alternatives(s) if a.get("type") != "null"), {})
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return s["enum"][0]
        kind = s.get("type")
        if kind == "object" or "properties" in s:
            props = s.get("properties", {})
            wanted = [k for k in props if k in s.get("required", ()) or k in KNOWN]
            return {k: self.example(props[k], k) for k in wanted}
        if kind == "array":
            return [self.example(s.get("items", {}))]
        return {"integer": 1, "number": 0.5, "boolean": False}.get(kind, "x")

    def mutants(self, s: dict, base, value, depth: int = 0):
        """Copies of `base` (a value of `s`) with one node, at any depth, replaced by `value`."""
        yield value
        if depth >= MAX_DEPTH:
            return
        for alt in self.alternatives(s):
            if alt.get("type") == "object" or "properties" in alt:
                b = base if isinstance(base, dict) else self.example(alt)
                for prop, sub in alt.get("properties", {}).items():
                    inner = b[prop] if prop in b else self.example(sub, prop)
                    for m in self.mutants(sub, inner, value, depth + 1):
                        yield {**b, prop: m}
            elif alt.get("type") == "array" and "items" in alt:
                b = base if isinstance(base, list) and base else [self.example(alt["items"])]
                for m in self.mutants(alt["items"], b[0], value, depth + 1):
                    yield [m, *b[1:]]


def _check(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            pytest.fail(f"{what}: {r.status_code} not in OpenAI's error shape: {r.text[:300]}")
        assert set(error) == {"message", "type", "param", "code"}, f"{what}: {error}"
        assert isinstance(error["code"], str) and error["code"], f"{what}: {error}"
        assert isinstance(error["message"], str) and error["message"], f"{what}: {error}"


def _portal_session(server, key: str) -> tuple[dict, dict]:
    """The tenant portal's routes take a signed-in browser's cookie and CSRF header, not a
    key: (cookies, headers) of a session opened with the tenant's key."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/portal/login", data={"api_key": key})
        csrf = client.get("/portal/session").json()["csrf_token"]
        return dict(client.cookies), {CSRF_HEADER: csrf}


def _operations(server, ids):
    app = server.app
    doc = _document(app)
    schemas = Schemas(doc)
    portal = None
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            params = op.get("parameters", [])
            values = {p["name"]: str(ids.get(p["name"], "x")) for p in params if p["in"] == "path"}
            query = {p["name"]: str(ids.get(p["name"], "x")) for p in params
                     if p["in"] == "query" and p.get("required")}  # fmt: skip
            content = op.get("requestBody", {}).get("content", {})
            key = ADMIN_KEY if _needs_admin(app, path, method) else ids["key"]
            cookies, headers = {}, {}
            if path.startswith("/portal/"):
                portal = portal or _portal_session(server, ids["key"])
                cookies, headers = portal
            yield dict(path=path, method=method.upper(), params=params, path_values=values,
                       query=query, content=content, key=key, schemas=schemas,
                       cookies=cookies, headers=headers)  # fmt: skip


def _url(server, op, path_values: dict) -> str:
    path = op["path"]
    for name, value in path_values.items():
        path = path.replace("{" + name + "}", value)
    return server.url + path


def _send(client: httpx.Client, server, op, *, path_values=None, query=None, **kw):
    url = _url(server, op, path_values or {k: quote(v) for k, v in op["path_values"].items()})
    headers = _auth(op["key"]) | op.get("headers", {}) | kw.pop("headers", {})
    client.cookies = op.get("cookies", {})
    return client.request(op["method"], url, params=query if query is not None else op["query"],
                          headers=headers, **kw)  # fmt: skip


def _json_bytes(value) -> bytes:
    # ASCII-only JSON: a lone surrogate travels as the legal escape "\ud800".
    return json.dumps(value, ensure_ascii=True).encode()


def test_hostile_strings_in_every_field_of_every_route(server, ids):
    tried: dict[str, int] = {}
    with httpx.Client(timeout=60) as client:
        for op in _operations(server, ids):
            label = f"{op['method']} {op['path']}"
            n = 0
            _check(_send(client, server, op), f"{label} (baseline)")
            for p in op["params"]:
                for tag, raw in URL_HOSTILE.items():
                    what = f"{label} {p['in']} {p['name']}={tag}"
                    if p["in"] == "path":
                        values = {k: quote(v) for k, v in op["path_values"].items()}
                        r = _send(client, server, op, path_values={**values, p["name"]: raw})
                    elif p["in"] == "query":
                        url = _url(server, op, {k: quote(v) for k, v in op["path_values"].items()})
                        r = client.request(op["method"], f"{url}?{p['name']}={raw}",
                                           headers=_auth(op["key"]))  # fmt: skip
                    else:
                        continue
                    _check(r, what)
                    n += 1
            schemas = op["schemas"]
            if "application/json" in op["content"]:
                schema = op["content"]["application/json"]["schema"]
                base = schemas.example(schema)
                if isinstance(base, dict) and "model" in base:
                    base["model"] = ids["model"]
                bodies = {_json_bytes(b): tag for tag, value in HOSTILE.items()
                          for b in schemas.mutants(schema, base, value)}  # fmt: skip

                def send(body: bytes, op=op) -> httpx.Response:
                    return _send(client, server, op, content=body,
                                 headers={"content-type": "application/json"})  # fmt: skip

                # A few at a time: accepted completions then share the engine's steps.
                with ThreadPoolExecutor(4) as pool:
                    for body, r in zip(bodies, pool.map(send, bodies), strict=True):
                        _check(r, f"{label} json {bodies[body]}: {body[:200]!r}")
                n += len(bodies)
            for form in ("multipart/form-data", "application/x-www-form-urlencoded"):
                if form not in op["content"]:
                    continue
                schema = schemas.resolve(op["content"][form]["schema"])
                props = schema.get("properties", {})
                text = {k: "x" for k in props if "format" not in json.dumps(props[k])}
                files = ids["files"] if form == "multipart/form-data" else None
                for field in text:
                    for tag, value in {**HOSTILE, "not-utf8": None}.items():
                        data = {**text, field: value}
                        if value is None or "\ud800" in value:
                            # Raw bytes in the part: what a client that is not UTF-8 sends.
                            data = {**text, field: NOT_UTF8 if value is None else value.encode(
                                "utf-8", "surrogatepass")}  # fmt: skip
                        r = _send(client, server, op, data=data, files=files)
                        _check(r, f"{label} form {field}={tag}")
                        n += 1
                if files:
                    for tag, value in HOSTILE.items():
                        name = value.encode("utf-8", "surrogatepass").decode("latin-1")
                        hostile = [(files[0][0], (name, files[0][1][1])), *files[1:]]
                        r = _send(client, server, op, data=text, files=hostile)
                        _check(r, f"{label} file name {tag}")
                        n += 1
            tried[label] = n
    # Every route was walked, and every one with fields got hostile values in them.
    assert len(tried) >= 25, tried
    assert tried["POST /v1/chat/completions"] > 50 and tried["POST /v1/adapters"] > 10, tried


def _json_routes(server, ids):
    return [op for op in _operations(server, ids) if "application/json" in op["content"]]


def test_json_routes_refuse_other_media_types_with_415(server, ids):
    with httpx.Client(timeout=60) as client:
        ops = _json_routes(server, ids)
        assert len(ops) >= 8
        for op in ops:
            label = f"{op['method']} {op['path']}"
            body = _json_bytes(op["schemas"].example(op["content"]["application/json"]["schema"]))
            for kind in ("text/plain", "application/x-www-form-urlencoded"):
                r = _send(client, server, op, content=body, headers={"content-type": kind})
                _check(r, f"{label} as {kind}")
                assert r.status_code == 415, f"{label} as {kind}: {r.text}"
                assert r.json()["error"]["code"] == "unsupported_media_type"
            r = _send(client, server, op, content=b'{"model": "' + NOT_UTF8 + b'"}',
                      headers={"content-type": "application/json"})  # fmt: skip
            _check(r, f"{label} not UTF-8")
            assert r.status_code == 400, f"{label} not UTF-8: {r.text}"
            assert r.json()["error"]["code"] == "invalid_json", r.text
        upload = httpx.post(f"{server.url}/v1/adapters", headers=_auth(ids["key"]),
                            json={"name": "x"}, timeout=60)  # fmt: skip
        assert upload.status_code == 415, upload.text
        assert upload.json()["error"]["code"] == "unsupported_media_type"


def test_framework_errors_have_a_code(server, ids):
    """Errors Starlette raises itself (no route, wrong method, a broken form) get a code too."""
    key = _auth(ids["key"])
    for r, status in (
        (httpx.get(f"{server.url}/v1/nowhere", headers=key), 404),
        (httpx.put(f"{server.url}/v1/completions", headers=key), 405),
        (httpx.post(f"{server.url}/v1/adapters", headers=key | {
            "content-type": "multipart/form-data; boundary=zz"}, content=b"--zz\r\nbroken"), 400),
    ):  # fmt: skip
        _check(r, str(r.request.url))
        assert r.status_code == status, r.text
