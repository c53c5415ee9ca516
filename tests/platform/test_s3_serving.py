"""A server whose adapter store is S3 (moto's standalone server over HTTP, a real process):
uploads land in the bucket, a restarted server with an empty disk cache fetches them back, and
a store outage fails only the requests that need the store."""

from __future__ import annotations

import shutil

import boto3
import httpx
import pytest

from loraplex.platform.db import crud
from loraplex.platform.store import adapter_digest
from tests.utils.moto import ACCESS_KEY, REGION, SECRET_KEY, moto_server
from tests.utils.server import run_server
from tests.utils.uploads import auth, complete, folder_parts, upload

BUCKET, PREFIX = "loraplex-adapters", "prod/v1"


def _s3(url: str):
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


def _keys(s3) -> list[str]:
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/")
    return sorted(o["Key"] for o in listing.get("Contents", []))


def _s3_settings(url: str) -> dict:
    return dict(
        store_url=f"s3://{BUCKET}/{PREFIX}",
        s3_endpoint_url=url,
        s3_region=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


@pytest.fixture
def moto():
    with moto_server() as url:
        _s3(url).create_bucket(Bucket=BUCKET)
        yield url


def test_adapter_round_trips_through_s3_across_restarts(moto, tiny_models, tiny_adapters, tmp_path):
    folder = tiny_adapters["llama"]["attn8"]
    digest = adapter_digest(folder)
    s3 = _s3(moto)
    with run_server(tiny_models["llama"], tmp_path, **_s3_settings(moto)) as srv:
        tenant, key = srv.new_tenant("s3-tenant")
        response = upload(srv.url, key, "cloud", folder_parts(folder))
        assert response.status_code == 201, response.text
        assert response.json()["sha256"] == digest
        with srv.sessions() as session:
            stored_as = crud.get_adapter(session, tenant_id=tenant, name="cloud").storage_key
        assert stored_as.startswith(f"{digest}-")  # an object of its own
        assert _keys(s3) == [
            f"{PREFIX}/{stored_as}/adapter_config.json",
            f"{PREFIX}/{stored_as}/adapter_model.safetensors",
        ]
        stored = s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{stored_as}/adapter_model.safetensors")
        assert stored["Body"].read() == (folder / "adapter_model.safetensors").read_bytes()
        assert not (tmp_path / "adapters").exists()  # nothing went to a local store
        first = complete(srv.url, key, "cloud")
        assert first.status_code == 200, first.text
        text = first.json()["choices"][0]["text"]
        base = complete(srv.url, key, "llama").json()["choices"][0]["text"]
        assert text != base

    # A new server on the same database and bucket, its disk cache wiped: S3 is the only copy.
    shutil.rmtree(tmp_path / "adapter-cache")
    with run_server(tiny_models["llama"], tmp_path, **_s3_settings(moto)) as srv:
        assert srv.state.cache.stats.loads == 0
        again = complete(srv.url, key, "cloud")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == text
        assert srv.state.cache.stats.loads == 1
        assert (tmp_path / "adapter-cache" / digest / "adapter_model.safetensors").is_file()

        # Deleting removes the objects from the bucket.
        gone = httpx.delete(f"{srv.url}/v1/adapters/cloud", headers=auth(key))
        assert gone.status_code == 200
        assert _keys(s3) == []


def test_store_outage_fails_only_requests_that_need_the_store(tiny_models, tiny_adapters, tmp_path):
    llama = tiny_adapters["llama"]
    moto = moto_server()
    url = moto.__enter__()
    try:
        s3 = _s3(url)
        s3.create_bucket(Bucket=BUCKET)
        with run_server(tiny_models["llama"], tmp_path, **_s3_settings(url)) as srv:
            tenant, key = srv.new_tenant("outage")
            for name, adapter in (("warm", "qv4"), ("cold", "mlp16"), ("lost", "all2")):
                assert upload(srv.url, key, name, folder_parts(llama[adapter])).status_code == 201
            warm = complete(srv.url, key, "warm").json()["choices"][0]["text"]  # now on disk

            # An object gone from the bucket (deleted behind our back, wrong bucket/prefix).
            with srv.sessions() as session:
                lost = crud.get_adapter(session, tenant_id=tenant, name="lost").storage_key
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                s3.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{lost}/{name}")
            failed = complete(srv.url, key, "lost")
            assert failed.status_code == 503, failed.text
            error = failed.json()["error"]
            assert error["code"] == "adapter_unavailable"
            assert "'lost'" in error["message"] and "adapter store" in error["message"]
            assert lost not in error["message"] and BUCKET not in error["message"]  # no internals
            assert failed.headers["retry-after"]

            moto.__exit__(None, None, None)  # the whole store goes away
            moto = None
            failed = complete(srv.url, key, "cold")
            assert failed.status_code == 503, failed.text
            assert failed.json()["error"]["code"] == "adapter_unavailable"
            assert url not in failed.json()["error"]["message"]  # the endpoint: the log's
            streamed = complete(srv.url, key, "cold", stream=True)
            assert streamed.status_code == 503

            # Everything that does not need the store still works.
            ok = complete(srv.url, key, "llama")
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
            assert complete(srv.url, key, "warm").json()["choices"][0]["text"] == warm
            names = {a["name"] for a in httpx.get(f"{srv.url}/v1/adapters", headers=auth(key))
                     .json()["data"]}  # fmt: skip
            assert names == {"warm", "cold", "lost"}
            assert httpx.get(f"{srv.url}/readyz").status_code == 200

            # An upload cannot be stored: a clear 503, and no registry row for it.
            refused = upload(srv.url, key, "new", folder_parts(llama["attn8"]))
            assert refused.status_code == 503, refused.text
            assert "retry later" in refused.json()["error"]["message"]
            assert url not in refused.text and BUCKET not in refused.text
            assert httpx.get(f"{srv.url}/v1/adapters/new", headers=auth(key)).status_code == 404
            # A delete still takes the adapter away from the tenant (its bytes stay behind).
            gone = httpx.delete(f"{srv.url}/v1/adapters/warm", headers=auth(key))
            assert gone.status_code == 200, gone.text
            assert complete(srv.url, key, "warm").status_code == 404
    finally:
        if moto is not None:
            moto.__exit__(None, None, None)


def test_a_cached_copy_removed_behind_the_servers_back(moto, tiny_models, tiny_adapters, tmp_path):
    """Another process sharing the disk cache may evict a folder this server listed: the next
    request fetches it again; one caught between lookup and load gets a 503 to retry, not a 422
    blaming the adapter."""
    llama = tiny_adapters["llama"]
    with run_server(tiny_models["llama"], tmp_path, **_s3_settings(moto)) as srv:
        _, key = srv.new_tenant("shared-cache")
        for name, adapter in (("a", "attn8"), ("b", "mlp16")):
            assert upload(srv.url, key, name, folder_parts(llama[adapter])).status_code == 201
        cache = srv.state.cache
        first = complete(srv.url, key, "a")
        assert first.status_code == 200, first.text
        loads = cache.stats.loads
        shutil.rmtree(tmp_path / "adapter-cache" / adapter_digest(llama["attn8"]))
        again = complete(srv.url, key, "a")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert cache.stats.loads == loads + 1  # the lookup noticed and fetched it back

        # "b" is removed after the lookup handed its folder over, before the engine read it.
        real_get = cache.get

        def get_then_lose(key_, digest):
            folder = real_get(key_, digest)
            shutil.rmtree(folder)
            return folder

        cache.get = get_then_lose
        lost = complete(srv.url, key, "b")
        assert lost.status_code == 503, lost.text
        assert lost.json()["error"]["code"] == "adapter_unavailable"
        assert lost.headers["retry-after"] == "1"
        cache.get = real_get
        retried = complete(srv.url, key, "b")
        assert retried.status_code == 200, retried.text
        assert retried.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]
