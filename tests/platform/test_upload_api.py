"""POST /v1/adapters over HTTP: every bad upload is refused with a 4xx that says what is wrong
and leaves the registry, the store and the upload temp folder exactly as they were; good
uploads (two files, .tar.gz, .zip) serve, and deleting removes them (each upload is an object
of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.db import crud
from loraplex.platform.db.models import Adapter
from loraplex.platform.store import AdapterCache, adapter_digest
from testkit.factories import HUGE_RANK, make_bad_adapters
from tests.utils.server import run_server
from tests.utils.uploads import (
    ADAPTER_FILES,
    auth,
    complete,
    folder_entries,
    folder_parts,
    tar_gz,
    upload,
    zip_bytes,
)

KiB = 1024


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("upl")) as srv:
        yield srv


@pytest.fixture(scope="module")
def good(tiny_adapters) -> Path:
    return tiny_adapters["llama"]["qv4"]


@pytest.fixture(scope="module")
def bad(good, tmp_path_factory) -> dict[str, Path]:
    return make_bad_adapters(good, tmp_path_factory.mktemp("bad"))


def _listing(folder: Path | None) -> list[str]:
    if folder is None or not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _snapshot(server) -> tuple:
    with server.sessions() as session:
        rows = session.execute(select(Adapter.id, Adapter.tenant_id, Adapter.name)).all()
    settings = server.settings
    return (
        sorted(rows),
        _listing(settings.local_store_dir),
        _listing(settings.data_dir / "tmp"),
    )


def _refused(server, response: httpx.Response, before: tuple, status: int, code: str, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    for word in words:
        assert word.lower() in error["message"].lower(), error["message"]
    assert _snapshot(server) == before  # no row, no stored object, no temp file left behind


def _cfg(folder: Path, **changes) -> bytes:
    return json.dumps(
        {**json.loads((folder / "adapter_config.json").read_text()), **changes}
    ).encode()


@pytest.fixture(scope="module")
def cases(good: Path, bad: dict[str, Path], tiny_adapters) -> dict:
    """case -> (file parts, expected status, code, words the message must contain)."""
    cfg, st = (good / n for n in ADAPTER_FILES)
    zeros = b"\0" * (4 * 1024 * KiB)
    return {
        "pickle_only": (
            folder_parts(bad["pickle_only"], ("adapter_config.json", "adapter_model.bin")),
            400, "pickle_refused", "adapter_model.bin", "pickle",
        ),
        "wrong_shape_other_base": (
            folder_parts(tiny_adapters["gemma3"]["qv4"]),
            422, "invalid_adapter", "q_proj", "do not fit the base model",
        ),
        "wrong_shape": (
            folder_parts(bad["wrong_shape"]), 422, "invalid_adapter", "(4, 67)", "expected",
        ),
        "unknown_target": (folder_parts(bad["unknown_target"]), 422, "invalid_adapter", "foo_proj"),
        "config_unknown_target": (
            folder_parts(bad["config_unknown_target"]), 422, "invalid_adapter", "not_a_module",
        ),
        "rank_over_server_limit": (
            folder_parts(bad["huge_rank"]), 422, "rank_too_large", str(HUGE_RANK), "64",
        ),
        "nan": (folder_parts(bad["nan"]), 422, "invalid_adapter", "nan"),
        "inf": (folder_parts(bad["inf"]), 422, "invalid_adapter", "inf"),
        "truncated": (folder_parts(bad["truncated"]), 422, "bad_safetensors", "truncated"),
        "bad_json": (folder_parts(bad["bad_json"]), 422, "bad_config", "json"),
        "config_not_lora": (
            [("files", ("adapter_config.json", _cfg(good, peft_type="PREFIX_TUNING"))),
             ("files", (st.name, st.read_bytes()))],
            422, "bad_config", "PREFIX_TUNING",
        ),
        "base_model_mismatch": (
            [("files", (cfg.name, _cfg(good, base_model_name_or_path="microsoft/phi-2"))),
             ("files", (st.name, st.read_bytes()))],
            422, "base_model_mismatch", "phi",
        ),
        "missing_config": (
            folder_parts(bad["missing_config"]), 400, "missing_file", "adapter_config.json",
        ),
        "missing_weights": (
            folder_parts(bad["missing_weights"]), 400, "missing_file", "adapter_model.safetensors",
        ),
        "no_files": ([], 400, "missing_file", "no files"),
        "unknown_file": (
            [*folder_parts(good), ("files", ("train.py", b"print('hi')"))],
            400, "unknown_file", "train.py",
        ),
        "path_as_file_name": (
            [("files", ("../adapter_config.json", cfg.read_bytes())),
             ("files", (st.name, st.read_bytes()))],
            400, "bad_file_name", "path",
        ),
        "archive_dotdot": (
            [("files", ("a.tar.gz", tar_gz({"../adapter_config.json": cfg.read_bytes(),
                                            "../adapter_model.safetensors": st.read_bytes()})))],
            400, "unsafe_archive", "..",
        ),
        "zip_dotdot": (
            [("files", ("a.zip", zip_bytes({"x/../../adapter_config.json": cfg.read_bytes()})))],
            400, "unsafe_archive", "..",
        ),
        "archive_symlink": (
            [("files", ("a.tar.gz", tar_gz({"adapter_config.json": cfg.read_bytes()},
                                           {"adapter_model.safetensors": "/etc/passwd"})))],
            400, "unsafe_archive", "link",
        ),
        "archive_absolute": (
            [("files", ("a.tar.gz", tar_gz({"/tmp/adapter_config.json": cfg.read_bytes()})))],
            400, "unsafe_archive", "absolute",
        ),
        "zip_bomb": (  # 4 MiB of zeros squeezed into a few KiB, against a 1 MiB limit
            [("files", ("a.zip", zip_bytes({"adapter_config.json": cfg.read_bytes(),
                                             "adapter_model.safetensors": zeros})))],
            413, "too_large", "decompression bomb",
        ),
        "tar_bomb": (
            [("files", ("a.tar.gz", tar_gz({"adapter_config.json": cfg.read_bytes(),
                                            "adapter_model.safetensors": zeros})))],
            413, "too_large", "decompression bomb",
        ),
        "not_an_archive": (
            [("files", ("a.zip", b"PK this is not a zip"))], 400, "bad_archive", "a.zip",
        ),
        "archive_and_files": (
            [("files", ("a.zip", zip_bytes(folder_entries(good)))), *folder_parts(good)],
            400, "mixed_upload", "either",
        ),
    }  # fmt: skip


CASES = [
    "pickle_only", "wrong_shape_other_base", "wrong_shape", "unknown_target",
    "config_unknown_target", "rank_over_server_limit", "nan", "inf", "truncated", "bad_json",
    "config_not_lora",
    "base_model_mismatch", "missing_config", "missing_weights", "no_files", "unknown_file",
    "path_as_file_name", "archive_dotdot", "zip_dotdot", "archive_symlink", "archive_absolute",
    "zip_bomb", "tar_bomb", "not_an_archive", "archive_and_files",
]  # fmt: skip


@pytest.fixture(scope="module")
def uploader(server):
    """A tenant whose uploads may be at most 1 MiB (decompressed), for the bomb cases."""
    return server.new_tenant("uploader", max_adapter_bytes=1024 * KiB)[1]


@pytest.mark.parametrize("case", CASES)
def test_bad_upload_is_refused_and_leaves_nothing(server, uploader, cases, case):
    files, status, code, *words = cases[case]
    before = _snapshot(server)
    response = upload(server.url, uploader, f"bad-{case}".replace("_", "-"), files)
    _refused(server, response, before, status, code, *words)


def test_too_large_upload_is_refused(server, good):
    _, key = server.new_tenant("small-quota", max_adapter_bytes=2 * KiB)
    before = _snapshot(server)
    # Under the slack the server allows for multipart framing: refused while streaming.
    _refused(server, upload(server.url, key, "big", folder_parts(good)), before, 413, "too_large",
             "2048")  # fmt: skip
    # Far over the limit: refused from Content-Length, before the body is read.
    padded = [*folder_parts(good), ("files", ("README.md", b"#" * (256 * KiB)))]
    _refused(server, upload(server.url, key, "big", padded), before, 413, "too_large", "2048")


def test_chunked_upload_is_cut_off_at_the_limit(server, uploader):
    """Without a Content-Length only the running count can stop a client: the file part comes
    first and the name never arrives, so only a refusal mid-body answers 413."""
    boundary = "loraplex-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
        f'filename="adapter_model.safetensors"\r\n\r\n'
    ).encode()

    def body():  # a generator: httpx sends it chunked, with no Content-Length
        yield head
        for _ in range(8):
            yield b"\0" * (1024 * KiB)
        yield f"\r\n--{boundary}--\r\n".encode()

    before = _snapshot(server)
    response = httpx.post(
        f"{server.url}/v1/adapters",
        headers={**auth(uploader), "Content-Type": f"multipart/form-data; boundary={boundary}"},
        content=body(),
        timeout=60,
    )
    assert "content-length" not in response.request.headers
    _refused(server, response, before, 413, "too_large", str(1024 * KiB))


def test_rank_over_tenant_quota_is_refused(server, good):
    _, key = server.new_tenant("low-rank", max_rank=2)
    before = _snapshot(server)
    response = upload(server.url, key, "r4", folder_parts(good))
    _refused(server, response, before, 422, "rank_too_large", "rank 4", "2")


@pytest.mark.parametrize("name", ["", "../escape", "has space", "x" * 65, "-dash", "llama"])
def test_bad_name_is_refused(server, uploader, good, name):
    before = _snapshot(server)
    response = upload(server.url, uploader, name, folder_parts(good))
    _refused(server, response, before, 400, "invalid_name", "name")


def test_missing_name_is_refused(server, uploader, good):
    before = _snapshot(server)
    _refused(server, upload(server.url, uploader, None, folder_parts(good)), before, 400,
             "invalid_name", "'name'")  # fmt: skip


def test_a_taken_name_gets_a_new_version_and_keeps_its_default(server, tiny_adapters):
    _, key = server.new_tenant("dup")
    llama = tiny_adapters["llama"]
    assert upload(server.url, key, "same", folder_parts(llama["qv4"])).status_code == 201
    for n, folder in enumerate((llama["qv4"], llama["attn8"]), start=2):  # identical or not
        response = upload(server.url, key, "same", folder_parts(folder))
        assert response.status_code == 201, response.text
        assert response.json()["version"] == n
    [listed] = httpx.get(f"{server.url}/v1/adapters", headers=auth(key)).json()["data"]
    assert [v["id"] for v in listed["versions"]] == ["same@v1", "same@v2", "same@v3"]
    assert listed["aliases"] == {"default": {"v1": 100}}  # not promoted: requests stay on v1


def test_adapter_count_and_bytes_quotas(server, tiny_adapters):
    llama = tiny_adapters["llama"]
    _, key = server.new_tenant("two-max", max_adapters=1)
    assert upload(server.url, key, "first", folder_parts(llama["qv4"])).status_code == 201
    before = _snapshot(server)
    response = upload(server.url, key, "second", folder_parts(llama["attn8"]))
    _refused(server, response, before, 403, "quota_exceeded", "1 of 1")
    # A new version is not a new adapter: it counts towards the bytes only.
    assert upload(server.url, key, "first", folder_parts(llama["attn8"])).status_code == 201

    size = sum((llama["qv4"] / n).stat().st_size for n in ADAPTER_FILES)
    _, key = server.new_tenant("bytes-max", max_adapter_bytes=size + KiB)
    assert upload(server.url, key, "first", folder_parts(llama["qv4"])).status_code == 201
    before = _snapshot(server)
    response = upload(server.url, key, "second", folder_parts(llama["qv4"]))
    _refused(server, response, before, 403, "quota_exceeded", "bytes")


# --- good uploads ----------------------------------------------------------------------------


def _storage_key(server, tenant_id: int, name: str) -> str:
    with server.sessions() as session:
        return crud.get_adapter(session, tenant_id=tenant_id, name=name).storage_key


def _stored(server, key: str) -> bool:
    folder = server.settings.local_store_dir / key[:2] / key
    return all((folder / n).is_file() for n in ADAPTER_FILES)


@pytest.mark.parametrize("form", ["files", "tar.gz", "zip"])
def test_good_upload_serves_and_delete_removes_it(server, tiny_adapters, form):
    folder = tiny_adapters["llama"]["attn8"]
    tenant, key = server.new_tenant(f"good-{form.replace('.', '-')}")
    if form == "files":  # with the model card peft writes beside the adapter
        files = [*folder_parts(folder), ("files", ("README.md", b"# card"))]
    elif form == "tar.gz":  # inside one top folder, as `tar czf a.tar.gz my-adapter/` writes it
        entries = {**folder_entries(folder, "my-adapter"), "my-adapter/README.md": b"# card"}
        files = [("files", ("my-adapter.tar.gz", tar_gz(entries)))]
    else:
        files = [("files", ("my-adapter.zip", zip_bytes(folder_entries(folder))))]
    tmp_before = _listing(server.settings.data_dir / "tmp")

    response = upload(server.url, key, "mine", files)
    assert response.status_code == 201, response.text
    body = response.json()
    digest = adapter_digest(folder)
    assert body["sha256"] == digest and body["status"] == "ready"
    assert (body["rank"], sorted(body["targets"])) == (8, ["k_proj", "o_proj", "q_proj", "v_proj"])
    stored_as = _storage_key(server, tenant, "mine")
    assert stored_as.startswith(f"{digest}-") and _stored(server, stored_as)
    assert _listing(server.settings.data_dir / "tmp") == tmp_before
    listed = httpx.get(f"{server.url}/v1/adapters", headers=auth(key)).json()["data"]
    assert [a["name"] for a in listed] == ["mine"]
    lora = complete(server.url, key, "mine")
    base = complete(server.url, key, "llama")
    assert lora.status_code == 200 and lora.json()["choices"][0]["text"]
    assert lora.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]

    gone = httpx.delete(f"{server.url}/v1/adapters/mine", headers=auth(key))
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert httpx.get(f"{server.url}/v1/adapters/mine", headers=auth(key)).status_code == 404
    assert httpx.delete(f"{server.url}/v1/adapters/mine", headers=auth(key)).status_code == 404
    after = complete(server.url, key, "mine")
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    assert not _stored(server, stored_as)
    # The name is free again.
    assert upload(server.url, key, "mine", files).status_code == 201
    assert httpx.delete(f"{server.url}/v1/adapters/mine", headers=auth(key)).status_code == 200


def test_identical_uploads_are_objects_of_their_own(server, tiny_adapters):
    """Two tenants upload the same bytes: each gets an object of its own, so one's delete
    never takes what the other serves (and says nothing about the other's uploads)."""
    folder = tiny_adapters["llama"]["mlp16"]
    a, key_a = server.new_tenant("share-a")
    b, key_b = server.new_tenant("share-b")
    assert upload(server.url, key_a, "ours", folder_parts(folder)).status_code == 201
    assert upload(server.url, key_b, "theirs", folder_parts(folder)).status_code == 201
    ours, theirs = _storage_key(server, a, "ours"), _storage_key(server, b, "theirs")
    assert ours != theirs and _stored(server, ours) and _stored(server, theirs)
    want = complete(server.url, key_b, "theirs").json()["choices"][0]["text"]

    assert httpx.delete(f"{server.url}/v1/adapters/ours", headers=auth(key_a)).status_code == 200
    assert not _stored(server, ours) and _stored(server, theirs)
    assert complete(server.url, key_a, "ours").status_code == 404
    # B's adapter still works, also when the engine-side disk cache has to fetch it again.
    state = server.state
    state.cache = AdapterCache(state.store, server.settings.data_dir / "cache-2", 2**30)
    again = complete(server.url, key_b, "theirs")
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == want
    assert server.state.cache.stats.loads == 1

    assert httpx.delete(f"{server.url}/v1/adapters/theirs", headers=auth(key_b)).status_code == 200
    assert not _stored(server, theirs)
