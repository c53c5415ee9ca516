"""A tenant's prefix-cache salt (platform/db/cache_salts.py) on both data planes: the vLLM
data plane sends it as vLLM's `cache_salt`, so vLLM's prefix cache is separated per tenant as
the engine's is; a tenant never rotated (null salt) sends none."""

from __future__ import annotations

from loraplex.engine import SamplingParams
from loraplex.platform.dataplane.protocol import request_body
from loraplex.platform.db import cache_salts
from loraplex.platform.db.models import Tenant
from tests.platform.dataplane.test_end_to_end import PROMPT, new_tenant
from tests.utils.uploads import complete


def test_the_salt_goes_into_the_request_body_only_when_set():
    salt = "9f" * 32  # a rotated salt's shape: 64 hex characters
    assert request_body("m", [1], SamplingParams(cache_salt=salt), priority=0)["cache_salt"] == salt
    for unsalted in (None, ""):  # never rotated; vLLM refuses an empty salt
        body = request_body("m", [1], SamplingParams(cache_salt=unsalted), priority=0)
        assert "cache_salt" not in body


def test_a_salted_tenant_is_answered_and_the_salt_reaches_vllm(plane, plane_adapters):
    kind, srv = plane
    tenant_id, key = new_tenant(srv, plane_adapters, names=("a",))
    unsalted = complete(srv.url, key, "a", PROMPT)
    assert unsalted.status_code == 200, unsalted.text
    with srv.sessions() as session:
        assert cache_salts.rotate(session, tenant_id)
    salted = complete(srv.url, key, "a", PROMPT)
    assert salted.status_code == 200, salted.text  # vLLM takes the tenant's salt
    # Greedy: the salt changes where KV is cached, never the answer.
    assert salted.json()["choices"][0]["text"] == unsalted.json()["choices"][0]["text"]
    # A salt vLLM's own check refuses (never one the platform makes): refused by vLLM, by
    # name, which shows the field reaches vLLM's parser rather than being dropped on the way.
    with srv.sessions() as session:
        session.get(Tenant, tenant_id).cache_salt = "not/a/salt"
        session.commit()
    refused = complete(srv.url, key, "a", PROMPT)
    if kind == "embedded":
        assert refused.status_code == 200, refused.text
        return
    assert refused.status_code == 400, refused.text
    assert "cache_salt" in refused.text
