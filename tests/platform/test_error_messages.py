"""No tenant-facing error names the server's folders, its host, or an internal id.

Every error a tenant can cause is triggered here, each checked for its status and code (so a
trigger that stopped working fails instead of passing by saying nothing): unknown models, each
kind of refused upload (platform/uploads/policy.py), quotas and rate limits, bad parameters, a
store folder gone and an object deleted behind the server's back, a cached copy broken under
it, streamed and not. Every body is then scanned for the data, temp, store, cache and model
folders, the host name, the digests and storage keys of the stored adapters, and the engine's
name for an adapter (`<tenant id>/<name>`).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from sqlalchemy import select

from loraplex.platform.db.models import Adapter
from loraplex.platform.serving import engine_adapter_id
from testkit.factories import make_bad_adapters
from tests.utils.server import run_server
from tests.utils.uploads import (
    auth,
    complete,
    folder_entries,
    folder_parts,
    tar_gz,
    upload,
    zip_bytes,
)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("errmsg"),
                    max_model_len=64) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def good(tiny_adapters) -> Path:
    return tiny_adapters["llama"]["qv4"]


@pytest.fixture(scope="module")
def bad(good, tmp_path_factory) -> dict[str, Path]:
    out = make_bad_adapters(good, tmp_path_factory.mktemp("bad"))
    d = out["int_dtype"] = tmp_path_factory.mktemp("int_dtype")
    shutil.copy(good / "adapter_config.json", d)
    save_file({"x.lora_A.weight": torch.zeros(2, 2, dtype=torch.int32)},
              d / "adapter_model.safetensors")  # fmt: skip
    return out


class Errors:
    """Each answer, checked for the status and code its trigger must cause."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def expect(self, label: str, r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, f"{label}: {r.status_code} {r.text[:400]}"
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            errors = [e["error"] for e in events if "error" in e]
            assert errors and errors[0]["code"] == code, f"{label}: {r.text[:400]}"
        else:
            assert r.json()["error"]["code"] == code, f"{label}: {r.text[:400]}"
        self.seen.append((label, r.text))


def _cfg(folder: Path, **changes) -> bytes:
    return json.dumps(
        {**json.loads((folder / "adapter_config.json").read_text()), **changes}
    ).encode()


def _upload_errors(server, errors: Errors, key: str, good: Path, bad: dict[str, Path]) -> None:
    url = server.url
    parts = folder_parts(good)
    cfg, weights = parts

    def up(label, files, status, code, name="fine", who=key):
        errors.expect(f"upload {label}", upload(url, who, name, files), status, code)

    up("name", parts, 400, "invalid_name", name="evil\n")
    up("base name", parts, 400, "invalid_name", name=server.state.model_name)
    up("no files", [], 400, "missing_file")
    up("unknown file", [*parts, ("files", ("notes.txt", b"hi"))], 400, "unknown_file")
    up("pickle", [cfg, ("files", ("adapter_model.bin", b"\x80\x04"))], 400, "pickle_refused")
    up("missing", [cfg], 400, "missing_file")
    up("duplicate", [cfg, cfg, weights], 400, "duplicate_file")
    up("file name", [("files", ("a/adapter_config.json", b"{}")), weights], 400, "bad_file_name")
    archive = tar_gz(folder_entries(good))
    up("mixed", [*parts, ("files", ("a.tar.gz", archive))], 400, "mixed_upload")
    up("bad archive", [("files", ("a.tar.gz", b"junk" * 10))], 400, "bad_archive")
    up("bad zip", [("files", ("a.zip", b"PK junk" * 10))], 400, "bad_archive")
    links = tar_gz(folder_entries(good), links={"evil": "/etc/passwd"})
    up("link", [("files", ("a.tar.gz", links))], 400, "unsafe_archive")
    dotdot = tar_gz({"../adapter_config.json": b"{}"})
    up("dotdot", [("files", ("a.tgz", dotdot))], 400, "unsafe_archive")
    many = zip_bytes({f"f{i}/README.md": b"" for i in range(9)})
    up("many", [("files", ("a.zip", many))], 400, "too_many_entries")
    deep = tar_gz(folder_entries(good, top="a/b"))
    up("deep", [("files", ("a.tar.gz", deep))], 400, "bad_layout")
    refused = {"bad_json": "bad_config", "truncated": "bad_safetensors", "int_dtype": "bad_dtype",
               "wrong_shape": "invalid_adapter", "nan": "invalid_adapter",
               "unknown_target": "invalid_adapter",
               "config_unknown_target": "invalid_adapter"}  # fmt: skip
    for kind, code in refused.items():
        up(kind, folder_parts(bad[kind]), 422, code)
    up("missing config", folder_parts(bad["missing_config"]), 400, "missing_file")
    foreign = _cfg(good, base_model_name_or_path="microsoft/phi-2")
    up("base model", [("files", ("adapter_config.json", foreign)), weights], 422,
       "base_model_mismatch")  # fmt: skip
    up("not json", [("files", ("adapter_config.json", b"{,")), weights], 422, "bad_config")

    _, small = server.new_tenant("small", max_adapter_bytes=1000)
    up("quota bytes", parts, 413, "too_large", who=small)
    _, ranked = server.new_tenant("ranked", max_rank=2)
    up("rank", parts, 422, "rank_too_large", who=ranked)
    _, none = server.new_tenant("none", max_adapters=0)
    up("count", parts, 403, "quota_exceeded", who=none)
    assert upload(url, key, "taken", parts).status_code == 201
    in_use = httpx.delete(f"{url}/v1/adapters/taken/versions/v1", headers=auth(key))
    errors.expect("version in use", in_use, 409, "version_in_use")
    no_such = httpx.put(f"{url}/v1/adapters/taken/aliases/default", json={"version": "v9"},
                        headers=auth(key))  # fmt: skip
    errors.expect("no such version", no_such, 404, "adapter_not_found")


