"""Cutting a tenant off: revoking a key or suspending a tenant with `end_streams=true` ends
its running streams at once (an `error` event, then `[DONE]`, billed for what was sent);
without it, running streams finish, and nobody else's stream notices either way."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.cli import main
from loraplex.platform.db import crud
from loraplex.platform.db.models import UsageRecord
from tests.utils.server import ADMIN_KEY, run_server
from tests.utils.sse_client import stream_completion

# The long streams must still be generating when the operator's calls arrive (~0.1-0.3 s
# after they start): the tiny model makes ~1,000 tokens a second per stream and the SSE
# socket takes them as fast (a slow reader holds nothing back: the buffers take a whole
# stream), so the long streams ask for almost the whole context of this module's server.
LONG, SHORT = 480, 24
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with run_server(tiny_models["llama"], tmp_path_factory.mktemp("data"),
                    max_model_len=512) as srv:  # fmt: skip
        yield srv


def _body(max_tokens: int) -> dict:
    return {"model": "llama", "prompt": "Once upon", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}  # fmt: skip


def test_end_streams_cuts_the_named_key_or_tenant_only(server):
    acme, acme_key = server.new_tenant("acme")
    with server.sessions() as session:
        other_key, _ = crud.create_key(session, tenant_id=acme, name="other")
    beta, beta_key = server.new_tenant("beta")
    gamma, gamma_key = server.new_tenant("gamma")
    with server.sessions() as session:
        acme_key_id = crud.list_keys(session, tenant_id=acme)[0].id
        gamma_key_id = crud.list_keys(session, tenant_id=gamma)[0].id
    received = {name: 0 for name in ("acme", "acme-other", "beta", "gamma")}
    ended: dict[str, str] = {}

    def counter(name: str):
        def on_tokens(total: int) -> None:
            received[name] = total

        return on_tokens

    async def operator() -> None:
        deadline = asyncio.get_running_loop().time() + 60
        while min(received.values()) < 2:  # every stream is running
            assert asyncio.get_running_loop().time() < deadline, received
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"{server.url}/admin/api", headers=ADMIN) as c:
            cut_key = await c.post(f"/keys/{acme_key_id}/revoke", params={"end_streams": True})
            cut_tenant = await c.patch(
                f"/tenants/{beta}", params={"end_streams": True}, json={"status": "suspended"}
            )
            plain = await c.post(f"/keys/{gamma_key_id}/revoke")  # the default: streams finish
        for name, r in (("key", cut_key), ("tenant", cut_tenant), ("plain", plain)):
            assert r.status_code == 200, r.text
            ended[name] = r.headers.get("loraplex-streams-ended")

    async def main():
        return await asyncio.gather(
            stream_completion(server.url, acme_key, _body(LONG), on_tokens=counter("acme")),
            stream_completion(server.url, other_key, _body(SHORT), on_tokens=counter("acme-other")),
            stream_completion(server.url, beta_key, _body(LONG), on_tokens=counter("beta")),
            stream_completion(server.url, gamma_key, _body(SHORT), on_tokens=counter("gamma")),
            operator(),
        )

    cut_key, other, cut_tenant, plain, _ = asyncio.run(main())
    assert ended == {"key": "1", "tenant": "1", "plain": None}
    for cut, what in ((cut_key, "API key was revoked"), (cut_tenant, "account was suspended")):
        assert cut.finished and 2 <= cut.tokens < LONG  # [DONE] after the error event
        assert cut.error["code"] == "stream_cut" and what in cut.error["message"]
    # The tenant's other key, and a key revoked without end_streams, run to the end.
    for whole in (other, plain):
        assert whole.finished and whole.error is None and whole.tokens == SHORT
    with server.sessions() as session:
        rows = {r.request_id: r for r in session.scalars(select(UsageRecord))}
    for result, status in ((cut_key, "aborted"), (cut_tenant, "aborted"), (plain, "ok")):
        row = rows[result.request_id]
        assert (row.status, row.completion_tokens) == (status, result.tokens)
    # New requests of a cut-off key or tenant are refused as before.
    for key in (acme_key, beta_key, gamma_key):
        r = httpx.post(f"{server.url}/v1/completions", json=_body(2),
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert r.status_code == 401


def test_end_streams_goes_with_a_suspension(server):
    tenant, _ = server.new_tenant("delta")
    r = httpx.patch(f"{server.url}/admin/api/tenants/{tenant}", headers=ADMIN,
                    params={"end_streams": True}, json={"weight": 2.0})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "end_streams"


def test_the_cli_ends_streams_through_the_server(server, monkeypatch, capsys):
    for var in [v for v in os.environ if v.startswith("LORAPLEX_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", server.settings.database_url)
    tenant, key = server.new_tenant("epsilon")
    with server.sessions() as session:
        key_id = crud.list_keys(session, tenant_id=tenant)[0].id
    assert main(["keys", "revoke", str(key_id), "--end-streams", server.url]) == 2
    assert "LORAPLEX_ADMIN_KEY" in capsys.readouterr().err
    with server.sessions() as session:  # the registry change was made before the call
        assert crud.list_keys(session, tenant_id=tenant)[0].revoked_at is not None
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", ADMIN_KEY)

    _, key = server.new_tenant("zeta")
    received = threading.Event()
    results: list = []

    def stream() -> None:
        results.append(
            asyncio.run(
                stream_completion(server.url, key, _body(LONG), on_tokens=lambda n: received.set())
            )
        )

    thread = threading.Thread(target=stream)
    thread.start()
    assert received.wait(60)
    assert main(["tenants", "suspend", "zeta", "--end-streams", server.url]) == 0
    assert f"{server.url}: 1 running stream(s) ended" in capsys.readouterr().err
    thread.join(60)
    (cut,) = results
    assert cut.finished and cut.error["code"] == "stream_cut" and cut.tokens < LONG
