"""vLLM's runtime adapter endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter) and
/v1/models' lineage fields, against a running server."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from loraplex.platform.api.routes.lora_admin import OPERATOR_TENANT
from loraplex.platform.db import crud
from tests.utils.server import ADMIN_KEY, run_server

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("imports")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, root):
    data = tmp_path_factory.mktemp("lora-admin")
    with run_server(tiny_models["llama"], data, adapter_import_roots=[root]) as srv:
        yield srv


@pytest.fixture(scope="module")
def outside(tmp_path_factory, tiny_adapters):
    """A valid adapter the server must never read: outside every import root."""
    folder = tmp_path_factory.mktemp("outside") / "secret"
    shutil.copytree(tiny_adapters["llama"]["qv4"], folder)
    return folder


def _load(server, body, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=headers, timeout=60)


def _unload(server, body, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, headers=headers)


def _adapters_of(server, tenant: str) -> list[str]:
    with server.sessions() as session:
        t = crud.get_tenant_by_name(session, name=tenant)
        return [] if t is None else [a.name for a in crud.list_adapters(session, tenant_id=t.id)]


def _key_of(server, tenant: str) -> str:
    with server.sessions() as session:
        t = crud.get_tenant_by_name(session, name=tenant)
        return crud.create_key(session, tenant_id=t.id)[0]


def _complete(server, key, model) -> httpx.Response:
    body = {"model": model, "prompt": "The quick brown", "max_tokens": 6, "temperature": 0}
    return httpx.post(
        f"{server.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_load_serve_list_and_unload(server, root, tiny_adapters):
    shutil.copytree(tiny_adapters["llama"]["qv4"], root / "team" / "sql-v3")
    r = _load(server, {"lora_name": "sql", "lora_path": "team/sql-v3"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    again = _load(server, {"lora_name": "sql", "lora_path": "team/sql-v3"})
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]

    key = _key_of(server, OPERATOR_TENANT)  # owned by the operator tenant, served with its keys
    base = server.state.model_name
    lora = _complete(server, key, "sql")
    assert lora.status_code == 200, lora.text
    text = lora.json()["choices"][0]["text"]
    assert text != _complete(server, key, base).json()["choices"][0]["text"]

    # vLLM's in-place load (RL loops): new weights under the same name, served at once.
    shutil.copytree(tiny_adapters["llama"]["attn8"], root / "team" / "sql-v4")
    body = {"lora_name": "sql", "lora_path": "team/sql-v4", "load_inplace": True}
    assert _load(server, body).status_code == 200
    updated = _complete(server, key, "sql").json()["choices"][0]["text"]
    assert updated != text and _complete(server, key, "sql@v1").json()["choices"][0]["text"] == text

    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    by_id = {m["id"]: m for m in models.json()["data"]}
    assert by_id[base]["root"] == base and by_id[base]["parent"] is None
    assert str(server.state.model_dir) not in models.text  # no server path
    assert by_id["sql"]["parent"] == base
    stored = httpx.get(f"{server.url}/v1/adapters/sql", headers={"Authorization": f"Bearer {key}"})
    assert by_id["sql"]["root"] == f"sha256:{stored.json()['sha256']}"

    # An absolute path inside the root works too, for another tenant that names itself.
    _, acme_key = server.new_tenant("acme")
    body = {"lora_name": "sql", "lora_path": str(root / "team" / "sql-v3"), "tenant": "acme"}
    assert _load(server, body).status_code == 200
    assert _complete(server, acme_key, "sql").status_code == 200

    assert _unload(server, {"lora_name": "sql"}).status_code == 200
    assert _complete(server, key, "sql").status_code == 404
    assert _complete(server, acme_key, "sql").status_code == 200  # acme's is its own
    gone = _unload(server, {"lora_name": "sql"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"
    assert _unload(server, {"lora_name": "nope", "tenant": "no-such"}).status_code == 404


def test_only_the_admin_key_may_load(server, root, tiny_adapters):
    shutil.copytree(tiny_adapters["llama"]["attn8"], root / "attn")
    _, tenant_key = server.new_tenant("mallory")
    body = {"lora_name": "sneaky", "lora_path": "attn"}
    assert _load(server, body, {"Authorization": f"Bearer {tenant_key}"}).status_code == 403
    assert _load(server, body, {}).status_code == 401
    tenant = {"Authorization": f"Bearer {tenant_key}"}
    assert _unload(server, {"lora_name": "x"}, tenant).status_code == 403
    assert "sneaky" not in _adapters_of(server, OPERATOR_TENANT)
    assert _adapters_of(server, "mallory") == []


@pytest.mark.parametrize(
    "case", ["dotdot", "absolute", "abs_dotdot", "dir_link_out", "file_link_out", "missing"]
)
def test_paths_outside_the_roots_are_refused(server, root, outside, case):
    name = f"t-{case}"
    if case == "dotdot":
        path = f"../{outside.parent.name}/secret"
    elif case == "absolute":
        path = str(outside)
    elif case == "abs_dotdot":
        path = f"{root}/../{outside.parent.name}/secret"
    elif case == "dir_link_out":
        (root / "link-out").symlink_to(outside, target_is_directory=True)
        path = "link-out"
    elif case == "file_link_out":
        (root / "half").mkdir()
        shutil.copy(outside / "adapter_config.json", root / "half")
        (root / "half" / "adapter_model.safetensors").symlink_to(
            outside / "adapter_model.safetensors"
        )
        path = "half"
    else:
        path = "no/such/folder"
    r = _load(server, {"lora_name": name, "lora_path": path})
    expected = 404 if case == "missing" else 400
    assert r.status_code == expected, r.text
    assert r.json()["error"]["code"] == (
        "lora_path_not_found" if case == "missing" else "path_not_allowed"
    )
    assert str(outside) not in r.text
    assert name not in _adapters_of(server, OPERATOR_TENANT)


@pytest.mark.parametrize("case", ["pickle", "bad_config", "truncated", "fifo"])
def test_malformed_adapters_are_refused(server, root, tiny_adapters, case):
    src = tiny_adapters["llama"]["mlp16"]
    folder = root / f"bad-{case}"
    shutil.copytree(src, folder)
    if case == "pickle":
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    elif case == "bad_config":
        (folder / "adapter_config.json").write_text("{not json")
    elif case == "truncated":
        data = (folder / "adapter_model.safetensors").read_bytes()
        (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    else:
        (folder / "README.md").unlink(missing_ok=True)
        os.mkfifo(folder / "README.md")  # would hang a reader that opened it blindly
    r = _load(server, {"lora_name": f"m-{case}", "lora_path": folder.name})
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert f"m-{case}" not in _adapters_of(server, OPERATOR_TENANT)


def test_bodies_are_checked(server):
    assert _load(server, {"lora_name": "x"}).status_code == 400
    assert _load(server, {"lora_name": "../x", "lora_path": "a"}).status_code == 400
    body = {"lora_name": server.state.model_name, "lora_path": "a"}
    assert _load(server, body).status_code == 400