def _store_errors(server, errors: Errors, key: str, good: Path) -> None:
    state = server.state
    parts = folder_parts(good)
    # An object deleted behind the server's back, before any replica cached it.
    assert upload(server.url, key, "gone", parts).status_code == 201
    with server.sessions() as session:
        row = session.scalars(select(Adapter).where(Adapter.name == "gone")).one()
        key_gone = row.storage_key
    root = server.settings.local_store_dir
    shutil.rmtree(root / key_gone[:2] / key_gone)
    errors.expect("object gone", complete(server.url, key, "gone"), 503, "adapter_unavailable")
    errors.expect("object gone, streamed", complete(server.url, key, "gone", stream=True), 503,
                  "adapter_unavailable")  # fmt: skip

    # A cached copy broken under the server (a disk fault, an operator's mistake).
    tweaked = [("files", ("adapter_config.json", _cfg(good, lora_alpha=3))), parts[1]]
    assert upload(server.url, key, "broken", tweaked).status_code == 201
    with server.sessions() as session:
        row = session.scalars(select(Adapter).where(Adapter.name == "broken")).one()
        folder = state.cache.get(row.storage_key, row.sha256)
    (folder / "adapter_model.safetensors").unlink()
    for stream in (False, True):
        r = complete(server.url, key, "broken", stream=stream)
        assert r.status_code in (422, 503), r.text
        errors.expect(f"cached copy broken, stream={stream}", r, r.status_code,
                      r.json()["error"]["code"])  # fmt: skip

    # The whole store folder gone: uploads cannot be kept; a delete still removes the adapter
    # (its row; the collector takes the bytes once the store is back).
    assert upload(server.url, key, "doomed", parts).status_code == 201
    moved = root.with_name(root.name + "-away")
    root.rename(moved)
    try:
        errors.expect("store gone", upload(server.url, key, "later", parts), 503,
                      "store_unavailable")  # fmt: skip
        gone = httpx.delete(f"{server.url}/v1/adapters/doomed", headers=auth(key))
        assert gone.status_code == 200 and gone.json()["deleted"] is True, gone.text
        listed = httpx.get(f"{server.url}/v1/adapters", headers=auth(key)).json()["data"]
        assert "doomed" not in [a["name"] for a in listed]
    finally:
        moved.rename(root)


