"""The Files API: the `openai` client uploads, lists, reads and deletes batch input files; bad
files are refused line by line; a tenant never sees another's files; the bytes live in the
adapter store (local folder, and S3 over a real moto server) beside the adapters, out of reach
of their collector."""

from __future__ import annotations

import json
import secrets

import boto3
import httpx
import openai
import pytest

from loraplex.platform.adapter_service import collect_unreferenced
from loraplex.platform.files import FileBlobs
from loraplex.platform.store import make_store
from tests.utils.moto import ACCESS_KEY, REGION, SECRET_KEY, moto_server
from tests.utils.server import run_server

MAX_BYTES = 8 * 1024


def batch_lines(n: int, url: str = "/v1/completions", **body) -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": url,
         "body": {"model": "m", "prompt": f"hello {i}", "max_tokens": 4, **body}}
        for i in range(n)
    ]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(
        tiny_models["llama"],
        tmp_path_factory.mktemp("files"),
        batch_file_max_bytes=MAX_BYTES,
        batch_file_max_lines=20,
        files_max_bytes_per_tenant=3 * MAX_BYTES,
        batch_max_active=0,  # nothing here runs batches
    ) as srv:
        yield srv


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_upload_list_get_content_delete_with_the_openai_client(server):
    _, key = server.new_tenant(f"files-{secrets.token_hex(3)}")
    c = client(server, key)
    data = batch_lines(3)
    f = c.files.create(file=("in.jsonl", data), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "in.jsonl")
    assert f.id.startswith("file-")
    assert c.files.retrieve(f.id).bytes == len(data)
    assert c.files.content(f.id).content == data
    g = c.files.create(file=("second.jsonl", batch_lines(1)), purpose="batch")
    listed = c.files.list()
    assert [x.id for x in listed.data] == [g.id, f.id]  # newest first
    assert [x.id for x in c.files.list(order="asc", limit=1)] == [f.id, g.id]  # paged through
    stored = server.settings.local_store_dir / "files"
    assert len([p for p in stored.rglob("*") if p.is_file()]) == 2
    deleted = c.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    assert [x.id for x in c.files.list().data] == [g.id]
    assert len([p for p in stored.rglob("*") if p.is_file()]) == 1
    # The adapters' collector leaves the files' objects alone.
    collect_unreferenced(server.state, grace_s=0)
    assert c.files.content(g.id).content == batch_lines(1)


def test_another_tenant_sees_nothing(server):
    _, key_a = server.new_tenant(f"owner-{secrets.token_hex(3)}")
    _, key_b = server.new_tenant(f"other-{secrets.token_hex(3)}")
    a, b = client(server, key_a), client(server, key_b)
    f = a.files.create(file=("mine.jsonl", batch_lines(2)), purpose="batch")
    assert b.files.list().data == []
    for call in (b.files.retrieve, b.files.content, b.files.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call(f.id)
        # The same answer as for an id that never existed.
        assert e.value.body["code"] == "file_not_found"
    assert a.files.retrieve(f.id).id == f.id


@pytest.mark.parametrize(
    "content, line, words",
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
         b'"body": {"model": "m"}}\nnot json\n', 2, "not valid json"),
        (batch_lines(2) + batch_lines(1), 3, "also on line 1"),
        (batch_lines(1, url="/v1/embeddings"), 1, "'url' must be one of"),
        (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', 1,
         "method"),
        (b'\n\n{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}', 3,
         "body.model"),
        (batch_lines(1, stream=True), 1, "stream"),
        (b'["a list"]', 1, "json object"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": '
         b'"m"}, "extra": 1}', 1, "unknown field"),
        (batch_lines(21), 21, "at most 20"),
        (b"\xff\xfe", 1, "utf-8"),
        # Deeper than json.loads can recurse: refused by depth, not a RecursionError's 500.
        (batch_lines(1) + b'{"custom_id": "b", "body": ' + b"[" * 3_500 + b"]" * 3_500
         + b"}\n", 2, "nests 3501"),
    ],
)  # fmt: skip
def test_bad_lines_are_refused_with_their_number(server, content, line, words):
    _, key = server.new_tenant(f"bad-{secrets.token_hex(3)}")
    c = client(server, key)
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("bad.jsonl", content), purpose="batch")
    error = e.value.body
    assert error["code"] == "invalid_file" and error["param"] == "file"
    assert error["message"].startswith(f"line {line}: "), error["message"]
    assert words.lower() in error["message"].lower()
    assert c.files.list().data == []


def test_limits_and_form_errors(server):
    _, key = server.new_tenant(f"lim-{secrets.token_hex(3)}")
    c = client(server, key)
    with pytest.raises(openai.BadRequestError, match="no requests"):
        c.files.create(file=("empty.jsonl", b"\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", batch_lines(1)), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    big = batch_lines(1, prompt="x" * MAX_BYTES)
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.jsonl", big), purpose="batch")
    assert e.value.status_code == 413 and str(MAX_BYTES) in e.value.body["message"]
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{server.url}/v1/files", headers=headers, json={"purpose": "batch"})
    assert r.status_code == 415
    r = httpx.post(f"{server.url}/v1/files", headers=headers, data={"purpose": "batch"})
    assert r.status_code in (400, 415) and r.json()["error"]["code"] in (
        "missing_file", "unsupported_media_type")  # fmt: skip
    # The tenant's files together: three files of about 6 KiB fit in 24 KiB, a fourth not.
    line = batch_lines(1, prompt="y" * (6 * 1024))
    for _ in range(3):
        c.files.create(file=("ok.jsonl", line), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError) as e:
        c.files.create(file=("more.jsonl", line), purpose="batch")
    assert e.value.body["code"] == "quota_exceeded"
    assert len(c.files.list().data) == 3


def test_files_in_s3_beside_adapters_survive_their_collector(tmp_path):
    with moto_server() as endpoint:
        keys = dict(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, **keys)
        s3.create_bucket(Bucket="store")
        store = make_store("s3://store/team", endpoint_url=endpoint, region=REGION,
                           access_key=ACCESS_KEY, secret_key=SECRET_KEY)  # fmt: skip
        blobs = FileBlobs(store)
        key = blobs.put(b"line\n")
        assert blobs.get(key) == b"line\n"
        listed = [o["Key"] for o in s3.list_objects_v2(Bucket="store")["Contents"]]
        assert listed == [f"team/files/{key}"]
        assert list(store.list_objects()) == []  # the adapters' collector never sees it
        blobs.delete(key)
        blobs.delete(key)  # a missing file is not an error
        assert "Contents" not in s3.list_objects_v2(Bucket="store")