def _inference_errors(server, errors: Errors, key: str) -> None:
    url = server.url
    base = server.state.model_name
    cases = [
        ("unknown model", dict(model="nope"), 404, "model_not_found"),
        ("unknown model, streamed", dict(model="nope", stream=True), 404, "model_not_found"),
        ("context", dict(model=base, prompt="word " * 200), 400, "context_length_exceeded"),
        ("max_tokens", dict(model=base, max_tokens=10_000), 400, "context_length_exceeded"),
        ("temperature", dict(model=base, temperature=-1), 400, "invalid_value"),
        ("unknown field", dict(model=base, frobnicate=1), 400, "invalid_value"),
        ("logprobs", dict(model=base, logprobs=99), 400, "invalid_value"),
        ("token id", dict(model=base, prompt=[10**9]), 400, "invalid_value"),
    ]
    for label, body, status, code in cases:
        model = body.pop("model")
        errors.expect(label, complete(url, key, model, **body), status, code)
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        headers=auth(key),
        timeout=60,
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    errors.expect("chat unknown model", chat, 404, "model_not_found")
    chat = httpx.post(f"{url}/v1/chat/completions", headers=auth(key), timeout=60,
                      json={"model": base, "messages": []})  # fmt: skip
    assert chat.status_code == 400, chat.text
    errors.seen.append(("chat no messages", chat.text))
    for label, r, status, code in (
        ("get unknown", httpx.get(f"{url}/v1/adapters/nope", headers=auth(key)), 404,
         "adapter_not_found"),
        ("delete unknown", httpx.delete(f"{url}/v1/adapters/nope", headers=auth(key)), 404,
         "adapter_not_found"),
        ("forged key", httpx.get(f"{url}/v1/models", headers=auth("lpx_" + "f" * 43)), 401,
         "invalid_api_key"),
        ("admin route", httpx.get(f"{url}/admin/api/tenants", headers=auth(key)), 403,
         "forbidden"),
        ("415", httpx.post(f"{url}/v1/completions", headers=auth(key), data={"model": base}),
         415, "unsupported_media_type"),
        ("not utf-8", httpx.post(f"{url}/v1/completions", headers=auth(key) | {
            "content-type": "application/json"}, content=b'{"model": "\xff"}'), 400,
         "invalid_json"),
        ("no route", httpx.get(f"{url}/v1/nowhere", headers=auth(key)), 404, "not_found"),
    ):  # fmt: skip
        errors.expect(label, r, status, code)
    _, limited = server.new_tenant("limited", requests_per_min=1)
    assert complete(url, limited, base).status_code == 200
    errors.expect("rate limit", complete(url, limited, base), 429, "rate_limit_exceeded")


def _secrets(server) -> list[tuple[str, re.Pattern]]:
    """What no tenant-facing message may contain."""
    s, state = server.settings, server.state
    folders = {s.data_dir, s.data_dir / "tmp", Path(tempfile.gettempdir()), s.local_store_dir,
               s.adapter_cache_dir, state.model_dir, *s.adapter_import_roots}  # fmt: skip
    found = [(f"folder {f}", re.compile(re.escape(str(f)))) for f in folders | {
        f.resolve() for f in folders}]  # fmt: skip
    host = socket.gethostname()
    found.append((f"host {host}", re.compile(rf"(?<![\w.-]){re.escape(host)}(?![\w-])")))
    with server.sessions() as session:
        rows = session.execute(select(Adapter.tenant_id, Adapter.name, Adapter.sha256,
                                      Adapter.storage_key)).all()  # fmt: skip
    for tenant_id, name, sha256, key in rows:
        engine_name = re.compile(rf"\b{tenant_id}/{re.escape(name)}\b")
        found += [
            (f"digest of {name}", re.compile(sha256[:16])),
            (f"storage key of {name}", re.compile(re.escape(key[:16]))),
            (f"engine id of {name}", re.compile(rf"\b{engine_adapter_id(sha256)}\b")),
            (f"engine name of {name}", engine_name),
        ]
    return found


def test_no_tenant_facing_error_names_server_paths_hosts_or_internal_ids(server, good, bad):
    _, key = server.new_tenant("tenant")
    errors = Errors()
    _upload_errors(server, errors, key, good, bad)
    _store_errors(server, errors, key, good)
    _inference_errors(server, errors, key)
    assert len(errors.seen) >= 50
    codes = {json.loads(text)["error"]["code"] for _, text in errors.seen if text.startswith("{")}
    assert {"bad_config", "bad_safetensors", "invalid_adapter", "store_unavailable",
            "adapter_unavailable", "unsafe_archive"} <= codes  # fmt: skip
    leaks = [(label, what, text[:300]) for label, text in errors.seen
             for what, pattern in _secrets(server) if pattern.search(text)]  # fmt: skip
    assert not leaks, "\n".join(map(str, leaks))
